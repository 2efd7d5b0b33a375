"""The plugin on real vLLM CPU servers: throughput cost and hint latency.

    .venv/bin/python tests/benchmarks/plugin/bench_plugin_serving.py [--rounds 3]

Starts two servers from the same spec, one plain and one with the plugin (real NATS),
and in the same run, alternating rounds (A B A B ...; only one server loaded at a time,
the machine is small and noisy):

1. throughput: the same multi-turn chat workload (sessions, prefix reuse, fixed
   ``max_tokens`` with ``ignore_eos``) on plain vLLM, on the plugin with no hints, and on
   the plugin with hints flowing; output tokens/s per round, medians, ratios to plain
   (target >= 0.98 with hints); and the CPU the server's processes spent per 1k output
   tokens (from /proc), the plugin's cost without the VM's wall-time swings. Hints come
   from a separate process (as from a router): Retain or Pin for the workload's sessions
   at ``--hint-rate`` per second;
2. hint latency publish -> outcome (NATS round trip included), measured by that process,
   while the plugin server is busy (during the hint rounds) and idle (no request running:
   the plugin wakes the engine), p50/p99; split at the outcome's own timestamp; and on the
   NATS server's clock (a JetStream stream records the hints and outcomes as the server
   accepts them), which leaves out the publishing client's own stalls.

Holds the machine-wide vLLM lock while servers run.
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
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import nats

from kvhint.router.devstack.nats_server import delete_stream_if_any, free_port, running_nats
from kvhint.router.devstack.tiny_model import RECIPE_VERSION, build_tiny_model
from kvhint.router.devstack.up import plugin_transfer_config
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec
from kvhint.schemas import (
    KvHintsEnvelope,
    PinPayload,
    RetainPayload,
    Subjects,
    Target,
    decode_outcome,
    encode_hints,
    make_action,
)

LOCK = Path("/tmp/kvhint-vllm-servers.lock")
WORDS = ("cache block session tool call agent prefix router worker engine hint pin retain "
         "token model batch queue result file search weather answer question reply").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive_hints(nats_url: str, prefix: str, rate: float, sessions: int, seed: int,
                      stop: asyncio.Event) -> dict[str, Any]:
    """Publish Retain/Pin hints for the workload's sessions at ``rate``/s until ``stop``;
    return publish -> outcome latencies (s) and outcome counts."""
    rng = random.Random(seed)
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    sent: dict[str, float] = {}
    sent_wall: dict[str, float] = {}
    first: dict[str, float] = {}  # action id -> latency of its first outcome
    # The first outcome's path split at the outcome's own ``at`` (the plugin's wall clock,
    # same machine): publish -> answered inside the plugin, answered -> seen here.
    to_answer: list[float] = []
    to_publisher: list[float] = []
    windows: list[tuple[float, float]] = []  # (published, first outcome seen), wall clock
    latencies: list[float] = []  # to the terminal outcome
    first_latencies: list[float] = []  # to the first outcome (deferred or terminal)
    statuses: dict[str, int] = {}

    async def on_outcome(msg: Any) -> None:
        now = time.perf_counter()
        now_wall = time.time()
        outcome = decode_outcome(msg.data)
        started = sent.get(outcome.action_id)
        if started is None:
            return
        if outcome.action_id not in first:
            first[outcome.action_id] = now - started
            first_latencies.append(now - started)
            to_answer.append(outcome.at - sent_wall[outcome.action_id])
            to_publisher.append(now_wall - outcome.at)
            windows.append((sent_wall[outcome.action_id], now_wall))
        statuses[outcome.status.value] = statuses.get(outcome.status.value, 0) + 1
        if outcome.status.value != "deferred":
            del sent[outcome.action_id]
            latencies.append(now - started)

    # This process's own event-loop lag (a 5 ms sleep's overshoot): when it is large, the
    # publisher itself was not running, and both legs above grow with it.
    stalls: list[tuple[float, float]] = []  # (wall time the stall ended, seconds)

    async def watch_loop_lag() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = time.perf_counter() - before - 0.005
            if lag > 0.01:
                stalls.append((time.time(), lag))

    watcher = asyncio.ensure_future(watch_loop_lag())
    await nc.subscribe(subjects.outcomes("w0"), cb=on_outcome)
    await nc.flush()
    while not stop.is_set():
        session = f"bench/s{rng.randrange(sessions)}"
        payload = (PinPayload(target=Target(session_id=session), ttl_s=30)
                   if rng.random() < 0.3 else
                   RetainPayload(target=Target(session_id=session), priority=rng.randint(10, 90),
                                 ttl_s=60))
        action_id = uuid.uuid4().hex[:12]
        envelope = KvHintsEnvelope(protocol_version="1", message_id=f"m-{action_id}",
                                   actions=[make_action(action_id, payload)])
        sent[action_id] = time.perf_counter()
        sent_wall[action_id] = time.time()
        await nc.publish(subjects.hints("w0"), encode_hints(envelope))
        await nc.flush()
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0 / rate)
        except asyncio.TimeoutError:
            pass
    await asyncio.sleep(1.0)  # late outcomes
    watcher.cancel()
    await nc.drain()
    slow = [(a, b) for a, b in windows if b - a > 0.05]
    overlapping = sum(1 for a, b in slow
                      if any(end - lag < b and end > a for end, lag in stalls if lag > 0.03))
    return {"action_ids": list(sent_wall), "latencies": latencies, "first": first_latencies,
            "statuses": statuses,
            "unanswered": len(sent), "to_answer": to_answer, "to_publisher": to_publisher,
            "publisher_stalls": [lag for _, lag in stalls],
            "slow": len(slow), "slow_during_publisher_stall": overlapping}


def driver_main(args: argparse.Namespace) -> None:
    """Subprocess entry: drive hints until SIGTERM, then print the result as JSON."""
    import signal

    if args.publisher_nice:
        os.nice(args.publisher_nice)  # raises PermissionError unless allowed: said, not hidden

    async def run_driver() -> dict[str, Any]:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        return await drive_hints(args.nats_url, args.prefix, args.hint_rate, args.sessions,
                                 args.seed, stop)

    print(json.dumps(asyncio.run(run_driver())), flush=True)


class HintDriver:
    """The hint publisher as a separate process (its CPU is not the client's)."""

    def __init__(self, args: argparse.Namespace, nats_url: str, prefix: str, rate: float,
                 seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--driver", "--nats-url", nats_url, "--prefix", prefix,
             "--hint-rate", str(rate), "--sessions", str(args.sessions), "--seed", str(seed),
             "--publisher-nice", str(args.publisher_nice)],
            stdout=subprocess.PIPE, text=True)

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return json.loads(out.strip().splitlines()[-1])


