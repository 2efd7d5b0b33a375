"""Added latency and throughput of the kvhint router vs calling the worker directly vs
the Rust vllm-router, all in front of the same vLLM CPU worker, side by side in one run.

    .venv/bin/python tests/benchmarks/service/bench_service_overhead.py \
        [--rounds 6] [--json out.json]

(It takes the machine-wide vLLM lock itself; wrapping it in ``flock`` on the same file
deadlocks.)

Rounds interleave the three targets (direct, kvhint, vllm-router) in a shuffled order, so
machine noise hits all of them alike. The proxies' own CPU time per request (from
/proc, per phase) is reported too: on a loaded 2-core machine it is the figure noise
cannot move. Reported: p50/p90 latency per target at 1 stream
(non-streaming completion, 1 output token: the proxy's cost dominates the spread) and the
added p50 over direct; at 32 concurrent streams (streaming chat, 16 tokens): requests/s
and p50 latency, with the ratio to direct. Medians of per-round values.

Both phases run twice: once as before (no session id), once with a session id
(``x-session-id``) on every request, as agents send: at 1 stream, ``--sessions`` ids taken
in turn (each id's turns share its first words), at 32 streams one id per stream, kept
across rounds; so every turn after a session's first is one of a session the router holds
in memory. Two kvhint routers run side by side: ``kvhint`` with ``routing.session_refresh``
on (the default: each such turn first reads the session's stored row) and
``kvhint-norefresh`` with it off, so the difference between them is that read's cost.
``--sessions 0`` leaves the session phases out; ``--no-refresh-off`` the second router.

At 32 streams each round also gives, per target, vLLM's own mean end-to-end time (from
its /metrics) subtracted from the client's mean latency (``in_front_of_engine_ms``: the
client, the proxy and the machine's run queue, not the engine) and the share of the
phase's wall time some task waited for a CPU (``per_round_cpu_pressure``, Linux PSI).

Pinning (default on, ``--no-pin`` leaves every process but vLLM's model threads to float
as before): on a 2-core machine every thread of vLLM's processes (API server, engine
core, model) is bound to CPU 1 and the proxies (both kvhint routers, vllm-router, with
their threads and children) and this client to CPU 0, so the proxies compete with each
other's idle loops and the client, not with vLLM's front end, and the per-round ratios
swing less. It is a choice for this comparison only (one worker, one core each side):
it could hurt a run with more cores or workers (the client and a proxy then share one
core where they could use more), so it is skipped where CPUs 0 and 1 are not both
this script's to use, and turned off by ``--no-pin``; what was pinned is in the report
(``pinning``). NATS (started outside this script where one already runs) and other
processes still float. The per-round ratios (``vs_direct_median_of_rounds``) are still
what to compare. Pinned, vLLM has one core for all its processes, so its req/s is lower
than unpinned (it is the bottleneck every target shares), CPU pressure (PSI) mostly
counts vLLM's own threads waiting on CPU 1, and the 1-stream figures and the proxies'
CPU per request come out higher (client and proxy share CPU 0): compare those only
between runs with the same placement.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import httpx
import psutil

from kvhint.router.bench.vllm_router import VllmRouterProcess
from kvhint.router.devstack.nats_server import free_port, running_nats
from kvhint.router.devstack.tiny_model import RECIPE_VERSION, build_tiny_model
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec, pin_threads
from kvhint.router.service.launch import RouterProcess
from kvhint.router.service.nats_link import remove_streams
from kvhint.schemas import Subjects

REPO = Path(__file__).resolve().parents[3]
LOCK = Path("/tmp/kvhint-vllm-servers.lock")


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(n))


SESSION_HEADER = "x-session-id"


def session_prefix(session_id: str) -> str:
    """A session's first 16 words, the same in each of its turns (a prompt prefix reused)."""
    return words(random.Random(session_id), 16)


async def one_stream(session: aiohttp.ClientSession, url: str, n: int, rng: random.Random,
                     sessions: int = 0) -> list[float]:
    """``sessions`` > 0: each request carries one of that many session ids, in turn; the
    same 24-word prompt size, its first 16 words the session's own."""
    latencies = []
    for number in range(n):
        headers = {}
        if sessions:
            sid = f"bench-one-{number % sessions}"
            headers[SESSION_HEADER] = sid
            prompt = f"{session_prefix(sid)} {words(rng, 8)}"
        else:
            prompt = words(rng, 24)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body,
                                headers=headers) as response:
            await response.read()
            assert response.status == 200, await response.text()
        latencies.append(time.perf_counter() - started)
    return latencies


