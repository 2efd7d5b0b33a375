"""What a long prompt's hashing costs the router's event loop: hashed inline vs on the
router's hashing thread (``RoutingService.hash_executor``), side by side in one run.

    .venv/bin/python tests/benchmarks/service/bench_service_hash_offload.py \
        [--rounds 6] [--seconds 4] [--json out.json]

In-process, the real ``RoutingService`` with the real ``RequestHasher`` over the tests'
tiny model's tokenizer and two routable workers (so every prompt is hashed for the
decision). In each round, each mode in turn (order alternating by round) runs for
``--seconds``: ``--clients`` coroutines route long chat prompts (``--long-words`` words,
~63k tokens at the default) back to back, while on the same loop

- a ticker sleeps 1 ms at a time and records how late it wakes (the *loop lag*: how long
  every other request's streamed bytes, health checks and NATS callbacks wait), and
- a short-prompt client has a 40-word chat prompt due every 2 ms and records the time
  from when it is due until its ``plan()`` returns (what a small request arriving behind
  the long ones waits).

Reported per mode: loop lag p50/p99/max, short-prompt plan p50/p99, long prompts routed
per second; medians over rounds, and off-loop / inline ratios. A second part measures
the tokenizer call itself: how late a main thread's 1 ms sleeps wake while another thread
encodes the long prompt with ``tokenizers``' ``encode`` (holds the GIL) vs
``encode_batch`` (releases it; what ``PromptRenderer`` uses).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

from kvhint.router.devstack.tiny_model import RECIPE_VERSION, build_tiny_model
from kvhint.router.hashing import ModelTokenizerSource, RequestHasher
from kvhint.router.policy import RoutingConfig
from kvhint.router.service.hash_queue import FairHashQueue
from kvhint.router.service.inbound import Endpoint, InboundRequest, parse_inbound
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.routing_service import RoutingService
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import Tenant
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import Budgets, Usage, WorkerStatus

REPO = Path(__file__).resolve().parents[3]
TENANT = Tenant("default", None, TenantBudget())
MODES = ("inline", "off_loop")


def _status(worker: str) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker, epoch="e1", model="tiny", cache_namespace="ns", block_size=16,
        hash_algo="sha256", none_hash_seed="vllm-none-hash", supported_actions={},
        budgets=Budgets(max_pinned_blocks=0, max_pin_ttl_s=0, max_retained_blocks=0,
                        max_retain_ttl_s=0),
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time())


def _chat(words: int, salt: int) -> InboundRequest:
    text = " ".join(f"w{(i * 7919 + salt) % 100_000}" for i in range(words))
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    return parse_inbound(Endpoint.CHAT, json.dumps(body).encode(), TENANT, None, None)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)] if ordered else 0.0


async def _round(routing: RoutingService, seconds: float, clients: int,
                 long_prompts: list[InboundRequest], short_prompts: list[InboundRequest]
                 ) -> dict[str, float]:
    stop = time.perf_counter() + seconds
    lags: list[float] = []
    short_s: list[float] = []
    long_done = 0

    async def ticker() -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - started - 0.001)

    async def long_client(k: int) -> None:
        nonlocal long_done
        i = k
        while time.perf_counter() < stop:
            await routing.plan(long_prompts[i % len(long_prompts)], None, 0)
            long_done += 1
            i += clients
            await asyncio.sleep(0)  # the request goes upstream: the loop moves on

    async def short_client() -> None:
        # A short request is due every 2 ms; its latency runs from when it is due to when
        # its plan is made (the wait for the loop included).
        i = 0
        while time.perf_counter() < stop:
            due = time.perf_counter() + 0.002
            await asyncio.sleep(0.002)
            await routing.plan(short_prompts[i % len(short_prompts)], None, 0)
            short_s.append(max(time.perf_counter() - due, 0.0))
            i += 1

    await asyncio.gather(ticker(), short_client(), *(long_client(k) for k in range(clients)))
    return {"lag_p50_ms": 1e3 * _pct(lags, 50), "lag_p99_ms": 1e3 * _pct(lags, 99),
            "lag_max_ms": 1e3 * max(lags), "short_p50_ms": 1e3 * _pct(short_s, 50),
            "short_p99_ms": 1e3 * _pct(short_s, 99), "long_per_s": long_done / seconds}


def _thread_lag(backend: object, text: str, batch: bool, calls: int = 5) -> dict[str, float]:
    """How late 1 ms sleeps on this thread wake while another thread encodes ``text``."""
    def work() -> None:
        for _ in range(calls):
            if batch:
                backend.encode_batch([text], add_special_tokens=False)  # type: ignore[attr-defined]
            else:
                backend.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]

    worker = threading.Thread(target=work)
    lags = []
    worker.start()
    while worker.is_alive():
        started = time.perf_counter()
        time.sleep(0.001)
        lags.append(time.perf_counter() - started - 0.001)
    worker.join()
    return {"lag_p50_ms": 1e3 * _pct(lags, 50), "lag_max_ms": 1e3 * max(lags)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--long-words", type=int, default=8000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model = build_tiny_model(REPO / ".kvhint" / "test" / "models" / RECIPE_VERSION)
    hasher = RequestHasher({"tiny": ModelTokenizerSource(model)})
    registry = WorkerRegistry([("w0", "http://w0"), ("w1", "http://w1")])
    for worker in ("w0", "w1"):
        registry.on_heartbeat(_status(worker))
    inline = RoutingService(registry, RouterMetrics(), RoutingConfig(), hasher,
                            default_block_size=16)
    executor = FairHashQueue(threads=1)  # what the runtime hashes on
    services = {"inline": inline, "off_loop": replace(inline, hash_executor=executor)}
    long_prompts = [_chat(args.long_words, salt) for salt in range(4)]
    short_prompts = [_chat(40, salt) for salt in range(16)]
    tokens = asyncio.run(inline.plan(long_prompts[0], None, 0)).prompt_tokens
    print(f"long prompt: {tokens:,} tokens; {args.clients} long-prompt clients + 1 short-prompt "
          f"client + the ticker; {args.rounds} rounds x {args.seconds:g} s per mode", flush=True)

    per_mode: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
            result = asyncio.run(_round(services[mode], args.seconds, args.clients,
                                        long_prompts, short_prompts))
            per_mode[mode].append(result)
            print(f"round {r + 1} {mode:9s} " + "  ".join(f"{k} {v:.1f}"
                                                          for k, v in result.items()),
                  flush=True)
    executor.shutdown()

    medians = {mode: {key: statistics.median(run[key] for run in runs)
                      for key in runs[0]} for mode, runs in per_mode.items()}
    text = long_prompts[0].messages[0]["content"]  # type: ignore[index]
    backend = hasher.renderer("tiny").tokenizer._tokenizer
    gil = {"encode": _thread_lag(backend, text, batch=False),
           "encode_batch": _thread_lag(backend, text, batch=True)}

    print("\n| mode | loop lag p50 | p99 | max | short request routed after p50 | p99 | long prompts/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, m in medians.items():
        print(f"| {mode} | {m['lag_p50_ms']:.2f} ms | {m['lag_p99_ms']:.1f} ms | "
              f"{m['lag_max_ms']:.1f} ms | {m['short_p50_ms']:.2f} ms | "
              f"{m['short_p99_ms']:.1f} ms | {m['long_per_s']:.1f} |")
    off, base = medians["off_loop"], medians["inline"]
    print("off_loop / inline: " + ", ".join(
        f"{k} {off[k] / base[k]:.2f}x" for k in base if base[k]))
    print("\n| tokenizer call on another thread | main thread 1 ms sleep late by p50 | max |")
    print("|---|---:|---:|")
    for name, lag in gil.items():
        print(f"| {name} | {lag['lag_p50_ms']:.2f} ms | {lag['lag_max_ms']:.1f} ms |")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": "bench_service_hash_offload.py", "rounds": args.rounds,
            "seconds": args.seconds, "clients": args.clients, "long_prompt_tokens": tokens,
            "per_round": per_mode, "medians": medians, "tokenizer_thread_lag": gil,
            "at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