async def workload(url: str, sessions: int, turns: int, max_tokens: int, concurrency: int,
                   seed: int) -> tuple[int, float]:
    """Multi-turn chats; returns (completion tokens, seconds)."""
    rng = random.Random(seed)
    histories = {f"bench/s{i}": [{"role": "system", "content": text(rng, 40)}]
                 for i in range(sessions)}
    semaphore = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one_session(client: httpx.AsyncClient, session: str) -> None:
        nonlocal tokens
        local = random.Random(hash((seed, session)))
        for _ in range(turns):
            histories[session].append({"role": "user", "content": text(local, 30)})
            async with semaphore:
                response = await client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": histories[session], "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "session_id": session})
            response.raise_for_status()
            body = response.json()
            tokens += body["usage"]["completion_tokens"]
            histories[session].append({"role": "assistant",
                                       "content": body["choices"][0]["message"]["content"]})

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one_session(client, s) for s in histories))
        elapsed = time.perf_counter() - started
    return tokens, elapsed


async def run(args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="kvhint-bench-"))
    model = build_tiny_model(Path(args.model_root) / RECIPE_VERSION)
    prefix = f"kvhintbench.{uuid.uuid4().hex[:8]}"
    with running_nats(args.nats_url) as endpoint:
        base = VllmWorkerSpec(model_dir=model, port=0, kv_cache_tokens=args.kv_cache_tokens,
                              max_model_len=2048)
        transfer = plugin_transfer_config("w0", endpoint.url)
        transfer["kv_connector_extra_config"] = {**transfer["kv_connector_extra_config"],
                                                 "subject_prefix": prefix}
        # vLLM's CPU platform reserves one more core for ANY KV connector (it assumes
        # NIXL P/D transfers); on this 2-core machine that leaves none for EngineCore and
        # halves throughput whatever the connector does (a no-op connector measures the
        # same). VllmWorkerSpec therefore gives connector workers plain vLLM's reservation
        # (VLLM_CPU_NUM_OF_RESERVED_CPU=1); --vllm-connector-core restores vLLM's choice.
        plugin_env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"} if args.vllm_connector_core else {}
        servers = {
            "plain": VllmServer(replace(base, port=free_port()), state / "plain.log"),
            "plugin": VllmServer(replace(base, port=free_port(), kv_transfer_config=transfer,
                                         env=plugin_env), state / "plugin.log"),
        }
        if args.noop_baseline:
            noop = {"kv_connector": "NoopKvConnector", "kv_role": transfer["kv_role"],
                    "kv_connector_module_path": "noop_kv_connector"}
            servers["noop"] = VllmServer(replace(
                base, port=free_port(), kv_transfer_config=noop,
                env={**plugin_env, "PYTHONPATH": str(Path(__file__).resolve().parent)}),
                state / "noop.log")
        bus_stream = await open_bus_record(endpoint.url, prefix)
        busy_actions: list[str] = []
        idle_actions: list[str] = []
        try:
            for server in servers.values():
                server.start()
            for server in servers.values():
                server.wait_ready(600)
            if args.server_core >= 0:
                # Each server on one core (only one is loaded at a time), this client, the
                # hint publisher (a child: it inherits this) and NATS on the others: a
                # server left to float swings 3x in throughput between rounds here.
                for server in servers.values():
                    server.pin_to_cpus({args.server_core})
                others = os.sched_getaffinity(0) - {args.server_core}
                if others:
                    os.sched_setaffinity(0, others)
            # Warm both (first requests compile / allocate).
            for server in servers.values():
                await workload(server.url, 2, 1, 8, 2, 999)
            latency: dict[str, list[float]] = {"idle": [], "busy": [], "idle first": [],
                                               "busy first": []}
            split: dict[str, list[float]] = {"busy to_answer": [], "busy to_publisher": [],
                                             "busy publisher_stall": []}
            slow = {"slow": 0, "during_publisher_stall": 0}
            statuses: dict[str, int] = {}
            unanswered = 0
            # Variants: plain vLLM; the plugin with no hints (index, events, heartbeat);
            # the plugin with hints flowing. Rotated each round, same workload.
            variants = [("plain", "plain", False), ("plugin", "plugin", False),
                        ("plugin+hints", "plugin", True)]
            if args.noop_baseline:
                variants.append(("noop-connector", "noop", False))
            rates: dict[str, list[float]] = {name: [] for name, _, _ in variants}
            # CPU the server's processes spent per 1k output tokens: what the plugin costs,
            # steadier than tokens/s on a VM whose rounds swing 3x in wall time.
            cpu_per_1k: dict[str, list[float]] = {name: [] for name, _, _ in variants}
            for round_no in range(args.rounds):
                shift = round_no % len(variants)
                for name, server_name, hints in variants[shift:] + variants[:shift]:
                    driver = (HintDriver(args, endpoint.url, prefix, args.hint_rate, round_no)
                              if hints else None)
                    if driver is not None:
                        await asyncio.sleep(1.0)  # connected and publishing
                    cpu_before = servers[server_name].cpu_seconds()
                    tokens, seconds = await workload(
                        servers[server_name].url, args.sessions, args.turns, args.max_tokens,
                        args.concurrency, round_no)
                    cpu = servers[server_name].cpu_seconds() - cpu_before
                    rates[name].append(tokens / seconds)
                    cpu_per_1k[name].append(1000.0 * cpu / tokens)
                    print(f"round {round_no} {name:14s}: {tokens} tokens in {seconds:6.1f} s = "
                          f"{tokens / seconds:7.1f} tok/s; server CPU {cpu:5.2f} s "
                          f"({1000.0 * cpu / tokens:.2f} s per 1k tokens)", flush=True)
                    if driver is not None:
                        done = driver.stop()
                        busy_actions += done["action_ids"]
                        latency["busy"] += done["latencies"]
                        latency["busy first"] += done["first"]
                        split["busy to_answer"] += done["to_answer"]
                        split["busy to_publisher"] += done["to_publisher"]
                        split["busy publisher_stall"] += done["publisher_stalls"]
                        slow["slow"] += done["slow"]
                        slow["during_publisher_stall"] += done["slow_during_publisher_stall"]
                        unanswered += done["unanswered"]
                        for status, n in done["statuses"].items():
                            statuses[status] = statuses.get(status, 0) + n
            # Idle: nothing is running; each hint has to wake the engine.
            await asyncio.sleep(2.0)
            driver = HintDriver(args, endpoint.url, prefix, 10.0, 999)
            await asyncio.sleep(args.idle_probes / 10.0 + 1.0)
            done = driver.stop()
            idle_actions = done["action_ids"]
            latency["idle"] = done["latencies"]
            latency["idle first"] = done["first"]
            split["idle to_answer"] = done["to_answer"]
            split["idle to_publisher"] = done["to_publisher"]
            unanswered += done["unanswered"]
            async with httpx.AsyncClient(base_url=servers["plugin"].url, timeout=30) as client:
                in_engine = apply_quantiles((await client.get("/metrics")).text)
        finally:
            for server in servers.values():
                server.stop()
            await delete_stream_if_any(endpoint.url, Subjects(prefix).events_stream)
            record = await read_bus_record(endpoint.url, prefix, bus_stream)
    bus = {phase: [record[a][1] - record[a][0] for a in actions if a in record]
           for phase, actions in (("busy", busy_actions), ("idle", idle_actions))}
    return {"rates": rates, "cpu_per_1k": cpu_per_1k, "latency": latency,
            "statuses": statuses, "lost": unanswered, "in_engine": in_engine, "split": split,
            "slow": slow, "bus": bus}


