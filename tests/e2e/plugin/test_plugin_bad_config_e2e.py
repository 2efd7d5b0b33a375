"""End to end: ``vllm serve`` with a bad plugin config stops before any engine starts,
with the plugin's message, where vLLM builds its config and asks the connector class
``requires_piecewise_for_cudagraph`` (docs/engine_plugin.md, "When the check runs").
Before, the server loaded the model and sized the KV cache first (minutes on a GPU with
a large model), and only the Scheduler building the connector found the typo.

vLLM asks only on a platform with CUDA graphs; this machine has none, so the server's
process marks the CPU platform as one (the one fake: a platform that cannot be had
here). Without ``--enforce-eager``, as a GPU server runs by default; the engine never
starts, so nothing is compiled.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvhint.engine_plugin.config import PluginConfigError, load_plugin_config
from kvhint.router.devstack.ports import free_port
from kvhint.router.devstack.up import plugin_transfer_config
from kvhint.router.devstack.vllm_server import VllmWorkerSpec

LAUNCH = """import runpy, sys
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.support_static_graph_mode = classmethod(lambda cls: True)
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""
# vLLM's own lines for the engine's start and the model's load (EngineCore,
# cpu_model_runner / gpu_model_runner).
ENGINE_STARTED = "Initializing a V1 LLM engine"
MODEL_LOADING = "Starting to load model"


def test_a_bad_config_stops_vllm_serve_before_the_model_loads(tiny_model_dir: Path) -> None:
    extra = {"worker_id": "w0", "max_sessions": "30", "pin_budget": 0.1}
    transfer = {**plugin_transfer_config("w0", "nats://127.0.0.1:1"),
                "kv_connector_extra_config": extra}
    spec = VllmWorkerSpec(model_dir=tiny_model_dir, port=free_port(),
                          kv_transfer_config=transfer)
    module_args = spec.command()[3:]  # after: python -m vllm.entrypoints.openai.api_server
    done = subprocess.run([sys.executable, "-c", LAUNCH, *module_args],
                          env=spec.environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
    log = done.stdout
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config(extra)
    assert done.returncode != 0, log[-3000:]
    assert str(err.value) in log, log[-3000:]
    assert "write 30 without the quotes" in log
    assert ENGINE_STARTED not in log and MODEL_LOADING not in log, log[-3000:]
