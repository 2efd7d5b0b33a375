"""vLLM finds the connector by name (its MultiConnector looks children up that way)."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvhint.engine_plugin import vllm_plugin
from kvhint.engine_plugin.connector import KvHintConnector


def test_the_connector_is_registered_by_name_once_and_by_the_entry_point() -> None:
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads general plugins once per process, maybe more
    assert KVConnectorFactory.get_connector_class_by_name("KvHintConnector") is KvHintConnector
    (entry,) = [e for e in entry_points(group="vllm.general_plugins")
                if e.value.startswith("kvhint.")]
    assert entry.load() is vllm_plugin.register
