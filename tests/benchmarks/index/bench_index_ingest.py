"""Event ingestion: vLLM msgpack KV event batches -> adapter -> index, on one core.

    .venv/bin/python tests/benchmarks/index/bench_index_ingest.py [--batches 4000]
        [--rounds 5] [--block-size 32]

The batches are what a busy vLLM worker publishes, one per engine step, encoded exactly
as vLLM's ZMQ publisher encodes them (msgspec msgpack, ``KVEventBatch``, ints for hashes):
1-3 ``BlockStored`` runs of 1-16 blocks each carrying ``block_size`` token ids per block,
and, once the worker's cache is full (50k blocks), one ``BlockRemoved`` per evicted block
(vLLM sends one hash per event), so stores and removes balance as in steady state.

Measured side by side (alternating per round), each from bytes with NATS headers:
- ours: ``KvEventIngestor.on_event_message`` (stream checks, the adapter's summary decoder
  that skips token ids, removes merged per batch) into ``InMemoryClusterKvIndex``;
- baseline: vLLM's own ``KVEventBatch`` msgspec decoder (all fields, token ids included),
  one domain event per vLLM event, into ``NaiveClusterKvIndex`` (set per worker and tier):
  what a consumer written against vLLM's classes does.
Reports block events per second (stored + removed hashes), medians over rounds, and the
ratio. Single thread: "on one core".
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

import msgspec

from kvhint import schemas as s
from kvhint.router.kv_index import (
    BlocksRemoved,
    BlocksStored,
    InMemoryClusterKvIndex,
    KvEventIngestor,
    NaiveClusterKvIndex,
)


def make_batches(n: int, block_size: int, seed: int, capacity: int = 50_000
                 ) -> tuple[list[bytes], int]:
    rng = random.Random(seed)
    resident: list[int] = []
    payloads: list[bytes] = []
    block_events = 0
    parent = None
    for _ in range(n):
        events: list[s.BlockStored | s.BlockRemoved] = []
        for _ in range(rng.randint(1, 3)):
            k = rng.randint(1, 16)
            hashes = [rng.getrandbits(64) for _ in range(k)]
            events.append(s.BlockStored(
                block_hashes=hashes, parent_block_hash=parent,
                token_ids=[rng.randrange(32_000) for _ in range(block_size * k)],
                block_size=block_size, lora_id=None, medium="GPU", lora_name=None,
                group_idx=0, kv_cache_spec_kind="full_attention",
                session_id=f"tenant/s{rng.randrange(200)}"))
            parent = hashes[-1] if rng.random() < 0.5 else None
            resident += hashes
            block_events += k
        while len(resident) > capacity:
            victim = resident.pop(rng.randrange(len(resident)))
            events.append(s.BlockRemoved(block_hashes=[victim], medium="GPU", group_idx=0))
            block_events += 1
        payloads.append(s.encode_event_batch(s.KVEventBatch(ts=time.time(), events=events)))
    return payloads, block_events


class BaselineConsumer:
    """vLLM's own event classes and decoder, one domain event per vLLM event."""

    def __init__(self) -> None:
        from vllm.distributed import kv_events as v

        self._v = v
        self._decoder = msgspec.msgpack.Decoder(v.KVEventBatch)
        self.index = NaiveClusterKvIndex()

    def on_message(self, headers: dict[str, str], payload: bytes) -> None:
        meta = s.EventBatchMeta.from_headers(headers)
        batch = self._decoder.decode(payload)
        v, apply = self._v, self.index.apply
        for ev in batch.events:
            if isinstance(ev, v.BlockStored):
                apply(BlocksStored(meta.worker_id, ev.block_hashes, ev.parent_block_hash,
                                   ev.medium or "GPU", ev.session_id,
                                   len(ev.block_hashes) * ev.block_size))
            elif isinstance(ev, v.BlockRemoved):
                apply(BlocksRemoved(meta.worker_id, ev.block_hashes, ev.medium or "GPU"))


def run_ours(messages: list[tuple[dict[str, str], bytes]]) -> tuple[float, object]:
    ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=time.monotonic)
    on_message = ingestor.on_event_message
    gc.disable()
    start = time.thread_time()
    for headers, payload in messages:
        on_message(headers, payload)
    elapsed = time.thread_time() - start
    gc.enable()
    return elapsed, ingestor


def run_baseline(messages: list[tuple[dict[str, str], bytes]]) -> tuple[float, object]:
    consumer = BaselineConsumer()
    gc.disable()
    start = time.thread_time()
    for headers, payload in messages:
        consumer.on_message(headers, payload)
    elapsed = time.thread_time() - start
    gc.enable()
    return elapsed, consumer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    print("command: .venv/bin/python tests/benchmarks/index/bench_index_ingest.py "
          + " ".join(sys.argv[1:]))
    payloads, block_events = make_batches(args.batches, args.block_size, seed=3)
    messages = [(s.EventBatchMeta("w0", "e1", i + 1).to_headers(), p)
                for i, p in enumerate(payloads)]
    size = sum(map(len, payloads))
    print(f"{len(payloads)} batches, {block_events:,} block events, {size / 2**20:.1f} MiB of "
          f"msgpack ({args.block_size} token ids per stored block)")
    rates: dict[str, list[float]] = {"ours": [], "baseline": []}
    last = {}
    for _ in range(args.rounds):
        for name, run in (("ours", run_ours), ("baseline", run_baseline)):
            elapsed, last[name] = run(messages)
            rates[name].append(block_events / elapsed)
    ours_index = last["ours"].index  # type: ignore[attr-defined]
    base_index = last["baseline"].index  # type: ignore[attr-defined]
    assert ours_index.export_state() == base_index.export_state()
    med = {name: sorted(r)[len(r) // 2] for name, r in rates.items()}
    for name, values in rates.items():
        print(f"{name:9s} median {med[name] / 1e3:7.0f}k block events/s   rounds: "
              + ", ".join(f"{v / 1e3:.0f}k" for v in values))
    print(f"ours / baseline: {med['ours'] / med['baseline']:.2f}x; target >= 500k/s: "
          f"{'met' if med['ours'] >= 500_000 else 'NOT met'} (thread CPU time, one core)")


if __name__ == "__main__":
    main()
