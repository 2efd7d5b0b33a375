"""The shipped vLLM workers leave vLLM's Responses store off (``VLLM_ENABLE_RESPONSES_API_STORE``,
read by vLLM itself here), as vLLM ships it: on, vLLM keeps every stored response in the
API server's memory until it restarts (its envs.py calls it a memory leak), and
``store`` defaults to true. Both files say how to switch it on (docs/router.md, the
Responses API: without it ``previous_response_id``, ``GET`` and cancel answer 404)."""

from __future__ import annotations

import pytest
import yaml
from vllm import envs as vllm_envs

from deploy_manifests import DEPLOY, interpolated, k8s_container, k8s_env, k8s_secrets

VARIABLE = "VLLM_ENABLE_RESPONSES_API_STORE"


def _vllm_stores(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether a vLLM server with ``env`` stores responses, as vLLM 0.32 reads it
    (responses/serving.py: ``self.enable_store = envs.VLLM_ENABLE_RESPONSES_API_STORE``)."""
    monkeypatch.delenv(VARIABLE, raising=False)
    if VARIABLE in env:
        monkeypatch.setenv(VARIABLE, env[VARIABLE])
    return bool(vllm_envs.environment_variables[VARIABLE]())


def test_compose_workers_leave_the_store_off_and_say_how_to_switch_it_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    raw = (DEPLOY / "compose.yaml").read_text()
    text = interpolated(raw, {"KVHINT_NATS_PASSWORD": "pw", "KVHINT_WORKER_API_KEY": "key",
                              "KVHINT_ADMIN_KEY": "admin"})
    services = yaml.safe_load(text)["services"]
    workers = [name for name in services if name.startswith("worker-")]
    assert workers == ["worker-0", "worker-1"]
    for name in workers:
        env = {k: str(v) for k, v in services[name].get("environment", {}).items()}
        assert not _vllm_stores(env, monkeypatch), name
    assert f'{VARIABLE}: "1"' in raw and "memory leak" in raw


def test_kubernetes_workers_leave_the_store_off_and_say_how_to_switch_it_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = k8s_env(k8s_container("vllm-worker"), k8s_secrets(), pod_name="vllm-worker-0")
    assert not _vllm_stores(env, monkeypatch)
    raw = (DEPLOY / "kubernetes" / "vllm-workers.yaml").read_text()
    assert f'# - {{name: {VARIABLE}, value: "1"}}' in raw and "memory leak" in raw


def test_the_variable_as_vllm_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading above is vLLM's own: unset, off; "1", on."""
    assert not _vllm_stores({}, monkeypatch)
    assert _vllm_stores({VARIABLE: "1"}, monkeypatch)
