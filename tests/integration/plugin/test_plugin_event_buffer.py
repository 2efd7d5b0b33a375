"""KV event batches on their way to the transport, from vLLM's real KVCacheManager and
block pool: bounded by what they hold while NATS is down, and every drained batch is
published under its sequence number, even when the plugin's own index update fails."""

from __future__ import annotations

import gc
import random
import tracemalloc
from typing import Any

import pytest

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import HeadlessCache, build_kv_cache_manager
from kvhint.engine_plugin.mailbox import Mailbox, event_batch_bytes


def _plugin(num_blocks: int, **extra: Any) -> tuple[HeadlessCache, PluginCore, Mailbox]:
    config = PluginConfig(worker_id="w0", **extra)
    cache = build_kv_cache_manager(block_size=16, num_blocks=num_blocks)
    mailbox = Mailbox(config.inbound_buffer, config.outcome_buffer, config.event_buffer_batches)
    return cache, PluginCore.attach(cache.manager, config, mailbox=mailbox), mailbox


def _step(cache: HeadlessCache, core: PluginCore, tokens: list[int], session: str) -> None:
    """One request cached and finished, and the scheduler's per-step drain of events."""
    request = cache.make_request(tokens, session_id=session)
    cache.admit(request)
    cache.finish(request)
    core.sync()


def test_batches_held_through_an_outage_stay_within_the_byte_bound() -> None:
    """No transport drains the mailbox (NATS down). Before, only the count bound
    (event_buffer_batches, 10,000) held: 1,000 steps of 8k-token prefills kept 439 MB.
    Now what the waiting batches hold, measured, stays within event_buffer_bytes; the
    oldest go, counted, and what stays is the newest, in sequence."""
    limit = 2 << 20
    cache, core, mailbox = _plugin(600, event_buffer_bytes=limit)
    assert mailbox.event_bytes_limit == limit  # from the config, by the core
    rng = random.Random(0)
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(30):
            _step(cache, core, [rng.randrange(1000, 150_000) for _ in range(2048)], f"s{i}")
            assert mailbox.queued_event_bytes() <= limit
        gc.collect()
        with_batches = tracemalloc.get_traced_memory()[0]
        queued = mailbox.queued_event_bytes()
        assert queued == sum(event_batch_bytes(b.events) for b in mailbox.event_batches)
        seqs = [b.seq for b in mailbox.event_batches]
        mailbox.event_batches.clear()
        gc.collect()
        held = with_batches - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0 < held <= limit  # measured
    assert held <= queued <= limit  # the estimate is never below what they hold
    assert seqs == list(range(core.event_seq - len(seqs) + 1, core.event_seq + 1))
    assert mailbox.counters.event_batches_dropped == core.event_seq - len(seqs) > 0
    assert mailbox.counters.events_dropped > 0  # kvhint:events_dropped; the router resyncs


def test_a_batch_is_published_in_sequence_even_when_the_index_update_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected fault (a plugin bug cannot be caused on purpose otherwise): the session
    index raises on every event. Before, the batch was then never queued and the sequence
    number not advanced, so the router saw no gap and never resynced; now each batch goes
    out under the next number and the failure is counted."""
    cache, core, mailbox = _plugin(64)

    def broken(*_: Any) -> None:
        raise RuntimeError("injected")

    _step(cache, core, list(range(1000, 1064)), "s0")
    assert [b.seq for b in mailbox.event_batches] == [1]
    monkeypatch.setattr(core.index, "apply", broken)
    _step(cache, core, list(range(2000, 2064)), "s1")  # the tee's guard catches it
    monkeypatch.undo()
    _step(cache, core, list(range(3000, 3064)), "s2")
    assert [b.seq for b in mailbox.event_batches] == [1, 2, 3]
    assert all(b.events for b in mailbox.event_batches)
    assert core.counters.internal_errors == 1
    assert core.event_seq == 3 and core.counters.event_batches == 3
