"""A bad plugin config stops vLLM while it builds its VllmConfig (the API server, before
any engine starts and so before the model loads), where vLLM asks the connector class
``requires_piecewise_for_cudagraph(kv_connector_extra_config)``. Before, it was found only
when the Scheduler built the connector, after the model had loaded (minutes on a GPU).

vLLM asks only on a platform with CUDA graphs (``support_static_graph_mode``) whose
cudagraph mode has full ones (CUDA's default). This machine has no GPU, so each test
marks the CPU platform as one with CUDA graphs: the one fake, for a platform that
cannot be had here; the rest is vLLM's real VllmConfig and MultiConnector.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

from kvhint.engine_plugin.config import KV_ROLE, PluginConfigError, load_plugin_config
from kvhint.engine_plugin.connector import KvHintConnector
from kvhint.engine_plugin.headless import config_only_model_dir

MODULE = "kvhint.engine_plugin.connector"


@pytest.fixture
def cuda_graph_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "support_static_graph_mode",
                        classmethod(lambda cls: True))


def build_config(transfer: KVTransferConfig, enforce_eager: bool = False) -> VllmConfig:
    model_dir = str(config_only_model_dir())
    return VllmConfig(
        model_config=ModelConfig(model=model_dir, tokenizer=model_dir,
                                 skip_tokenizer_init=True, dtype="float32",
                                 max_model_len=256, enforce_eager=enforce_eager),
        device_config=DeviceConfig("cpu"), kv_transfer_config=transfer)


def plugin(extra: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KvHintConnector", kv_connector_module_path=MODULE,
                            kv_role=KV_ROLE, kv_connector_extra_config=extra)


def beside_offloading(extra: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": [
                                {"kv_connector": "KvHintConnector",
                                 "kv_connector_module_path": MODULE, "kv_role": KV_ROLE,
                                 "kv_connector_extra_config": extra},
                                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}]})


BAD = {"worker_id": "w0", "max_sessions": "30", "pin_budget": 0.1}


def expected_message() -> str:
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config(BAD)
    return str(err.value)


@pytest.mark.parametrize("transfer", [plugin, beside_offloading])
def test_a_bad_config_stops_vllm_building_its_config(
        cuda_graph_platform: None, transfer: Any) -> None:
    """The same message as the connector's own check, naming every bad key."""
    with pytest.raises(ValueError) as err:  # pydantic's ValidationError, around ours
        build_config(transfer(BAD))
    says = str(err.value)
    assert expected_message() in says
    assert "kv_connector_extra_config['max_sessions']: " in says
    assert "write 30 without the quotes" in says
    assert "kv_connector_extra_config['pin_budget']: unknown key" in says


def test_a_good_config_builds_and_keeps_full_cuda_graphs(cuda_graph_platform: None) -> None:
    config = build_config(plugin({"worker_id": "w0", "nats_url": "nats://127.0.0.1:4222"}))
    assert config.compilation_config.cudagraph_mode.has_full_cudagraphs()


def test_nats_url_env_is_left_to_the_engine_and_the_rest_still_checked(
        cuda_graph_platform: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable is the engine's environment's: a front end (of a multi-node
    deployment) may lack it, so the early check does not refuse an unset one; the
    connector still does where the engine runs."""
    monkeypatch.delenv("KVHINT_TEST_UNSET", raising=False)
    build_config(plugin({"worker_id": "w0", "nats_url_env": "KVHINT_TEST_UNSET"}))
    with pytest.raises(PluginConfigError, match=r"\['nats_url_env'\]: names"):
        load_plugin_config({"worker_id": "w0", "nats_url_env": "KVHINT_TEST_UNSET"})
    with pytest.raises(ValueError, match=r"\['nats_url_env'\]"):
        build_config(plugin({"nats_url_env": 5}))


def test_without_full_cuda_graphs_vllm_does_not_ask(cuda_graph_platform: None) -> None:
    """--enforce-eager (and CPU, and a piecewise-only mode): vLLM never asks, and the
    connector's constructor (in the engine, after the model loads) is the check."""
    config = build_config(plugin(BAD), enforce_eager=True)
    with pytest.raises(PluginConfigError):
        KvHintConnector.requires_piecewise_for_cudagraph(
            config.kv_transfer_config.kv_connector_extra_config)
    assert KvHintConnector.requires_piecewise_for_cudagraph({"worker_id": "w0"}) is False
