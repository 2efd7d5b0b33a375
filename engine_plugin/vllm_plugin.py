"""vLLM general plugin (entry point group ``vllm.general_plugins``, see pyproject.toml).

vLLM calls :func:`register` in each of its processes (API server, engine core, workers)
once the ``kvhint`` package is installed. It makes ``KvHintConnector`` known to vLLM's
``KVConnectorFactory`` by name, as vLLM's built-in connectors are: a ``MultiConnector``
(the plugin beside vLLM's OffloadingConnector, for Demote) rebuilds its children's stats
in the API-server process by class name, and without this the lookup fails there and
stops the server's output handler. It also lets ``"kv_connector": "KvHintConnector"``
work without ``kv_connector_module_path``.
"""

from __future__ import annotations

CONNECTOR_MODULE = "kvhint.engine_plugin.connector"
CONNECTOR_CLASS = "KvHintConnector"


def register() -> None:
    from kvhint.engine_plugin.vllm_adapter import register_connector_name

    register_connector_name(CONNECTOR_CLASS, CONNECTOR_MODULE)