async def open_bus_record(nats_url: str, prefix: str) -> str:
    """A memory JetStream stream over the worker's hint and outcome subjects. The NATS
    server stamps each message when it accepts it, so publish -> outcome can be read on
    the bus's own clock: the hint as published, the outcome as the plugin put it back on
    the bus, free of the publishing client's own stalls on either side."""
    from nats.js.api import StorageType

    subjects = Subjects(prefix)
    name = f"KVHINTBENCH_BUS_{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(name=name, storage=StorageType.MEMORY, subjects=[
            subjects.hints("w0"), subjects.outcomes("w0")])
    finally:
        await nc.drain()
    return name


async def read_bus_record(nats_url: str, prefix: str, name: str
                          ) -> dict[str, tuple[float, float]]:
    """action id -> (hint accepted, first outcome accepted) on the server's clock, for
    every answered action; the stream is deleted afterwards."""
    hint_subject = Subjects(prefix).hints("w0")
    hinted: dict[str, float] = {}
    answered: dict[str, float] = {}
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        last = (await js.stream_info(name)).state.last_seq
        for seq in range(1, last + 1):
            msg = await js.get_msg(name, seq)
            at = msg.time.timestamp()
            if msg.subject == hint_subject:
                for action in json.loads(msg.data)["actions"]:
                    hinted[action["action_id"]] = at
            else:
                answered.setdefault(decode_outcome(msg.data).action_id, at)
        await js.delete_stream(name)
    finally:
        await nc.drain()
    return {a: (hinted[a], t) for a, t in answered.items() if a in hinted}