async def many_streams(session: aiohttp.ClientSession, url: str, streams: int,
                       duration_s: float, rng: random.Random, with_sessions: bool = False
                       ) -> tuple[float, list[float]]:
    """``with_sessions``: stream ``i`` is an agent with session id ``bench-many-i`` (the
    same across rounds), its system message the session's own words."""
    latencies: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def loop(index: int, seed: int) -> None:
        local = random.Random(seed)
        headers = {}
        messages_head = []
        if with_sessions:
            sid = f"bench-many-{index}"
            headers[SESSION_HEADER] = sid
            messages_head = [{"role": "system", "content": session_prefix(sid)}]
        while time.perf_counter() < deadline:
            body = {"model": "tiny", "max_tokens": 16, "stream": True,
                    "messages": [*messages_head, {"role": "user",
                                                  "content": words(local, 24)}]}
            started = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=body,
                                    headers=headers) as response:
                async for _chunk in response.content.iter_any():
                    pass
                assert response.status == 200
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(loop(index, rng.randrange(1 << 30)) for index in range(streams)))
    return len(latencies) / (time.perf_counter() - started), latencies


def engine_e2e(worker_url: str) -> tuple[float, float]:
    """vLLM's own end-to-end time of the requests it finished (seconds, count: its
    ``vllm:e2e_request_latency_seconds``), to tell its time from what is spent in front
    of it (the client, a proxy, the machine's run queue)."""
    total = count = 0.0
    for line in httpx.get(f"{worker_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:e2e_request_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:e2e_request_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def cpu_pressure_us() -> float | None:
    """Time some runnable task waited for a CPU, machine-wide (PSI), in microseconds."""
    try:
        with open("/proc/pressure/cpu") as pressure:
            return float(pressure.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def pin_tree(pid: int, cpus: set[int], children: bool = True) -> int:
    """Bind every thread of process ``pid`` and (``children``) of its descendants to
    ``cpus`` (threads created later inherit it); returns how many threads were bound."""
    try:
        process = psutil.Process(pid)
        family = [process, *(process.children(recursive=True) if children else ())]
    except psutil.NoSuchProcess:
        return 0
    return pin_threads([member.pid for member in family], cpus)


def load_1m() -> float:
    """The machine's 1-minute load average."""
    return os.getloadavg()[0]


def q(values: list[float], quantile: float) -> float:
    values = sorted(values)
    return values[min(int(quantile * len(values)), len(values) - 1)]


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds a process has used (0 for the direct target)."""
    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def measure(targets: dict[str, str], pids: dict[str, int | None], rounds: int,
                  per_round: int, duration_s: float, streams: int, sessions: int) -> dict:
    rng = random.Random(0)
    # Phases: (report key, 1 stream or 32, with session ids).
    phases = [("one_stream", False, False), ("many_streams", True, False)]
    if sessions:
        phases += [("one_stream_sessions", False, True), ("many_streams_sessions", True, True)]
    single: dict[str, dict[str, list[list[float]]]] = {
        key: {name: [] for name in targets} for key, many, _ in phases if not many}
    multi: dict[str, dict[str, list[tuple[float, float]]]] = {
        key: {name: [] for name in targets} for key, many, _ in phases if many}
    # Proxy CPU per request (noise-proof: what the proxy itself burns per request).
    cpu: dict[str, dict[str, list[float]]] = {
        key: {name: [] for name in targets} for key, _, _ in phases}
    # 32 streams, per round: the client's mean latency minus vLLM's own mean e2e (the
    # time in front of the engine), and the share of the phase's wall time some task
    # waited for a CPU (PSI): how loaded the machine was while that target ran.
    front: dict[str, dict[str, list[float]]] = {
        key: {name: [] for name in targets} for key, many, _ in phases if many}
    pressure: dict[str, dict[str, list[float]]] = {
        key: {name: [] for name in targets} for key, many, _ in phases if many}
    load: dict[str, dict[str, list[float]]] = {
        key: {name: [] for name in targets} for key, many, _ in phases if many}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for name, url in targets.items():  # warm up connections and caches
            await one_stream(session, url, 20, rng)
            if sessions:
                await one_stream(session, url, 2 * sessions, rng, sessions)
        for number in range(rounds):
            order = list(targets)
            for key, many, with_sessions in phases:
                rng.shuffle(order)
                for name in order:
                    before = cpu_s(pids[name])
                    if many:
                        engine_before = engine_e2e(targets["direct"])
                        stalled_before, started = cpu_pressure_us(), time.perf_counter()
                        rate, latencies = await many_streams(
                            session, targets[name], streams, duration_s, rng, with_sessions)
                        wall = time.perf_counter() - started
                        stalled_after = cpu_pressure_us()
                        engine_after = engine_e2e(targets["direct"])
                        multi[key][name].append((rate, statistics.median(latencies)))
                        load[key][name].append(load_1m())
                        count = len(latencies)
                        engine_mean = (engine_after[0] - engine_before[0]) / max(
                            engine_after[1] - engine_before[1], 1)
                        front[key][name].append(statistics.mean(latencies) - engine_mean)
                        if stalled_before is not None and stalled_after is not None:
                            pressure[key][name].append(
                                (stalled_after - stalled_before) / 1e6 / wall)
                    else:
                        single[key][name].append(await one_stream(
                            session, targets[name], per_round, rng,
                            sessions if with_sessions else 0))
                        count = per_round
                    cpu[key][name].append((cpu_s(pids[name]) - before) / max(count, 1))
            print(f"round {number + 1}/{rounds}: " + "; ".join(
                f"{key}: " + ", ".join(
                    f"{n} {1000 * statistics.median(single[key][n][-1]):.2f} ms"
                    if key in single else f"{n} {multi[key][n][-1][0]:.1f} req/s"
                    for n in targets) for key, _, _ in phases), flush=True)
    report: dict = {}
    for key, values in single.items():
        report[key] = {}
        for name in targets:
            p50 = statistics.median(statistics.median(r) for r in values[name])
            p90 = statistics.median(q(r, 0.9) for r in values[name])
            # Added latency: per round, p50(target) - p50(direct) (same round, same noise).
            added = statistics.median(
                statistics.median(t) - statistics.median(d)
                for t, d in zip(values[name], values["direct"], strict=True))
            report[key][name] = {
                "p50_ms": round(1000 * p50, 3), "p90_ms": round(1000 * p90, 3),
                "added_p50_ms": round(1000 * added, 3),
                "proxy_cpu_ms_per_request": round(1000 * statistics.median(cpu[key][name]), 3),
                "per_round_p50_ms": [round(1000 * statistics.median(r), 3)
                                     for r in values[name]],
                "per_round_cpu_ms": [round(1000 * c, 3) for c in cpu[key][name]]}
    for key, values in multi.items():
        report[key] = {}
        for name in targets:
            report[key][name] = {
                "req_per_s": round(statistics.median(r for r, _ in values[name]), 2),
                "p50_ms": round(1000 * statistics.median(m for _, m in values[name]), 1),
                "proxy_cpu_ms_per_request": round(1000 * statistics.median(cpu[key][name]), 3),
                "per_round_req_per_s": [round(r, 1) for r, _ in values[name]],
                "per_round_cpu_ms": [round(1000 * c, 3) for c in cpu[key][name]],
                # Mean client latency minus vLLM's own mean e2e: what is spent in front
                # of the engine (direct: the client and vLLM's HTTP front end).
                "in_front_of_engine_ms": round(
                    1000 * statistics.median(front[key][name]), 1),
                "per_round_in_front_of_engine_ms": [
                    round(1000 * f, 1) for f in front[key][name]],
                "per_round_cpu_pressure": [round(p, 2) for p in pressure[key][name]],
                "per_round_load_1m": [round(v, 2) for v in load[key][name]],
                "per_round_vs_direct": [
                    round(r / d, 3) for (r, _), (d, _) in zip(
                        values[name], values["direct"], strict=True)]}
        base = report[key]["direct"]["req_per_s"]
        for name in targets:
            report[key][name]["throughput_vs_direct"] = round(
                report[key][name]["req_per_s"] / base, 3)
            # The same, per round then the median: the figure machine noise moves least.
            report[key][name]["vs_direct_median_of_rounds"] = round(
                statistics.median(report[key][name]["per_round_vs_direct"]), 3)
    report["direct_p50_ms"] = report["one_stream"]["direct"]["p50_ms"]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=60)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=8,
                        help="session ids of the 1-stream session phase (0: no session phases)")
    parser.add_argument("--no-refresh-off", dest="refresh_off", action="store_false",
                        help="leave out the second kvhint router (routing.session_refresh off)")
    parser.add_argument("--vllm-router-policy", default="cache_aware")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin vLLM to CPU 1 and the proxies and client to CPU 0")
    args = parser.parse_args()
    pin = args.pin and {0, 1} <= os.sched_getaffinity(0)
    # SIGTERM exits through the finally blocks, so no vLLM server is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]), flush=True)

    lock = open(LOCK, "ab")
    fcntl.flock(lock, fcntl.LOCK_EX)
    work = Path(tempfile.mkdtemp(prefix="kvhint-bench-overhead-"))
    model = build_tiny_model(REPO / ".kvhint" / "test" / "models" / RECIPE_VERSION)
    worker = VllmServer(replace(VllmWorkerSpec(model_dir=model, port=free_port()),
                                cpu_bind="1"), work / "worker.log")
    kvhint = None
    kvhint_norefresh = None
    baseline = None
    try:
        with running_nats("nats://127.0.0.1:4222") as nats:
            worker.start()
            worker.wait_ready()
            prefixes = [f"kvhintbench{free_port()}", f"kvhintbenchnr{free_port()}"]

            def router(prefix: str, name: str, refresh: bool) -> RouterProcess:
                # Each its own subject prefix and store: two routers of two deployments.
                return RouterProcess({
                    "KVHINT_ROUTER_WORKERS": f"w0={worker.url}",
                    "KVHINT_ROUTER_NATS_URL": nats.url,
                    "KVHINT_ROUTER_SUBJECT_PREFIX": prefix,
                    "KVHINT_ROUTER_EVENTS_STREAM_MAX_BYTES": str(16 << 20),
                    "KVHINT_ROUTER_OUTCOMES_STREAM_MAX_BYTES": str(16 << 20),
                    "KVHINT_ROUTER_RELEASES_STREAM_MAX_BYTES": str(16 << 20),
                    "KVHINT_ROUTER_DATABASE_URL": f"sqlite:///{work / f'{name}.db'}",
                    "KVHINT_ROUTER_LOG_LEVEL": "warning",
                    "KVHINT_ROUTER_ROUTING__SESSION_REFRESH": "true" if refresh else "false",
                }, work / f"{name}.log", port=free_port())

            kvhint = router(prefixes[0], "kvhint-router", True)
            kvhint.start()
            if args.refresh_off:
                kvhint_norefresh = router(prefixes[1], "kvhint-norefresh", False)
                kvhint_norefresh.start()
            baseline = VllmRouterProcess(free_port(), [worker.url], args.vllm_router_policy,
                                         work / "vllm-router.log")
            baseline.start()
            targets = {"direct": worker.url, "kvhint": kvhint.url}
            pids = {"direct": None, "kvhint": kvhint.pid}
            if kvhint_norefresh is not None:
                targets["kvhint-norefresh"] = kvhint_norefresh.url
                pids["kvhint-norefresh"] = kvhint_norefresh.pid
            targets["vllm-router"] = baseline.url
            pids["vllm-router"] = baseline.pid
            pinning: dict = {"on": pin}
            if pin:
                # vLLM's whole process group (API server, engine core, model) on CPU 1;
                # the proxies and this client (threads created later inherit) on CPU 0.
                pinning["vllm_threads_cpu1"] = worker.pin_to_cpus({1})
                pinning["proxy_threads_cpu0"] = {
                    name: pin_tree(pid, {0}) for name, pid in pids.items() if pid is not None}
                # Not its children: vLLM, the proxies and NATS where it started one.
                pinning["client_threads_cpu0"] = pin_tree(os.getpid(), {0}, children=False)
            print("pinning:", json.dumps(pinning), flush=True)
            report = asyncio.run(measure(targets, pids, args.rounds, args.per_round,
                                         args.duration_s, args.streams, args.sessions))
            report["pinning"] = pinning
            for process in (kvhint, kvhint_norefresh):
                if process is not None:
                    # What the session phases made the router read (a check that the
                    # refresh read is on the measured path), and any error it logged.
                    metrics = httpx.get(f"{process.url}/metrics", timeout=10).text
                    report.setdefault("router_session_reads", {})[process.log_path.stem] = [
                        line for line in metrics.splitlines()
                        if line.startswith(("kvhint_router_session_refreshes_total",
                                            "kvhint_router_session_reads_total"))
                        and not line.endswith(" 0.0")]
                    report.setdefault("router_logs_errors", {})[process.log_path.stem] = sum(
                        " ERROR " in line or "Traceback" in line
                        for line in process.log_path.read_text(errors="replace").splitlines())
                    process.stop()
            for prefix in prefixes[:2 if kvhint_norefresh is not None else 1]:
                asyncio.run(remove_streams(nats.url, Subjects(prefix)))
    finally:
        if baseline is not None:
            baseline.stop()
        for process in (kvhint, kvhint_norefresh):
            if process is not None:
                process.stop()
        worker.stop()
        fcntl.flock(lock, fcntl.LOCK_UN)
    report["config"] = vars(args) | {"json": str(args.json) if args.json else None}
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
