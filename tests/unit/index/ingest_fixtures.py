"""Shared helpers of the ingestor's unit tests (test_index_ingest*.py): an ingestor on a
settable clock, and vLLM-shaped wire messages (event batches, headers, heartbeats,
snapshot pages)."""

from __future__ import annotations

from functools import partial
from typing import Any

from kvhint import schemas as s
from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor, StreamConfig
from kvhint.schemas.snapshot import SnapshotBlock as WireBlock
from kvhint.schemas.snapshot import SnapshotSession


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_ingestor(**config: Any) -> tuple[KvEventIngestor, InMemoryClusterKvIndex, Clock]:
    """An ingestor over a fresh in-memory index, on a settable clock; ``config``:
    StreamConfig fields."""
    clock = Clock()
    index = InMemoryClusterKvIndex()
    return KvEventIngestor(index, clock, StreamConfig(**config)), index, clock


# Two blocks a snapshot page: resyncs page (the tests that do not ask otherwise).
make_paging_ingestor = partial(make_ingestor, snapshot_page_limit=2)


def batch(*events: s.BlockStored | s.BlockRemoved | s.AllBlocksCleared) -> bytes:
    return s.encode_event_batch(s.KVEventBatch(ts=1.0, events=list(events)))


def store(hashes: list[int], parent: int | None = None, medium: str | None = "GPU",
          session: str | None = None, group: int | None = 0) -> s.BlockStored:
    return s.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                         token_ids=list(range(32 * len(hashes))), block_size=32, lora_id=None,
                         medium=medium, lora_name=None, group_idx=group, session_id=session)


def remove(h: int, medium: str | None = "GPU") -> s.BlockRemoved:
    return s.BlockRemoved(block_hashes=[h], medium=medium, group_idx=0)


def headers(worker: str, epoch: str, seq: int) -> dict[str, str]:
    return s.EventBatchMeta(worker, epoch, seq).to_headers()


def status(worker: str = "w0", epoch: str = "e1", last_seq: int = 0,
           interval_s: float = 1.0) -> s.WorkerStatus:
    return s.WorkerStatus(
        worker_id=worker, epoch=epoch, model="tiny", cache_namespace="ns", block_size=32,
        hash_algo="sha256", none_hash_seed="vllm-none-hash", supported_actions={},
        budgets=s.Budgets(max_pinned_blocks=0, max_pin_ttl_s=600, max_retained_blocks=0,
                          max_retain_ttl_s=3600),
        usage=s.Usage(gpu_blocks_total=10, gpu_blocks_free=10, kv_usage=0.0),
        last_event_seq=last_seq, interval_s=interval_s, at=0.0)


def page(worker: str, epoch: str, seq: int, blocks: list[tuple[int, int | None, str]],
         cursor_next: int | None = None, sessions: list[tuple[str, list[int]]] = ()
         ) -> s.WorkerSnapshot:
    return s.WorkerSnapshot(
        worker_id=worker, epoch=epoch, seq=seq, block_size=32,
        blocks=[WireBlock(h, p, m) for h, p, m in blocks],
        sessions=[SnapshotSession(sid, f) for sid, f in sessions], next_cursor=cursor_next)
