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
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import psutil

from kvhint.router.bench.vllm_router import VllmRouterProcess
from kvhint.router.devstack.nats_server import free_port, running_nats
from kvhint.router.devstack.tiny_model import RECIPE_VERSION, build_tiny_model
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec
from kvhint.router.service.launch import RouterProcess
from kvhint.router.service.nats_link import remove_streams
from kvhint.schemas import Subjects

REPO = Path(__file__).resolve().parents[3]
LOCK = Path("/tmp/kvhint-vllm-servers.lock")


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(n))


async def one_stream(session: aiohttp.ClientSession, url: str, n: int, rng: random.Random
                     ) -> list[float]:
    latencies = []
    for _ in range(n):
        body = {"model": "tiny", "prompt": words(rng, 24), "max_tokens": 1}
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as response:
            await response.read()
            assert response.status == 200, await response.text()
        latencies.append(time.perf_counter() - started)
    return latencies


async def many_streams(session: aiohttp.ClientSession, url: str, streams: int,
                       duration_s: float, rng: random.Random) -> tuple[float, list[float]]:
    latencies: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def loop(seed: int) -> None:
        local = random.Random(seed)
        while time.perf_counter() < deadline:
            body = {"model": "tiny", "max_tokens": 16, "stream": True,
                    "messages": [{"role": "user", "content": words(local, 24)}]}
            started = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                async for _chunk in response.content.iter_any():
                    pass
                assert response.status == 200
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(loop(rng.randrange(1 << 30)) for _ in range(streams)))
    return len(latencies) / (time.perf_counter() - started), latencies


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
                  per_round: int, duration_s: float, streams: int) -> dict:
    rng = random.Random(0)
    single: dict[str, list[list[float]]] = {name: [] for name in targets}
    multi: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
    # Proxy CPU per request (noise-proof: what the proxy itself burns per request).
    cpu_single: dict[str, list[float]] = {name: [] for name in targets}
    cpu_multi: dict[str, list[float]] = {name: [] for name in targets}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for name, url in targets.items():  # warm up connections and caches
            await one_stream(session, url, 20, rng)
        for number in range(rounds):
            order = list(targets)
            rng.shuffle(order)
            for name in order:
                before = cpu_s(pids[name])
                single[name].append(await one_stream(session, targets[name], per_round, rng))
                cpu_single[name].append((cpu_s(pids[name]) - before) / per_round)
            rng.shuffle(order)
            for name in order:
                before = cpu_s(pids[name])
                rate, latencies = await many_streams(session, targets[name], streams,
                                                     duration_s, rng)
                multi[name].append((rate, statistics.median(latencies)))
                cpu_multi[name].append((cpu_s(pids[name]) - before) / max(len(latencies), 1))
            print(f"round {number + 1}/{rounds}: " + ", ".join(
                f"{n} p50 {1000 * statistics.median(single[n][-1]):.2f} ms / "
                f"{multi[n][-1][0]:.1f} req/s" for n in targets), flush=True)
    report: dict = {"one_stream": {}, "many_streams": {}}
    direct_p50 = statistics.median(statistics.median(r) for r in single["direct"])
    for name in targets:
        p50 = statistics.median(statistics.median(r) for r in single[name])
        p90 = statistics.median(q(r, 0.9) for r in single[name])
        # Added latency: per round, p50(target) - p50(direct) (same round, same noise).
        added = statistics.median(statistics.median(t) - statistics.median(d)
                                  for t, d in zip(single[name], single["direct"], strict=True))
        rate = statistics.median(r for r, _ in multi[name])
        lat = statistics.median(m for _, m in multi[name])
        report["one_stream"][name] = {
            "p50_ms": round(1000 * p50, 3), "p90_ms": round(1000 * p90, 3),
            "added_p50_ms": round(1000 * added, 3),
            "proxy_cpu_ms_per_request": round(1000 * statistics.median(cpu_single[name]), 3)}
        report["many_streams"][name] = {
            "req_per_s": round(rate, 2), "p50_ms": round(1000 * lat, 1),
            "proxy_cpu_ms_per_request": round(1000 * statistics.median(cpu_multi[name]), 3)}
    for name in targets:
        base = report["many_streams"]["direct"]["req_per_s"]
        report["many_streams"][name]["throughput_vs_direct"] = round(
            report["many_streams"][name]["req_per_s"] / base, 3)
    report["direct_p50_ms"] = round(1000 * direct_p50, 3)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=60)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--vllm-router-policy", default="cache_aware")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
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
    baseline = None
    try:
        with running_nats("nats://127.0.0.1:4222") as nats:
            worker.start()
            worker.wait_ready()
            prefix = f"kvhintbench{free_port()}"
            kvhint = RouterProcess({
                "KVHINT_ROUTER_WORKERS": f"w0={worker.url}",
                "KVHINT_ROUTER_NATS_URL": nats.url,
                "KVHINT_ROUTER_SUBJECT_PREFIX": prefix,
                "KVHINT_ROUTER_EVENTS_STREAM_MAX_BYTES": str(16 << 20),
                "KVHINT_ROUTER_OUTCOMES_STREAM_MAX_BYTES": str(16 << 20),
                "KVHINT_ROUTER_RELEASES_STREAM_MAX_BYTES": str(16 << 20),
                "KVHINT_ROUTER_DATABASE_URL": f"sqlite:///{work / 'router.db'}",
                "KVHINT_ROUTER_LOG_LEVEL": "warning",
            }, work / "kvhint-router.log", port=free_port())
            kvhint.start()
            baseline = VllmRouterProcess(free_port(), [worker.url], args.vllm_router_policy,
                                         work / "vllm-router.log")
            baseline.start()
            targets = {"direct": worker.url, "kvhint": kvhint.url, "vllm-router": baseline.url}
            pids = {"direct": None, "kvhint": kvhint.pid, "vllm-router": baseline.pid}
            report = asyncio.run(measure(targets, pids, args.rounds, args.per_round,
                                         args.duration_s, args.streams))
            kvhint.stop()
            asyncio.run(remove_streams(nats.url, Subjects(prefix)))
    finally:
        if baseline is not None:
            baseline.stop()
        if kvhint is not None:
            kvhint.stop()
        worker.stop()
        fcntl.flock(lock, fcntl.LOCK_UN)
    report["config"] = vars(args) | {"json": str(args.json) if args.json else None}
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
