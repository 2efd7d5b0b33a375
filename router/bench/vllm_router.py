"""The Rust ``vllm-router`` (PyPI ``vllm-router``) as a baseline: start it in front of
workers with a policy (``cache_aware``; ``kv_aware`` fed by the workers' ZMQ KV events)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from kvhint.router.devstack.nats_server import free_port
from kvhint.router.service.launch import ChildProcess


def vllm_router_binary() -> str:
    local = Path(sys.executable).parent / "vllm-router"
    if local.exists():
        return str(local)
    found = shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
    return found


def zmq_events_config(port: int) -> dict[str, object]:
    """``--kv-events-config`` for a vLLM worker publishing KV events on ``port``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{port}", "topic": "kv-events"}


class VllmRouterProcess(ChildProcess):
    def __init__(self, port: int, worker_urls: Sequence[str], policy: str, log_path: Path,
                 kv_event_endpoints: Sequence[str] = (), block_size: int = 32,
                 model: str = "tiny") -> None:
        super().__init__(log_path)
        self.port = port
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.kv_event_endpoints = list(kv_event_endpoints)
        self.block_size = block_size
        self.model = model

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        command = [vllm_router_binary(), "--host", "127.0.0.1", "--port", str(self.port),
                   "--policy", self.policy, "--worker-urls", *self.worker_urls,
                   "--log-level", "warning",
                   # Its Prometheus exporter listens on a fixed port unless told otherwise.
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        for url, endpoint in zip(self.worker_urls, self.kv_event_endpoints, strict=False):
            command += ["--kv-event-source", f"{url}={endpoint}"]
        if self.kv_event_endpoints:
            command += ["--kv-event-block-size", str(self.block_size),
                        "--kv-event-model", self.model]
        return command

    def start(self, timeout_s: float = 60.0) -> None:
        self._spawn(self.command())
        self._wait_http(f"{self.url}/v1/models", timeout_s)
