"""``kvhint up`` / ``make run``: the whole stack on embedded defaults.

Builds the tiny model if missing, uses the NATS already listening on the URL or starts
one, starts the vLLM CPU workers (with the engine plugin when it is installed) and the
router on SQLite, prints the URLs and a curl to try, and on Ctrl-C stops everything it
started, in reverse order. Parts that are not built yet are named, not faked.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import httpx

from kvhint.router.devstack.nats_server import running_nats
from kvhint.router.devstack.tiny_model import RECIPE_VERSION, build_tiny_model
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec

PLUGIN_MODULE = "kvhint.engine_plugin.connector"
ROUTER_MODULE = "kvhint.router.server_cli"


@dataclass(frozen=True)
class DevStackOptions:
    state_dir: Path
    router_port: int = 8080
    worker_base_port: int = 8001
    workers: int = 2
    nats_url: str = "nats://127.0.0.1:4222"
    kv_cache_tokens: int = 16_384


def _module_available(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def plugin_transfer_config(worker_id: str, nats_url: str) -> dict[str, object]:
    return {
        "kv_connector": "KvHintConnector",
        "kv_connector_module_path": PLUGIN_MODULE,
        "kv_role": "kv_producer",  # kvhint.engine_plugin.config.KV_ROLE (a test checks)
        "kv_connector_extra_config": {"worker_id": worker_id, "nats_url": nats_url},
    }


def _say(message: str) -> None:
    print(f"[kvhint up] {message}", flush=True)


def run_dev_stack(options: DevStackOptions) -> int:
    state = options.state_dir.resolve()
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    # A closed terminal (SIGHUP) stops the stack too: the children run in sessions of
    # their own and would never see the hangup.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    taken = _ports_taken([options.router_port] + [options.worker_base_port + index
                                                  for index in range(options.workers)])
    if taken:
        _say(f"port(s) {', '.join(map(str, taken))} already in use (another `make run`?); "
             "stop it, or pick others with --router-port / --worker-base-port")
        return 1

    model_dir = state / "models" / RECIPE_VERSION
    _say(f"model: {model_dir} (building if missing)")
    build_tiny_model(model_dir)
    if stop.is_set():
        return 130

    with ExitStack() as stack:
        nats = stack.enter_context(running_nats(options.nats_url, log_path=logs / "nats.log"))
        _say(f"NATS: {nats.url} ({'started here' if nats.started_here else 'already running'})")
        if not nats.jetstream:
            _say(f"WARNING: the NATS server at {nats.url} has no JetStream: the router runs "
                 "without replayed KV events and hint outcomes (start it with -js, or "
                 "point --nats-url elsewhere)")

        with_plugin = _module_available(PLUGIN_MODULE)
        if not with_plugin:
            _say("engine plugin not built yet: workers run plain vLLM")
        cores = os.cpu_count() or 1
        servers = []
        for index in range(options.workers):
            worker_id = f"w{index}"
            spec = VllmWorkerSpec(
                model_dir=model_dir,
                port=options.worker_base_port + index,
                kv_cache_tokens=options.kv_cache_tokens,
                kv_transfer_config=plugin_transfer_config(worker_id, nats.url)
                if with_plugin else None,
                cpu_bind=str(index % cores) if options.workers > 1 else None,
            )
            server = VllmServer(spec, logs / f"worker-{worker_id}.log")
            stack.callback(server.stop)
            server.start()
            servers.append((worker_id, server))
        for worker_id, server in servers:
            _say(f"waiting for worker {worker_id} on {server.url} (log: {server.log_path})")
            try:
                server.wait_ready(stop=stop)
            except RuntimeError as exc:
                _say(f"worker {worker_id} failed: {exc}")
                return 1
            if stop.is_set():
                return 130

        entry = servers[0][1].url
        if _module_available(ROUTER_MODULE):
            router = _start_router(options, nats.url, servers, state, logs)
            stack.callback(_stop_process, router)
            entry = f"http://127.0.0.1:{options.router_port}"
            try:
                _wait_http(f"{entry}/ready", router, stop)
            except RuntimeError as exc:
                _say(f"{exc}; see {logs / 'router.log'}")
                return 1
            if stop.is_set():
                return 130
        else:
            _say("router not built yet: talk to a worker directly")

        _say("ready:")
        for worker_id, server in servers:
            _say(f"  worker {worker_id}: {server.url}")
        _say(f"  entry point: {entry}")
        _say(f"  try: curl -s {entry}/v1/chat/completions -H 'content-type: application/json' "
             "-d '{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
             "\"max_tokens\":8,\"session_id\":\"demo\"}'")
        _say("Ctrl-C stops everything started here")
        while not stop.wait(1.0):
            dead = [wid for wid, server in servers if not server.running]
            if dead:
                _say(f"worker(s) {', '.join(dead)} exited; stopping (see {logs})")
                return 1
        _say("stopping")
    return 0


def _ports_taken(ports: list[int]) -> list[int]:
    """The ports something on 127.0.0.1 already listens on."""
    taken = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                taken.append(port)
    return taken


def _start_router(options: DevStackOptions, nats_url: str, servers, state: Path,
                  logs: Path) -> subprocess.Popen[bytes]:
    workers = ",".join(f"{wid}={server.url}" for wid, server in servers)
    env = dict(os.environ)
    env.update({
        "KVHINT_ROUTER_PORT": str(options.router_port),
        "KVHINT_ROUTER_WORKERS": workers,
        "KVHINT_ROUTER_NATS_URL": nats_url,
        "KVHINT_ROUTER_DATABASE_URL": f"sqlite:///{state / 'router.db'}",
        "PYTHONUNBUFFERED": "1",
    })
    with open(logs / "router.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kvhint.router.cli", "router"],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait_http(url: str, proc: subprocess.Popen[bytes], stop: threading.Event,
               timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    if not stop.is_set():
        raise RuntimeError(f"the router did not answer {url} within {timeout_s:.0f}s")


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
