"""The event batches waiting for the transport are bounded by their size, not only by
their count: each BlockStored carries its block's token ids, and 10,000 batches of 8k-token
prefills held ~4.4 GB through a NATS outage."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhint.engine_plugin.mailbox import (
    EVENT_BYTES,
    EVENT_ITEM_BYTES,
    EventBatchOut,
    Mailbox,
    event_batch_bytes,
    pop_oldest,
)


@dataclass
class _Stored:
    """The fields of vLLM's BlockStored the estimate reads (vLLM's own type is measured
    in tests/integration/plugin/test_plugin_event_buffer.py)."""

    token_ids: list[int] = field(default_factory=lambda: list(range(1000, 1016)))
    block_hashes: list[int] = field(default_factory=lambda: [1 << 63])
    extra_keys: list[tuple[int, ...]] | None = None


def _events(blocks: int) -> list[_Stored]:
    return [_Stored() for _ in range(blocks)]


def _sizes_agree(mailbox: Mailbox) -> int:
    queued = mailbox.queued_event_bytes()
    assert queued == sum(b.nbytes for b in mailbox.event_batches)
    return queued


def test_the_estimate_counts_each_event_and_each_token_id_hash_and_extra_key() -> None:
    events = [_Stored(), _Stored(token_ids=[], block_hashes=[1, 2], extra_keys=[(1,), (2,)])]
    assert event_batch_bytes(events) == 2 * EVENT_BYTES + (17 + 4) * EVENT_ITEM_BYTES
    assert event_batch_bytes([object()]) == EVENT_BYTES  # AllBlocksCleared: no lists


def test_waiting_batches_stay_within_the_byte_bound_the_oldest_dropped_and_counted() -> None:
    limit = 50_000
    mailbox = Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=10_000,
                      event_bytes_limit=limit)
    events = _events(8)
    each = event_batch_bytes(events)
    for seq in range(1, 41):
        mailbox.put_events(EventBatchOut(seq, 0.0, events))
        assert _sizes_agree(mailbox) <= limit
    seqs = [b.seq for b in mailbox.event_batches]
    assert len(seqs) == limit // each and seqs == list(range(41 - len(seqs), 41))
    dropped = 40 - len(seqs)
    assert mailbox.counters.event_batches_dropped == dropped
    assert mailbox.counters.events_dropped == 8 * dropped  # the router resyncs on the gap
    # The transport takes batches from the head, and puts back one it failed to publish:
    # the size of what waits follows.
    head = pop_oldest(mailbox.event_batches)
    assert _sizes_agree(mailbox) == (len(seqs) - 1) * each
    mailbox.event_batches.appendleft(head)
    assert _sizes_agree(mailbox) == len(seqs) * each
    while pop_oldest(mailbox.event_batches) is not None:
        pass
    assert mailbox.queued_event_bytes() == 0
    mailbox.put_events(EventBatchOut(41, 0.0, events))
    assert _sizes_agree(mailbox) == each


def test_a_batch_past_the_byte_bound_by_itself_is_dropped_and_counted() -> None:
    mailbox = Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=10,
                      event_bytes_limit=10_000)
    mailbox.put_events(EventBatchOut(1, 0.0, _events(2)))
    mailbox.put_events(EventBatchOut(2, 0.0, _events(100)))
    assert [b.seq for b in mailbox.event_batches] == [1]  # what waited stays
    assert (mailbox.counters.event_batches_dropped, mailbox.counters.events_dropped) == (1, 100)


def test_the_batch_count_bound_still_holds() -> None:
    mailbox = Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=3,
                      event_bytes_limit=1 << 30)
    for seq in range(1, 6):
        mailbox.put_events(EventBatchOut(seq, 0.0, _events(1)))
    assert [b.seq for b in mailbox.event_batches] == [3, 4, 5]
    assert mailbox.counters.event_batches_dropped == 2
