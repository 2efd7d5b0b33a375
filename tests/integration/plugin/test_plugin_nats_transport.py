"""The plugin's NATS transport with a real NATS server and vLLM's real scheduler.

The headless scheduler has no EngineCore busy loop, so the test steps it itself where
the engine would (the idle wake-up is measured against a real server in the e2e tests and
the latency benchmark).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import nats
import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from kvhint.engine_plugin import core as core_module
from kvhint.engine_plugin import core_status
from kvhint.engine_plugin.config import LOGGER_NAME, PluginConfig
from kvhint.engine_plugin.mailbox import Mailbox
from kvhint.engine_plugin.transport import NatsTransport
from kvhint.engine_plugin.metrics import HINTS_KEY
from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.router.devstack.nats_server import NatsServerProcess, free_port
from scheduler_fixtures import nats_plugin as plugin
from scheduler_fixtures import events_stream_reader, nats_client, until
from kvhint.schemas import (
    DonorAdvice,
    EventBatchDecoder,
    EventBatchMeta,
    KvHintsEnvelope,
    PinPayload,
    RetainPayload,
    SnapshotRequest,
    Subjects,
    Target,
    decode_outcome,
    decode_releases,
    decode_snapshot,
    decode_status,
    encode_advice,
    encode_hints,
    encode_snapshot_request,
    make_action,
)

BS = 32


def turn(h: HeadlessScheduler, session: str, ids: list[int]) -> None:
    h.run(h.make_request(tokens_for_block_ids(ids, BS) + [3] * 5, session_id=session))


def pin_message(action_id: str, session: str = "s", message_id: str | None = None) -> bytes:
    return encode_hints(KvHintsEnvelope(
        protocol_version="1", message_id=message_id or f"m-{action_id}",
        actions=[make_action(action_id, PinPayload(target=Target(session_id=session), ttl_s=30))]))


async def step_until(h: HeadlessScheduler, predicate: Callable[[], bool],
                     timeout_s: float = 10.0) -> None:
    """Step the scheduler like an awake engine until ``predicate`` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        h.step()
        await asyncio.sleep(0.01)


async def collect(nc: Any, subject: str) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        await queue.put(msg)

    await nc.subscribe(subject, cb=on_msg)
    return queue


