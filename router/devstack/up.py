"""``kvhint up`` / ``make run``: the whole stack on embedded defaults.

Builds the tiny model if missing, uses the NATS already listening on the URL or starts
one, starts the vLLM CPU workers (with the engine plugin when it is installed) and the
router on SQLite, prints the URLs and a curl to try, and on Ctrl-C stops everything it
started, in reverse order. Parts that are not built yet are named, not faked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import httpx

from kvhint.router.devstack.nats_server import running_nats
from kvhint.router.devstack.process_groups import die_with_parent, stop_process_groups
from kvhint.router.devstack.tiny_model import RECIPE_VERSION, build_tiny_model
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec, stop_servers
from kvhint.router.service.launch import SHUTDOWN_GRACE_ENV, router_stop_grace_s

PLUGIN_MODULE = "kvhint.engine_plugin.connector"
ROUTER_MODULE = "kvhint.router.server_cli"
# How long each part may take to exit after SIGTERM before it is killed. A running vLLM
# server exits in about a second (it aborts what is in flight); one whose engine is
# still starting ignores SIGTERM, so waiting longer only delays Ctrl-C.
WORKER_STOP_GRACE_S = 10.0
# A worker that exits this many times within CRASH_LOOP_WINDOW_S (started again each
# time, and each time it came up) is crash-looping (out of memory at its first request, a
# bad flag read late): the stack stops, saying so, instead of restarting it forever.
CRASH_LOOP_EXITS = 3
CRASH_LOOP_WINDOW_S = 600.0
# The dev router's grace for open connections at Ctrl-C (http_shutdown_grace_s: 30 s by
# default, long for a laptop), and how long it is waited for: its grace and its own stop
# after it (launch.router_stop_grace_s). Before, 15 s against the router's 30 s grace: a
# stream still open at Ctrl-C had the router killed before its store's last flush.
DEV_ROUTER_SHUTDOWN_GRACE_S = 5.0
ROUTER_STOP_GRACE_S = router_stop_grace_s(DEV_ROUTER_SHUTDOWN_GRACE_S)


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


# An agent's request with `tools` (tool_choice "auto", the OpenAI SDKs' default) was a
# 400 from plain vLLM ("auto" tool choice requires --enable-auto-tool-choice and
# --tool-call-parser); the dev workers take it as a tool-calling model's server does.
# hermes: the common `<tool_call>{json}</tool_call>` form, no special tokens needed.
DEV_WORKER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def worker_spec(options: DevStackOptions, model_dir: Path, index: int,
                plugin_nats_url: str | None, cores: int) -> VllmWorkerSpec:
    """Worker ``w<index>``'s vLLM server; with the engine plugin on ``plugin_nats_url``
    (None: plain vLLM, the plugin not installed)."""
    return VllmWorkerSpec(
        model_dir=model_dir,
        port=options.worker_base_port + index,
        kv_cache_tokens=options.kv_cache_tokens,
        kv_transfer_config=plugin_transfer_config(f"w{index}", plugin_nats_url)
        if plugin_nats_url is not None else None,
        cpu_bind=str(index % cores) if options.workers > 1 else None,
        extra_args=DEV_WORKER_ARGS,
    )


def _say(message: str) -> None:
    print(f"[kvhint up] {message}", flush=True)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop_on_signals(stop: threading.Event, hurry: threading.Event) -> dict[int, object]:
    """First SIGINT/SIGTERM/SIGHUP: stop in order, each part given its grace period.
    Any further one: ``hurry``, which cuts the graces short (SIGKILL what is left).
    A closed terminal (SIGHUP) stops the stack too: the children run in sessions of
    their own and would never see the hangup. Returns the handlers it replaced."""
    def on_signal(*_: object) -> None:
        if stop.is_set():
            hurry.set()
        stop.set()

    return {sig: signal.signal(sig, on_signal) for sig in _STOP_SIGNALS}


def run_dev_stack(options: DevStackOptions) -> int:
    """The stack until a stop signal; the signal handlers it set are put back on return
    (a caller in the same process, pytest's Ctrl-C one, keeps its own)."""
    stop, hurry = threading.Event(), threading.Event()
    replaced = _stop_on_signals(stop, hurry)
    try:
        return _run_dev_stack(options, stop, hurry)
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _run_dev_stack(options: DevStackOptions, stop: threading.Event,
                   hurry: threading.Event) -> int:
    state = options.state_dir.resolve()
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    taken = _ports_taken([options.router_port] + [options.worker_base_port + index
                                                  for index in range(options.workers)])
    if taken:
        _say(f"port(s) {', '.join(map(str, taken))} already in use (another `make run`?); "
             "stop it, or pick others with --router-port / --worker-base-port "
             "(make run UP_ARGS='--router-port 9090')")
        return 1

    model_dir = state / "models" / RECIPE_VERSION
    _say(f"model: {model_dir} (building if missing)")
    build_tiny_model(model_dir)
    if stop.is_set():
        return 130

    # Exits in reverse order: the router, then every worker together, then NATS.
    with ExitStack() as stack:
        try:
            return _start_and_serve(options, stack, model_dir, logs, stop, hurry)
        finally:
            _say("stopping everything started here (Ctrl-C again kills it at once)")


def _start_and_serve(options: DevStackOptions, stack: ExitStack, model_dir: Path, logs: Path,
                     stop: threading.Event, hurry: threading.Event) -> int:
    # Every part started here is SIGTERMed by the kernel if kvhint up itself is killed
    # outright (kill -9 runs no handler): none is left holding its port.
    preexec = die_with_parent()
    nats = stack.enter_context(running_nats(options.nats_url, log_path=logs / "nats.log",
                                            preexec=preexec))
    _say(f"NATS: {nats.url} ({'started here' if nats.started_here else 'already running'})")
    if not nats.jetstream:
        _say(f"WARNING: the NATS server at {nats.url} has no JetStream: the router runs "
             "without replayed KV events and hint outcomes (start it with -js, or "
             "point --nats-url elsewhere)")

    with_plugin = _module_available(PLUGIN_MODULE)
    if not with_plugin:
        _say("engine plugin not built yet: workers run plain vLLM")
    cores = os.cpu_count() or 1
    servers: list[tuple[str, VllmServer]] = []
    stack.callback(lambda: stop_servers([s for _, s in servers], WORKER_STOP_GRACE_S, hurry))
    for index in range(options.workers):
        worker_id = f"w{index}"
        spec = worker_spec(options, model_dir, index, nats.url if with_plugin else None, cores)
        server = VllmServer(spec, logs / f"worker-{worker_id}.log", preexec=preexec)
        servers.append((worker_id, server))
        server.start()
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
    with_router = _module_available(ROUTER_MODULE)
    if with_router:
        router = _start_router(options, nats.url, servers, logs.parent, logs, preexec)
        stack.callback(stop_process_groups, [router], ROUTER_STOP_GRACE_S, hurry)
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

    for line in ready_lines(entry, [(wid, server.url) for wid, server in servers], with_router):
        _say(line)
    return supervise(servers, router if with_router else None, logs, stop, hurry)


def supervise(servers: list[tuple[str, VllmServer]], router: subprocess.Popen[bytes] | None,
              logs: Path, stop: threading.Event, hurry: threading.Event,
              poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> int:
    """Until a stop signal: a worker that exits (crashed, killed, out of memory) is
    started again while the router routes its requests to the others, as a fleet's
    supervisor would (before, one worker's exit stopped the whole stack, so killing a
    worker to watch the router route around it took everything down); one that fails to
    start again stops the stack with its log's tail. The router exiting stops the stack
    (before, nothing said so and ``kvhint up`` went on waiting with no entry point). A
    worker exiting :data:`CRASH_LOOP_EXITS` times within :data:`CRASH_LOOP_WINDOW_S`
    stops the stack too (before, it was started again forever)."""
    exits: dict[str, list[float]] = {}
    while not stop.wait(poll_s):
        if router is not None and router.poll() is not None:
            _say(f"the router exited with code {router.returncode} "
                 f"(see {logs / 'router.log'}); stopping")
            return 1
        for worker_id, server in servers:
            if server.running or stop.is_set():
                continue
            now = clock()
            recent = [at for at in exits.get(worker_id, []) if now - at < CRASH_LOOP_WINDOW_S]
            exits[worker_id] = recent + [now]
            if len(exits[worker_id]) >= CRASH_LOOP_EXITS:
                _say(f"worker {worker_id} exited with code {server.exit_code}, its "
                     f"{CRASH_LOOP_EXITS}th exit in {CRASH_LOOP_WINDOW_S:.0f} s (log: "
                     f"{server.log_path}): it is crash-looping; stopping")
                return 1
            meanwhile = ("the router sends its requests to the other workers meanwhile"
                         if len(servers) > 1 else "requests fail until it is back")
            _say(f"worker {worker_id} exited with code {server.exit_code} "
                 f"(log: {server.log_path}); {meanwhile}; starting it again")
            try:
                server.restart(WORKER_STOP_GRACE_S, hurry)
                server.wait_ready(stop=stop)
            except RuntimeError as exc:
                _say(f"worker {worker_id} failed to start again: {exc}")
                return 1
            if not stop.is_set():
                _say(f"worker {worker_id} is back on {server.url}")
    return 0


# A system prompt long enough (46 tokens with the tiny model's tokenizer) that the
# prompt fills a whole 32-token KV block: vLLM caches and reports only whole blocks, so
# the "hi" alone (6 tokens) never showed a cache hit however often it was sent.
DEMO_SYSTEM_PROMPT = ("You are a helpful assistant that reads files and answers questions "
                      "about them, one step at a time.")


def demo_request_body() -> dict[str, object]:
    return {"model": "tiny",
            "messages": [{"role": "system", "content": DEMO_SYSTEM_PROMPT},
                         {"role": "user", "content": "hi"}],
            "max_tokens": 8, "session_id": "demo"}


def ready_lines(entry: str, workers: list[tuple[str, str]], with_router: bool) -> list[str]:
    """What ``kvhint up`` prints once everything answers: each URL an operator opens and
    a request to try whose second sending shows the cache hit."""
    lines = ["ready:"] + [f"  worker {wid}: {url}" for wid, url in workers]
    lines.append(f"  entry point: {entry}")
    if with_router:
        lines += [f"  dashboard: {entry}/dashboard",
                  f"  metrics: {entry}/metrics  (health: {entry}/health, {entry}/ready)"]
    lines += [f"  try: curl -s {entry}/v1/chat/completions -H 'content-type: application/json' "
              f"-d '{json.dumps(demo_request_body(), separators=(',', ':'))}'",
              "  send it twice: the second answer's usage.prompt_tokens_details.cached_tokens "
              "is the cached prefix (whole 32-token blocks)",
              "Ctrl-C stops everything started here"]
    return lines


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
                  logs: Path, preexec: Callable[[], None] | None) -> subprocess.Popen[bytes]:
    workers = ",".join(f"{wid}={server.url}" for wid, server in servers)
    env = dict(os.environ)
    env.update({
        "KVHINT_ROUTER_PORT": str(options.router_port),
        "KVHINT_ROUTER_WORKERS": workers,
        "KVHINT_ROUTER_NATS_URL": nats_url,
        "KVHINT_ROUTER_DATABASE_URL": f"sqlite:///{state / 'router.db'}",
        # What ROUTER_STOP_GRACE_S waits for (not an operator's own: it may be longer).
        SHUTDOWN_GRACE_ENV: str(DEV_ROUTER_SHUTDOWN_GRACE_S),
        "PYTHONUNBUFFERED": "1",
    })
    with open(logs / "router.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kvhint.router.cli", "router"],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=preexec)


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
