"""A resync that ends in a hole hands its batches from the hole on to the next resync
(:mod:`kvhint.router.kv_index.stream_resync`): they are applied after the next snapshot,
and they count against the buffer's bounds meanwhile."""

from __future__ import annotations

from kvhint.router.kv_index.stream import (
    BatchVerdict,
    Decision,
    StreamConfig,
    StreamPhase,
    WorkerStream,
)


def test_batches_after_a_hole_wait_for_the_next_snapshot_within_the_buffer_bounds() -> None:
    stream: WorkerStream[str] = WorkerStream("w0", StreamConfig(max_buffered_bytes=30))
    assert stream.on_batch("e1", 1, "b1", 0.0, size=10).verdict is BatchVerdict.APPLY
    assert stream.on_batch("e1", 3, "b3", 0.0, size=10).verdict is BatchVerdict.BUFFERED
    stream.on_batch("e1", 5, "b5", 0.0, size=10)
    stream.on_batch("e1", 6, "b6", 0.0, size=10)
    assert stream.on_snapshot_page("e1", 3, 0, None, "p3", 0.0) == ("done", ["p3"])
    ready, decision = stream.finish_resync(0.0)
    # b3 is in the snapshot; seq 4 is missing: b5 and b6 wait for another snapshot.
    assert ready == [] and decision.resync_reason == "hole after snapshot: expected 4, got 5"
    assert stream.phase is StreamPhase.RESYNCING and stream.applied_seq == 3
    # The 20 bytes held count: 10 more fit, 10 after them overflow.
    assert stream.on_batch("e1", 7, "b7", 0.0, size=10).verdict is BatchVerdict.BUFFERED
    assert stream.on_batch("e1", 8, "b8", 0.0, size=10).verdict is BatchVerdict.OVERFLOW
    assert stream.on_batch("e1", 6, "b6", 0.0, size=10).verdict is BatchVerdict.DUPLICATE
    assert stream.on_snapshot_page("e1", 4, 0, None, "p4", 0.0) == ("done", ["p4"])
    ready, decision = stream.finish_resync(0.0)
    assert ready == ["b5", "b6", "b7"] and decision == Decision()
    assert stream.phase is StreamPhase.LIVE and stream.applied_seq == 7
    c = stream.counters
    assert (c.batches_applied, c.covered_by_snapshot, c.gaps, c.missing_batches) == (4, 1, 2, 2)
    assert (c.buffered, c.overflow_dropped, c.duplicates) == (4, 1, 1)
    assert (c.resyncs_started, c.resyncs_completed) == (2, 2)