async def test_hints_outcomes_events_and_heartbeat_over_nats(nats_url: str,
                                                             subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with events_stream_reader(nats_url, subjects) as (nc, js):
        outcomes = await collect(nc, subjects.outcomes("w0"))
        status = await collect(nc, subjects.status("w0"))
        with plugin(nats_url, subject_prefix, pin_budget_fraction=0.2) as h:
            transport = h.connector.transport
            await until(lambda: transport.connected)
            turn(h, "s", [1, 2, 3])
            await nc.publish(subjects.hints("w0"), pin_message("p1"))
            await until(lambda: bool(h.connector.core.mailbox.inbound))
            h.step()  # the engine's next step applies it
            outcome = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (outcome.action_id, outcome.status.value, outcome.worker_id) == \
                ("p1", "accepted", "w0")
            assert outcome.applied.blocks == 3
            # Heartbeat: identity, budgets and the usage the scheduler thread reported.
            beat = decode_status((await asyncio.wait_for(status.get(), 5)).data)
            while beat.usage.pinned_blocks != 3:
                h.step()
                beat = decode_status((await asyncio.wait_for(status.get(), 5)).data)
            assert beat.worker_id == "w0" and beat.block_size == BS
            assert beat.budgets.max_pinned_blocks == 12 and beat.hash_algo == "sha256"
            assert beat.none_hash_seed == "vllm-none-hash"
            assert "kv.pin" in beat.supported_actions and "kv.demote" not in beat.supported_actions
            assert beat.cache_namespace == h.connector.core.cache_namespace
            assert beat.http_url is None
            epoch = beat.epoch
            # Events: vLLM's msgpack batches on the JetStream stream, seq 1.. per epoch.
            turn(h, "t", [5, 6])
            sub = await js.subscribe(subjects.events("w0"), ordered_consumer=True)
            decoder = EventBatchDecoder()
            metas, stored_sessions = [], []
            while len(metas) < 2:
                msg = await sub.next_msg(timeout=5)
                metas.append(EventBatchMeta.from_headers(msg.headers))
                for event in decoder.decode(msg.data).events:
                    stored_sessions.append(getattr(event, "session_id", None))
            assert [(m.worker_id, m.epoch, m.seq) for m in metas] == [("w0", epoch, 1),
                                                                      ("w0", epoch, 2)]
            assert "s" in stored_sessions
            assert beat.last_event_seq >= 1


async def test_a_hold_that_loses_blocks_later_is_reported_on_the_releases_subject(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)

    def retain(action_id: str, session: str, priority: int) -> bytes:
        return encode_hints(KvHintsEnvelope(
            protocol_version="1", message_id=f"m-{action_id}", actions=[make_action(
                action_id, RetainPayload(target=Target(session_id=session), priority=priority))]))

    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        releases = await collect(nc, subjects.releases("w0"))
        with plugin(nats_url, subject_prefix, create_events_stream=False,
                    retain_budget_fraction=0.1) as h:  # 6 blocks
            transport = h.connector.transport
            await until(lambda: transport.connected)
            turn(h, "lo", [1, 2, 3, 4])
            turn(h, "hi", [5, 6, 7, 8])
            await nc.publish(subjects.hints("w0"), retain("r-lo", "lo", 10))
            await step_until(h, lambda: outcomes.qsize() == 1)
            await nc.publish(subjects.hints("w0"), retain("r-hi", "hi", 90))
            await step_until(h, lambda: releases.qsize() == 1)
            message = decode_releases((await releases.get()).data)
            assert message.worker_id == "w0"
            assert [(r.action_id, r.session_id, r.reason.value, r.released.blocks,
                     r.held.blocks) for r in message.releases] == [("r-lo", "lo", "displaced",
                                                                     2, 2)]
            assert transport.counters.releases_published == 1


async def test_snapshot_is_served_in_pages(nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        with plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            await until(lambda: h.connector.transport.connected)
            turn(h, "a", [1, 2, 3])
            turn(h, "b", [1, 2, 7, 8])
            turn(h, "c", [20])
            core = h.connector.core
            request = asyncio.ensure_future(nc.request(
                subjects.snapshot("w0"), encode_snapshot_request(SnapshotRequest(limit=3)),
                timeout=5))
            await step_until(h, request.done)
            pages = [decode_snapshot((await request).data)]
            while pages[-1].next_cursor is not None:
                reply = await nc.request(subjects.snapshot("w0"), encode_snapshot_request(
                    SnapshotRequest(cursor=pages[-1].next_cursor, limit=3)), timeout=5)
                pages.append(decode_snapshot(reply.data))
            blocks = [(b.block_hash, b.parent_hash, b.medium) for p in pages for b in p.blocks]
            sessions = {s.session_id: s.frontiers for p in pages for s in p.sessions}
            assert len(pages) == 3  # 6 blocks + 3 sessions, 3 per page
            assert blocks == core.index.snapshot_blocks()
            assert sessions == dict(core.index.snapshot_sessions())
            assert {p.seq for p in pages} == {core.event_seq}
            assert all(p.worker_id == "w0" and p.block_size == BS for p in pages)
            bad = asyncio.ensure_future(nc.request(subjects.snapshot("w0"), b'{"limit": -1}',
                                                   timeout=5))
            await step_until(h, bad.done)
            assert b"error" in (await bad).data


async def test_two_routers_paging_at_once_each_continue_their_own_snapshot(
        nats_url: str, subject_prefix: str) -> None:
    """Router replicas resync one worker at once, the index moving between their first
    pages: each later page comes from the snapshot its request names. Before, the worker
    kept only its latest snapshot, so one router's pages came from the other's and it
    started over, again and again."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:

        async def page(h, request: SnapshotRequest):  # noqa: ANN001, ANN202
            reply = asyncio.ensure_future(nc.request(
                subjects.snapshot("w0"), encode_snapshot_request(request), timeout=5))
            await step_until(h, reply.done)
            return decode_snapshot((await reply).data)

        with plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            await until(lambda: h.connector.transport.connected)
            turn(h, "a", [1, 2, 3, 4, 5, 6])
            first_a = await page(h, SnapshotRequest(limit=3))
            turn(h, "b", [20, 21])  # the index moves: a new seq
            first_b = await page(h, SnapshotRequest(limit=3))
            assert first_b.seq > first_a.seq
            rest_a = await page(h, SnapshotRequest(cursor=first_a.next_cursor, limit=3,
                                                   seq=first_a.seq))
            rest_b = await page(h, SnapshotRequest(cursor=first_b.next_cursor, limit=3,
                                                   seq=first_b.seq))
            assert (rest_a.seq, rest_b.seq) == (first_a.seq, first_b.seq)
            # A snapshot no longer kept is answered from a new one (the router restarts).
            gone = await page(h, SnapshotRequest(cursor=3, limit=3, seq=first_a.seq - 1))
            assert gone.seq == h.connector.core.event_seq


async def test_snapshot_requests_taken_in_one_step_share_one_copy_of_the_index(
        nats_url: str, subject_prefix: str) -> None:
    """Three routers (or retries) ask for a snapshot while the engine is busy: the next
    step answers all three from one copy of the index. Before, each copied the whole
    index on the scheduler thread (1M blocks: ~1 s of the engine's step each)."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        with plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            await until(lambda: h.connector.transport.connected)
            turn(h, "a", [1, 2, 3])
            core = h.connector.core
            copies = []
            snapshot_raw = core.index.snapshot_raw
            core.index.snapshot_raw = lambda: copies.append(1) or snapshot_raw()  # a spy
            requests = [asyncio.ensure_future(nc.request(
                subjects.snapshot("w0"), encode_snapshot_request(SnapshotRequest(limit=10)),
                timeout=5)) for _ in range(3)]
            await until(lambda: len(core.mailbox.inbound) == 3)
            await step_until(h, lambda: all(r.done() for r in requests))
            pages = [decode_snapshot((await r).data) for r in requests]
            assert len(copies) == 1
            assert all(len(p.blocks) == 3 and p.seq == core.event_seq for p in pages)


async def test_a_hint_the_engine_cannot_take_soon_is_deferred_at_once(
        nats_url: str, subject_prefix: str) -> None:
    """The engine is in a long step (here: not stepped at all): after defer_after_s the
    plugin answers ``deferred``, then the final outcome once the step comes."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, defer_after_s=0.05, pin_budget_fraction=0.2,
                    create_events_stream=False) as h:
            await until(lambda: h.connector.transport.connected)
            turn(h, "s", [1, 2, 3])
            started = time.monotonic()
            await nc.publish(subjects.hints("w0"), pin_message("slow"))
            first = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (first.action_id, first.status.value) == ("slow", "deferred")
            assert time.monotonic() - started < 2.0
            h.step()
            final = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (final.action_id, final.status.value) == ("slow", "accepted")
            # A message the engine takes in time gets no deferred.
            await nc.publish(subjects.hints("w0"), pin_message("fast"))
            await step_until(h, lambda: not outcomes.empty())
            quick = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (quick.action_id, quick.status.value) == ("fast", "accepted")
            assert h.connector.transport.counters.deferred_at_once == 1
            # A repeat of an answered action while the engine is busy gets no "deferred"
            # after its terminal outcome: only that outcome again, at the next step.
            await nc.publish(subjects.hints("w0"), pin_message("slow"))
            await asyncio.sleep(0.5)
            assert outcomes.empty()
            h.step()
            again = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (again.action_id, again.status.value) == ("slow", "accepted")
            assert h.connector.transport.counters.deferred_at_once == 1
            hints = h.connector._read_stats()[HINTS_KEY]
            assert hints["kv.pin|deferred"] == 1 and hints["kv.pin|accepted"] == 2


async def test_an_engine_idle_after_a_pin_is_woken_to_refresh_the_heartbeats_figures(
        nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat's figures are refreshed at most every STATUS_REFRESH_S, at a step. A
    step that skipped the refresh and after which the engine went idle left the heartbeat
    reporting the figures before it for good: a pin that step applied was missing (the
    e2e pin test saw 0 pinned blocks now and then). The transport now wakes the idle
    engine for one step when the skipped refresh falls due."""
    monkeypatch.setattr(core_status, "STATUS_REFRESH_S", 1.0)
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        status = await collect(nc, subjects.status("w0"))
        with plugin(nats_url, subject_prefix, pin_budget_fraction=0.2,
                    create_events_stream=False) as h:
            core = h.connector.core
            woken = threading.Event()
            core.mailbox.wake_engine = woken.set  # the engine's waker, as vLLM's would be
            await until(lambda: h.connector.transport.connected)
            turn(h, "s", [1, 2, 3])
            core.refresh_status()
            await nc.publish(subjects.hints("w0"), pin_message("p1"))
            await until(lambda: bool(core.mailbox.inbound))
            woken.clear()
            h.step()  # applies the pin; too soon after the last refresh to make one
            assert core.executor.pinned_blocks == 3
            # Connector stats held back also wake an idle engine; vLLM asks for them only
            # where stats are logged. Without them, only the skipped refresh may wake it.
            core.mailbox.stats_flush_at = None
            beat = decode_status((await asyncio.wait_for(status.get(), 5)).data)
            assert beat.usage.pinned_blocks == 0  # stale, until the engine steps again
            await until(woken.is_set, timeout_s=5)
            # The woken engine steps while the scheduler asks (has_requests), as vLLM's
            # busy loop does: a wake to ship /metrics may come first, and its step be too
            # soon for the refresh; the refresh's own wake follows.
            deadline = time.monotonic() + 5
            while beat.usage.pinned_blocks != 3 and time.monotonic() < deadline:
                while h.scheduler.has_requests():
                    h.step()
                beat = decode_status((await asyncio.wait_for(status.get(), 5)).data)
            assert beat.usage.pinned_blocks == 3


async def test_donor_advice_is_decoded_off_the_scheduler_thread_and_bad_advice_answered(
        nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hints were decoded by the transport when they came, donor advice by the scheduler
    thread (a 1 MB advice names ~45k hashes). Now the transport decodes advice too: the
    engine's inbox holds it decoded and the scheduler thread decodes nothing, and an
    advice that cannot be decoded is answered rejected (with the reason, counted in
    hints_total) by the transport, without waiting for an engine step."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            core = h.connector.core
            await until(lambda: h.connector.transport.connected)
            turn(h, "s", [1, 2])
            advice = DonorAdvice(advice_id="d1", session_id="t", namespace=core.cache_namespace,
                                 donor_block_hashes=core.index.session_blocks("s"),
                                 similarity=0.9, at=time.time())
            await nc.publish(subjects.advice("w0"), b'{"advice_id": "bad", "similarity": 7}')
            await nc.publish(subjects.advice("w0"), encode_advice(advice))
            bad = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (bad.action_id, bad.action_type, bad.status.value) == (
                "bad", "kv.donor", "rejected")
            assert "invalid donor advice" in bad.reason
            await until(lambda: bool(core.mailbox.inbound))
            (item,) = core.mailbox.inbound  # the bad one never reached the engine
            assert item.decoded == advice

            def not_on_the_scheduler_thread(data: Any) -> DonorAdvice:
                raise AssertionError("donor advice decoded on the scheduler thread")

            monkeypatch.setattr(core_module, "decode_advice", not_on_the_scheduler_thread)
            h.step()
            good = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (good.action_id, good.status.value) == ("d1", "accepted"), good.reason
            assert core.counters.internal_errors == 0
            assert h.connector._read_stats()[HINTS_KEY] == {
                "kv.donor|rejected": 1, "kv.donor|accepted": 1}


async def test_a_full_inbox_rejects_at_once_and_counts(nats_url: str,
                                                       subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            await until(lambda: h.connector.transport.connected)
            for i in range(3):  # the engine does not step: the inbox holds one
                await nc.publish(subjects.hints("w0"), pin_message(f"f{i}"))
            rejected = [decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
                        for _ in range(2)]
            assert [o.action_id for o in rejected] == ["f1", "f2"]
            assert all(o.status.value == "rejected" and "inbox full" in o.reason
                       for o in rejected)
            assert h.connector.core.mailbox.counters.inbound_dropped == 2
            h.step()
            first = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (first.action_id, first.status.value) == ("f0", "missing")
            # kvhint:hints_total counts the rejections the transport answered too.
            hints = h.connector._read_stats()[HINTS_KEY]
            assert hints == {"kv.pin|rejected": 2, "kv.pin|missing": 1}


async def test_made_up_action_types_turned_away_by_a_full_inbox_count_under_one_key(
        nats_url: str, subject_prefix: str) -> None:
    """The transport counts the rejections it answers by action type; a type from the wire
    may be any string. Before, each made-up type added a counter key for good (memory in
    the engine, and a fold of them all at every stats read on the scheduler thread)."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            await until(lambda: h.connector.transport.connected)
            await nc.publish(subjects.hints("w0"), pin_message("f0"))  # fills the inbox
            for i in range(20):
                await nc.publish(subjects.hints("w0"), json.dumps({
                    "protocol_version": "1", "message_id": f"m{i}", "actions": [{
                        "action_id": f"x{i}", "action_type": f"kv.made-up-{i}",
                        "action_version": "1.0", "payload": {}}]}).encode())
            for _ in range(20):
                await asyncio.wait_for(outcomes.get(), 5)
            transport = h.connector.transport
            seen = transport.counters.outcomes_seen(h.connector.core.mailbox.lock)
            assert seen == {("other", "rejected"): 20}


async def test_a_repeat_that_finds_the_inbox_full_gets_its_first_answer_or_nothing_new(
        nats_url: str, subject_prefix: str) -> None:
    """A redelivered hint (same action id) arrives while the inbox is full. Before, the
    transport answered it ``rejected`` (inbox full) although its first copy was accepted
    or still queued: the router got two contradicting answers for one id. Now an
    answered repeat gets the first outcome again and a queued one nothing new."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, inbound_buffer=1, pin_budget_fraction=0.2,
                    create_events_stream=False) as h:
            transport = h.connector.transport
            await until(lambda: transport.connected)
            turn(h, "s", [1, 2, 3])
            await nc.publish(subjects.hints("w0"), pin_message("p"))
            await until(lambda: bool(h.connector.core.mailbox.inbound))
            h.step()
            first = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (first.action_id, first.status.value) == ("p", "accepted")
            # The engine is busy: one message fills the inbox; repeats of both come.
            await nc.publish(subjects.hints("w0"), pin_message("q"))
            await until(lambda: bool(h.connector.core.mailbox.inbound))
            await nc.publish(subjects.hints("w0"), pin_message("p"))  # answered already
            await nc.publish(subjects.hints("w0"), pin_message("q"))  # still queued
            await nc.publish(subjects.hints("w0"), pin_message("n"))  # new: rejected
            got = [decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
                   for _ in range(2)]
            assert [(o.action_id, o.status.value) for o in got] == [
                ("p", "accepted"), ("n", "rejected")]
            assert got[0] == first
            await asyncio.sleep(0.3)
            assert outcomes.empty()  # nothing for the queued repeat of "q"
            h.step()
            final = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (final.action_id, final.status.value) == ("q", "accepted")
            assert (transport.counters.repeats_answered_again,
                    transport.counters.repeats_in_flight) == (1, 1)
            assert h.connector.core.mailbox.counters.inbound_dropped == 3
            await asyncio.sleep(0.3)
            assert outcomes.empty()
            # A rejected (inbox full) action is transient: its retry is applied.
            await nc.publish(subjects.hints("w0"), pin_message("n"))
            await until(lambda: bool(h.connector.core.mailbox.inbound))
            h.step()
            retry = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (retry.action_id, retry.status.value) == ("n", "accepted")


async def test_nats_down_never_blocks_the_engine_and_hints_flow_after_it_returns(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    with plugin(own_nats.url, subject_prefix, event_buffer_batches=1000,
                pin_budget_fraction=0.2) as h:
        transport = h.connector.transport
        await until(lambda: transport.connected)
        turn(h, "s", [1, 2, 3])
        await until(lambda: transport.counters.event_batches_published >= 1)
        own_nats.stop()
        await until(lambda: not transport.connected)
        started = time.monotonic()
        for i in range(20):  # the engine runs on; batches wait in the bounded buffer
            turn(h, f"x{i}", [100 + 5 * i, 101 + 5 * i])
        assert time.monotonic() - started < 5.0
        waiting = len(h.connector.core.mailbox.event_batches)
        assert waiting >= 20
        own_nats.start()
        await until(lambda: transport.connected, timeout_s=20)
        await until(lambda: not h.connector.core.mailbox.event_batches)
        async with nats_client(own_nats.url) as nc:
            outcomes = await collect(nc, subjects.outcomes("w0"))
            js = nc.jetstream()
            info = await js.stream_info(subjects.events_stream)
            assert info.state.messages == h.connector.core.event_seq  # no gap, no loss
            await nc.publish(subjects.hints("w0"), pin_message("after"))
            await until(lambda: bool(h.connector.core.mailbox.inbound))
            h.step()
            outcome = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (outcome.action_id, outcome.status.value) == ("after", "accepted")
        assert h.connector.core.mailbox.counters.events_dropped == 0


async def test_a_small_buffer_drops_oldest_batches_and_counts_them(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    with plugin(own_nats.url, subject_prefix, event_buffer_batches=3,
                create_events_stream=False) as h:
        transport = h.connector.transport
        await until(lambda: transport.connected)
        own_nats.stop()
        await until(lambda: not transport.connected)
        for i in range(10):
            turn(h, f"x{i}", [100 + 5 * i])
        counters = h.connector.core.mailbox.counters
        assert len(h.connector.core.mailbox.event_batches) == 3
        assert counters.event_batches_dropped == h.connector.core.event_seq - 3
        assert counters.events_dropped >= counters.event_batches_dropped


async def test_unreachable_nats_at_start_leaves_the_engine_running() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with plugin(url, "kvhinttest.unreachable") as h:
        turn(h, "s", [1, 2, 3])
        assert not h.connector.transport.connected
        assert h.connector.core.index.session_blocks("s")
    # shutdown returned (the connect loop is interruptible)


def test_without_nats_url_the_index_runs_and_nothing_is_queued() -> None:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}))
    turn(h, "s", [1, 2])
    assert h.connector.transport is None and h.connector.core.mailbox is None
    assert len(h.connector.core.index.session_blocks("s")) == 2


class _RouterCreatesFirst:
    """The plugin's JetStream context, except that its first lookup of the missing events
    stream lets the router create it (with other limits) before answering NotFound: the
    create race between a router and a plugin, on cue, against the real server."""

    def __init__(self, js: Any, router_create: Callable[[], Any]) -> None:
        self._js = js
        self._router_create: Callable[[], Any] | None = router_create

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def stream_info(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._js.stream_info(name, *args, **kwargs)
        except NotFoundError:
            create, self._router_create = self._router_create, None
            if create is not None:
                await create()
            raise


async def test_a_stream_the_router_creates_meanwhile_is_used_not_reported_failed(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger=LOGGER_NAME)
    subjects = Subjects(subject_prefix)
    config = PluginConfig(worker_id="w0", nats_url=nats_url, subject_prefix=subject_prefix,
                          events_stream_max_bytes=16 << 20)
    transport = NatsTransport(config, "w0", "e", Mailbox(8, 8, 8), status_of=None,
                              encode_events=None, block_size=BS)  # type: ignore[arg-type]
    async with events_stream_reader(nats_url, subjects) as (_nc, js):

        async def router_create() -> None:
            await js.add_stream(StreamConfig(
                name=subjects.events_stream, subjects=[subjects.all_of("events")],
                storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
                discard=DiscardPolicy.OLD, max_age=600, max_bytes=8 << 20))

        class _Nc:
            def jetstream(self) -> Any:
                return _RouterCreatesFirst(js, router_create)

        await transport._ensure_stream(_Nc())
        # The plugin's create got 10058; the router's stream stands and is used.
        assert (await js.stream_info(subjects.events_stream)).config.max_bytes == 8 << 20
        messages = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
        # Without the fix: "could not create stream ...: 10058" (a false alarm).
        assert not any("could not create" in m for m in messages), messages
        assert any("created meanwhile" in m for m in messages), messages
        assert transport.counters.stream_create_failures == 0


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


async def test_a_nats_url_with_credentials_reaches_no_log_line(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """README: NATS credentials go in ``nats_url``. Neither the engine's start-up line, the
    unreachable-server warning nor the connected line may show them (vLLM's log is
    often shipped off the worker)."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    refused = f"nats://w0:n4ts-pw@127.0.0.1:{free_port()}"
    with_password = nats_url.replace("nats://", "nats://w0:n4ts-pw@")
    with plugin(f"{refused},{with_password}", subject_prefix,
                create_events_stream=False) as h:
        for _ in range(200):
            if any("connected to NATS" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        del h
    logged = "\n".join(r.getMessage() for r in caplog.records)
    # The server connected to, as nats-py has it: without the user info, which the
    # transport passes to nats-py apart (schemas/nats_address.py).
    assert "connected to NATS nats://127.0.0.1" in logged
    assert "n4ts-pw" not in logged


async def test_a_failure_that_ends_the_transport_loop_is_counted_and_it_starts_again(
        nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception outside the publisher's rounds (here: the first connect) ended the
    transport thread: the engine ran without NATS for good, one log line, no counter.
    Now it is counted in internal_errors and the loop starts again, connecting first.
    The fault is injected (the connect raises once): the one known real cause, a URL
    nats-py refuses, is now refused at start-up by the config."""
    from kvhint.engine_plugin import transport as transport_module

    real_connect = transport_module.connect_until_stopped
    calls = []

    async def connect_failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise AssertionError("nats-py refused the URL")  # as nats-py's own assert did
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(transport_module, "connect_until_stopped", connect_failing_once)
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    try:
        status = await collect(nc, subjects.status("w0"))
        with plugin(nats_url, subject_prefix) as h:
            transport = h.connector.transport
            await until(lambda: transport.connected, timeout_s=10)
            beat = decode_status((await asyncio.wait_for(status.get(), 5)).data)
            assert beat.worker_id == "w0"
            assert transport.counters.internal_errors == 1 and len(calls) == 2
    finally:
        try:
            await nc.jetstream().delete_stream(subjects.events_stream)
        except NotFoundError:
            pass
        await nc.drain()


async def test_credentials_in_nats_url_itself_are_warned_about(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM logs --kv-transfer-config at start-up: a password written into nats_url is in
    its log. The plugin says so and names nats_url_env (the test server takes any user)."""
    with_user = nats_url.replace("nats://", "nats://someone:pw@", 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        with plugin(with_user, subject_prefix):
            pass
        warned = [r.getMessage() for r in caplog.records if "nats_url_env" in r.getMessage()]
        assert warned and "pw" not in warned[0]
        caplog.clear()
        with plugin(nats_url, subject_prefix):
            pass
        assert not [r for r in caplog.records if "nats_url_env" in r.getMessage()]
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().delete_stream(Subjects(subject_prefix).events_stream)
    except NotFoundError:
        pass
    finally:
        await nc.drain()
