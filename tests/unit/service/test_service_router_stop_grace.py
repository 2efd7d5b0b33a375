"""Whatever stops the router waits for its whole stop before it kills it: the HTTP
server's grace for open connections (``http_shutdown_grace_s``), then the lifespan's end
(NATS drained, the store's last flush). Killed sooner, a router with a stream open through
the grace never reaches its last flush (launch.STOP_AFTER_GRACE_S)."""

from __future__ import annotations

import inspect
import re

import pytest
import yaml

from deploy_manifests import DEPLOY, k8s_config_map, k8s_workload
from kvhint.router.devstack import up
from kvhint.router.service.launch import (
    DEFAULT_SHUTDOWN_GRACE_S,
    SHUTDOWN_GRACE_ENV,
    STOP_AFTER_GRACE_S,
    RouterProcess,
    router_stop_grace_s,
)
from kvhint.router.service.settings import RouterSettings
from kvhint.router.store.database import WRITE_LOCK_WAIT_S
from kvhint.router.store.writer import StoreWriter

pytestmark = pytest.mark.unit


def _grace_of(config_text: str) -> float:
    """The http_shutdown_grace_s a router config file sets, else the settings' default."""
    config = yaml.safe_load(config_text) or {}
    return float(config.get("http_shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S))


def _seconds(value: str | int) -> float:
    """A compose duration ("60s", "1m30s") or a number of seconds."""
    if isinstance(value, int):
        return float(value)
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", value)
    assert parts is not None and value, value
    return 60.0 * int(parts.group(1) or 0) + int(parts.group(2) or 0)


def test_the_stop_after_the_grace_covers_the_drain_and_the_last_flush() -> None:
    assert DEFAULT_SHUTDOWN_GRACE_S == RouterSettings.model_fields[
        "http_shutdown_grace_s"].default
    store_retry = inspect.signature(StoreWriter.close).parameters["retry_for_s"].default
    # A flush in progress when the stop begins: a lock wait, or a connect that fails.
    in_progress = max(WRITE_LOCK_WAIT_S,
                      RouterSettings.model_fields["store_connect_timeout_s"].default)
    nats_drain = 5.0  # nats_link.NatsLink._close_client's wait for nc.drain()
    assert STOP_AFTER_GRACE_S >= store_retry + in_progress + nats_drain


def test_compose_waits_for_the_routers_whole_stop() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    grace = _grace_of((DEPLOY / "router.yaml").read_text())
    waited = _seconds(compose["services"]["router"].get("stop_grace_period", "10s"))
    assert waited >= router_stop_grace_s(grace)


def _pre_stop_s(container: dict) -> float:
    """The seconds a container's preStop hook holds SIGTERM back: ``sleep N`` exec'd, or
    the sleep action (0: none)."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def test_kubernetes_waits_for_the_routers_whole_stop() -> None:
    """The pod's preStop sleep holds SIGTERM back until it left the Service's endpoints
    (SIGTERM at once closed the listener while connections still came); kubelet counts
    that sleep in terminationGracePeriodSeconds, so the grace covers it and the whole
    stop after it."""
    grace = _grace_of(k8s_config_map("kvhint-router")["data"]["router.yaml"])
    pod = k8s_workload("kvhint-router")["spec"]["template"]["spec"]
    (router,) = [c for c in pod["containers"] if c["name"] == "router"]
    pre_stop = _pre_stop_s(router)
    assert pre_stop >= 5, "no preStop delay: the pod is stopped while still an endpoint"
    waited = float(pod.get("terminationGracePeriodSeconds", 30))
    assert waited >= pre_stop + router_stop_grace_s(grace)


def test_kvhint_up_waits_for_the_dev_routers_whole_stop() -> None:
    assert up.ROUTER_STOP_GRACE_S >= router_stop_grace_s(up.DEV_ROUTER_SHUTDOWN_GRACE_S)
    source = inspect.getsource(up._start_router)
    assert "SHUTDOWN_GRACE_ENV: str(DEV_ROUTER_SHUTDOWN_GRACE_S)" in source


def test_a_router_process_is_waited_for_by_its_grace(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path) -> None:  # noqa: ANN001
    waited: list[float] = []
    monkeypatch.setattr("kvhint.router.service.launch.ChildProcess.stop",
                        lambda self, timeout_s=20.0: waited.append(timeout_s))
    monkeypatch.delenv(SHUTDOWN_GRACE_ENV, raising=False)
    RouterProcess({}, tmp_path / "log", 1).stop()
    RouterProcess({SHUTDOWN_GRACE_ENV: "2"}, tmp_path / "log", 1).stop()
    assert waited == [router_stop_grace_s(DEFAULT_SHUTDOWN_GRACE_S), router_stop_grace_s(2.0)]