def apply_quantiles(metrics: str) -> dict[str, float]:
    """p50/p99 upper bounds (s) of kvhint:hint_apply_seconds (arrival at the plugin's
    NATS thread -> outcome, inside the engine) from the server's /metrics."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith("kvhint:hint_apply_seconds_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    out = {"n": total}
    for q in (0.5, 0.99):
        out[f"p{int(q * 100)}"] = next((b for b, c in buckets if c >= q * total), float("nan"))
    return out


def quantiles_ms(values: list[float]) -> str:
    """``n=.. p50 .. ms, p99 .. ms, max .. ms`` of latencies given in seconds."""
    return (f"n={len(values)} p50 {1000 * percentile(values, 0.5):.1f} ms, "
            f"p99 {1000 * percentile(values, 0.99):.1f} ms, max {1000 * max(values):.1f} ms")


def print_medians(title: str, by_variant: dict[str, list[float]], unit: str,
                  median_format: str, round_format: str) -> None:
    """One line per variant: its median over the rounds, the ratio to plain's median, and
    every round's value."""
    plain = statistics.median(by_variant["plain"])
    for name, values in by_variant.items():
        median = statistics.median(values)
        rounds = ", ".join(format(v, round_format) for v in values)
        print(f"{title} {name:14s} median of {len(values)}: {format(median, median_format)} "
              f"{unit}, ratio to plain {median / plain:.3f} (rounds: {rounds})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    parser.add_argument("--idle-probes", type=int, default=100)
    parser.add_argument("--hint-rate", type=float, default=40.0, help="hints/s while busy")
    parser.add_argument("--publisher-nice", type=int, default=0,
                        help="niceness increment for the hint publisher process (negative "
                             "needs CAP_SYS_NICE): stands in for a router on its own cores")
    parser.add_argument("--server-core", type=int, default=0,
                        help="bind each vLLM server (all its processes) to this core and the "
                             "bench to the others; -1 leaves everything floating")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--model-root", default=".kvhint/test/models")
    parser.add_argument("--vllm-connector-core", action="store_true",
                        help="keep vLLM's extra core reservation for KV connectors")
    parser.add_argument("--noop-baseline", action="store_true",
                        help="also run vLLM with a do-nothing KV connector")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.driver:
        driver_main(args)
        return
    print("command:", " ".join([".venv/bin/python", *sys.argv]), flush=True)
    with open(LOCK, "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = asyncio.run(run(args))
    print_medians("throughput", result["rates"], "tok/s", "7.1f", ".0f")
    print("target: plugin+hints / plain >= 0.98")
    print_medians("server CPU", result["cpu_per_1k"], "s per 1k output tokens", "5.2f", ".2f")
    for phase, values in result["latency"].items():
        if values:
            what = "first outcome" if phase.endswith("first") else "final outcome"
            print(f"hint publish->{what} {phase.split()[0]:4s}: {quantiles_ms(values)}")
    for phase, values in result["split"].items():
        if values:
            engine_phase, leg = phase.split()
            what = {"to_answer": "publish -> outcome made in the plugin",
                    "to_publisher": "outcome made -> seen by the publisher",
                    "publisher_stall": "publisher's own event-loop stalls > 10 ms"}[leg]
            print(f"first outcome, {engine_phase:4s} {what}: {quantiles_ms(values)}")
    for phase, values in result["bus"].items():
        if values:
            print(f"hint publish->first outcome on the NATS server's clock, {phase:4s}: "
                  f"{quantiles_ms(values)}")
    print(f"busy hints answered after > 50 ms: {result['slow']['slow']}, of which "
          f"{result['slow']['during_publisher_stall']} overlap a > 30 ms stall of the "
          f"publisher's own process")
    engine = result["in_engine"]
    print(f"inside the engine (kvhint:hint_apply_seconds, all phases): n={engine['n']:.0f} "
          f"p50 <= {1000 * engine['p50']:.1f} ms, p99 <= {1000 * engine['p99']:.1f} ms")
    print(f"outcomes by status: {result['statuses']}; unanswered: {result['lost']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
