"""Hints arriving over NATS at a plugin whose engine does not take them at once, with a
real NATS server and vLLM's real scheduler: a hint answered ``deferred`` while the engine
is busy, donor advice decoded off the scheduler thread, and a full inbox answering
``rejected`` (repeats get their first answer). The test steps the headless scheduler itself
where the engine would.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from kvhint.engine_plugin import core as core_module
from kvhint.engine_plugin.metrics import HINTS_KEY
from kvhint.schemas import DonorAdvice, Subjects, decode_outcome, encode_advice
from scheduler_fixtures import collect, nats_client, pin_message
from scheduler_fixtures import nats_plugin as plugin
from scheduler_fixtures import step_until, turn, until


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


async def test_a_hint_the_engine_cannot_take_soon_is_deferred_at_once(
        nats_url: str, subject_prefix: str) -> None:
    """The engine is in a long step (here: not stepped at all): after defer_after_s the
    plugin answers ``deferred``, then the final outcome once the step comes."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        # 0.5 s: long enough that the "fast" message below, stepped every 10 ms, is taken
        # in time on a loaded 2-core machine (at 0.05 s a clean-clone CI run saw it
        # deferred), short enough that "slow" shows the deferral well under 2 s.
        with plugin(nats_url, subject_prefix, defer_after_s=0.5, pin_budget_fraction=0.2,
                    create_events_stream=False) as h:
            # Subscribed: connected comes before the set-up, and a hint sent then is lost.
            await until(lambda: h.connector.transport.set_up)
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
            await until(lambda: h.connector.transport.set_up)
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
            await until(lambda: h.connector.transport.set_up)
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
            await until(lambda: h.connector.transport.set_up)
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
            await until(lambda: transport.set_up)
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
