"""The plugin's index and the router read the published stream alike, and a snapshot of
the one rebuilds the other.

The snapshot lists a block of a reference-counted tier (all but GPU) once per copy the
index counts, so a router that resyncs from it holds the same references as one that
followed the event stream (vLLM's offloading connector announces a hash once per chunk
holding it, and removes it as often; the router counts them). A run of medium-less
``AllBlocksCleared`` clears GPU, then CPU, on both sides.

The plugin side runs its real code (vLLM adapter event mapping, SessionPrefixIndex,
KeptSnapshots and snapshot_page as the transport serves pages); the router side its real
EventBatchAdapter, snapshot_to_event and InMemoryClusterKvIndex, fed the same wire batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvhint import schemas as s
from kvhint.engine_plugin.mailbox import SnapshotOut
from kvhint.engine_plugin.session_index import SessionPrefixIndex
from kvhint.engine_plugin.snapshot_pages import KeptSnapshots, snapshot_page
from kvhint.engine_plugin.vllm_adapter import VllmCacheAdapter
from kvhint.router.kv_index import EventBatchAdapter, InMemoryClusterKvIndex, snapshot_to_event


@dataclass
class _Drops:
    snapshots_dropped: int = 0
    snapshots_evicted: int = 0


def store(hashes: list[int], parent: int | None, medium: str) -> s.BlockStored:
    return s.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                         token_ids=list(range(32 * len(hashes))), block_size=32, lora_id=None,
                         medium=medium, lora_name=None, group_idx=0)


def remove(hashes: list[int], medium: str) -> s.BlockRemoved:
    return s.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


class Pair:
    """The plugin's index and a router index following the same published batches."""

    def __init__(self) -> None:
        self.plugin = SessionPrefixIndex()
        self.adapter = EventBatchAdapter()
        self.router = InMemoryClusterKvIndex()

    def publish(self, *events: s.BlockStored | s.BlockRemoved | s.AllBlocksCleared) -> None:
        self.plugin.replay(VllmCacheAdapter.index_events(events))
        payload = s.encode_event_batch(s.KVEventBatch(ts=1.0, events=list(events)))
        self.router.apply_all(self.adapter.decode("w0", payload))

    def resynced(self, limit: int) -> InMemoryClusterKvIndex:
        """A fresh router index loaded from the plugin's snapshot, ``limit`` items a page."""
        snapshot = SnapshotOut(7, self.plugin.snapshot_raw(), self.plugin.snapshot_sessions(),
                               "reply", 0, limit)
        ordered = KeptSnapshots(1_000, _Drops()).keep(snapshot)
        pages: list[s.WorkerSnapshot] = []
        cursor: int | None = 0
        while cursor is not None:
            page = s.decode_snapshot(snapshot_page(snapshot, ordered, cursor, limit, 1 << 20,
                                                   "w0", "e1", 32))
            assert page.next_cursor is None or page.next_cursor > cursor  # pages advance
            pages.append(page)
            cursor = page.next_cursor
        index = InMemoryClusterKvIndex()
        index.apply(snapshot_to_event(pages))
        return index


@pytest.mark.parametrize("limit", [1, 2, 50])
def test_a_twice_announced_host_block_survives_one_removal_after_a_resync(limit: int) -> None:
    pair = Pair()
    # Two host chunks overlapping at block 2 each announce it (vLLM's offloading events);
    # block 1 is on GPU as well, listed once there.
    pair.publish(store([1], None, "GPU"), store([1, 2], None, "CPU"),
                 store([2, 3], 1, "CPU"))
    assert pair.plugin.copies_in("CPU") == [1, 2, 2, 3]
    assert pair.plugin.snapshot_blocks() == [
        (1, None, "GPU"), (1, None, "CPU"), (2, 1, "CPU"), (2, 1, "CPU"), (3, 2, "CPU")]
    resynced = pair.resynced(limit)
    live = pair.router.export_state()
    assert resynced.export_state().blocks == live.blocks
    assert resynced.export_state().refs == live.refs == {"w0": {"CPU": {2: 1}}}
    # One chunk leaves the host tier: block 2 is still held by the other, on both.
    pair.publish(remove([1, 2], "CPU"))
    resynced.apply_all(EventBatchAdapter().convert_events("w0", [remove([1, 2], "CPU")]))
    for index in (pair.router, resynced):
        assert index.has_block("w0", 2, "CPU")
        assert not index.has_block("w0", 1, "CPU") and index.has_block("w0", 1, "GPU")
    assert pair.plugin.is_resident(2, "CPU")
    assert resynced.export_state().blocks == pair.router.export_state().blocks
    assert resynced.stats().missing_removes == 0


def test_a_gpu_block_is_listed_once_whatever_its_copies() -> None:
    # vLLM may cache duplicate physical copies of a hash on GPU (each announced); the
    # router keeps one GPU bit and reads a repeat as a duplicate store, so it is listed once.
    pair = Pair()
    pair.publish(store([5], None, "GPU"), store([5], None, "GPU"))
    assert pair.plugin.snapshot_blocks() == [(5, None, "GPU")]
    assert pair.resynced(1).export_state().blocks == pair.router.export_state().blocks


def test_a_run_of_clears_drops_gpu_then_cpu_in_the_plugin_as_in_the_router() -> None:
    pair = Pair()
    pair.publish(store([1, 2], None, "GPU"), store([1, 2, 3], None, "CPU"),
                 store([4], None, "STORAGE"))
    pair.publish(s.AllBlocksCleared())  # GPU only
    assert pair.plugin.copies_in("CPU") == [1, 2, 3] and not pair.plugin.is_resident(1)
    pair.publish(store([5], None, "GPU"), s.AllBlocksCleared(), remove([9], "CPU"),
                 s.AllBlocksCleared())  # apart: each the GPU's
    assert pair.plugin.copies_in("CPU") == [1, 2, 3]
    pair.publish(store([6], None, "GPU"), s.AllBlocksCleared(), s.AllBlocksCleared())
    assert pair.plugin.copies_in("CPU") == [] and not pair.plugin.is_resident(6)
    assert pair.plugin.is_resident(4, "STORAGE")
    assert pair.router.export_state().blocks == {"w0": {"STORAGE": frozenset({4})}}
    assert pair.resynced(2).export_state().blocks == pair.router.export_state().blocks
