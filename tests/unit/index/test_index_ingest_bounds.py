"""The ingestor under input that must not grow it without bound or lose a count: snapshot
pages whose cursor does not advance, resync buffers of large batches, a resyncing worker
removed from the configuration."""

from __future__ import annotations

import msgspec
from ingest_fixtures import batch, headers, page, status, store, make_paging_ingestor as make

from kvhint import schemas as s

from kvhint.router.kv_index import (
    KvEventIngestor,
    RequestSnapshot,
)



def _resyncing(ing: KvEventIngestor) -> None:
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    acts = ing.on_event_message(headers("w0", "e1", 3), batch(store([3], parent=2)))
    assert acts == [RequestSnapshot("w0", 0, 2, "sequence gap: expected 2, got 3")]


def test_a_page_whose_next_cursor_does_not_advance_is_refused() -> None:
    """A page naming a next cursor at or before its own (a plugin bug, a hostile reply)
    sent the ingestor asking for the same page for ever, keeping every copy of it: the
    resync never ended and its pages grew without bound. It is refused (counted), the
    pages so far dropped, and the snapshot retried from cursor 0 after the retry delay."""
    ing, index, clock = make()
    _resyncing(ing)
    for _ in range(3):
        acts = ing.on_snapshot_page(page("w0", "e1", 2, [(1, None, "GPU"), (2, 1, "GPU")],
                                         cursor_next=0), cursor=0)
        assert acts == []  # not asked again at once
    stream = ing.stats().stream
    # Each copy refused and counted; none kept.
    assert stream["snapshot_pages_invalid"] == 3 and stream["snapshot_failures"] == 3
    # A page that goes back (cursor 2 -> 1) is refused as well.
    clock.now += 1.5
    acts = ing.tick()
    assert acts[-1] == RequestSnapshot("w0", 0, 2, "retrying snapshot")
    ing.on_snapshot_page(page("w0", "e1", 2, [(1, None, "GPU"), (2, 1, "GPU")],
                              cursor_next=2), cursor=0)
    assert ing.on_snapshot_page(page("w0", "e1", 2, [(5, 2, "GPU")], cursor_next=1),
                                cursor=2) == []
    assert ing.stats().stream["snapshot_pages_invalid"] == 4
    # A good snapshot still ends the resync, with nothing of the refused pages in it.
    clock.now += 1.5
    assert ing.tick()[-1].cursor == 0
    ing.on_snapshot_page(page("w0", "e1", 2, [(1, None, "GPU"), (2, 1, "GPU")],
                              cursor_next=2), cursor=0)
    assert ing.on_snapshot_page(page("w0", "e1", 2, []), cursor=2) == []
    assert ing.live_workers() == ("w0",)
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1, 2, 3})}}


def test_the_resync_buffer_is_bounded_in_bytes() -> None:
    """Batches wait in the resync buffer as raw payloads, up to max_buffered_batches of
    them: at vLLM's sizes (token ids of every stored block) 10,000 can hold gigabytes per
    worker. max_buffered_bytes bounds them too; what it drops is counted as overflow and
    the resync notices the hole."""
    ing, index, _ = make(max_buffered_bytes=5 << 20)
    _resyncing(ing)  # batch 3 (a few bytes) waits in the buffer
    big = batch(store([7], parent=3)) + b"\0" * (1 << 20)  # one object, shared: cheap
    for seq in range(4, 14):
        ing.on_event_message(headers("w0", "e1", seq), big)
    stream = ing.stats().stream
    assert stream["buffered"] == 5 and stream["overflow_dropped"] == 6
    # A snapshot of seq 7, the last batch kept, ends the resync; the next batch shows
    # the hole the dropped ones left, and the worker resyncs again.
    assert ing.on_snapshot_page(page("w0", "e1", 7, [(1, None, "GPU")]), cursor=0) == []
    assert ing.live_workers() == ("w0",) and index.has_block("w0", 1)
    acts = ing.on_event_message(headers("w0", "e1", 14), batch(store([14])))
    assert "sequence gap: expected 8, got 14" in acts[-1].reason


def test_a_resyncing_worker_removed_from_the_configuration_counts_its_buffer() -> None:
    """forget_worker dropped the batches waiting in a resyncing worker's buffer after its
    counters were summed up: buffered, never applied nor counted as dropped."""
    ing, _, _ = make()
    _resyncing(ing)
    ing.on_event_message(headers("w0", "e1", 4), batch(store([4], parent=3)))
    before = ing.stats().stream
    assert before["buffered"] == 2
    ing.forget_worker("w0")
    after = ing.stats().stream
    dropped = sum(after[k] - before[k] for k in after if k != "buffered")
    assert dropped == 2, {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_a_heartbeat_with_budgets_out_of_bounds_is_malformed() -> None:
    """A pin or retain TTL of 0 or over a day, a negative block budget: the planner sent
    hints from it that every worker refused (repeated refusals switch Pin/Retain off).
    Such a heartbeat is malformed, counted, and the worker not heard from it."""
    ing, _, _ = make()
    good = status("w0")
    for field, value in (("max_pin_ttl_s", 0.0), ("max_retain_ttl_s", 90_000.0),
                         ("max_pinned_blocks", -1)):
        bad = msgspec.structs.replace(good, budgets=msgspec.structs.replace(
            good.budgets, **{field: value}))
        assert ing.on_status_message(s.encode_status(bad)) == []
    assert ing.stats().malformed_messages == 3 and ing.live_workers() == ()
    ing.on_status_message(s.encode_status(good))
    assert ing.live_workers() == ("w0",)
