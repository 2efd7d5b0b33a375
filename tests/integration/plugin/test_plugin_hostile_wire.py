"""Hostile messages over a real NATS server to the plugin on vLLM's real scheduler (the
test steps the headless scheduler where the engine would): what they cost the plugin's
answers to everyone else.

- A hints message's action naming ``kv.donor`` (the advice's outcome type) is rejected
  and echoes that type. Before, the transport's memory of answers took the outcome for
  an advice's: the action id stayed in flight for good (a repeat finding the inbox full
  got no answer at all) and an advice of that id finding the inbox full was answered
  with the hint action's rejection.
- An outcome larger than NATS ``max_payload`` (a ~530 KB message whose action_type the
  outcome echoes twice; an advice_id echoed as message and action id). Before, it went
  back to the head of the outcome queue for good: no outcome, release report, KV event
  batch or snapshot page of that worker was published again.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.metrics import HINTS_KEY
from kvhint.engine_plugin.transport_oversize import CUT_NOTE, REASON_KEPT_CHARS
from kvhint.schemas import (
    ActionType,
    DecodedHints,
    DonorAdvice,
    HintOutcome,
    OutcomeStatus,
    ParsedAction,
    PinPayload,
    Target,
    Subjects,
    decode_outcome,
    decode_releases,
    encode_advice,
)
from scheduler_fixtures import collect, nats_client, pin_message
from scheduler_fixtures import nats_plugin as plugin
from scheduler_fixtures import turn, until


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


def _advice(advice_id: str, core: PluginCore) -> bytes:
    return encode_advice(DonorAdvice(
        advice_id=advice_id, session_id="t", namespace=core.cache_namespace,
        donor_block_hashes=core.index.session_blocks("s"), similarity=0.9, at=time.time()))


def _hints(action_id: str, action_type: str, message_id: str = "m") -> bytes:
    return json.dumps({"protocol_version": "1", "message_id": message_id, "actions": [
        {"action_id": action_id, "action_type": action_type, "action_version": "1.0",
         "payload": {"target": {"session_id": "s"}}}]}).encode()


async def _next(outcomes: asyncio.Queue) -> HintOutcome:
    """The next terminal outcome (an early ``deferred`` on a slow machine is skipped)."""
    while True:
        outcome = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
        if outcome.status.is_terminal:
            return outcome


async def test_a_hint_action_typed_kv_donor_is_remembered_as_a_hint_not_an_advice(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            core, transport = h.connector.core, h.connector.transport
            mailbox = core.mailbox
            await until(lambda: transport.set_up)
            turn(h, "s", [1, 2, 3])
            await nc.publish(subjects.hints("w0"), _hints("x", "kv.donor"))
            await until(lambda: bool(mailbox.inbound))
            h.step()
            first = await _next(outcomes)
            assert (first.action_id, first.action_type, first.status.value) == (
                "x", "kv.donor", "rejected")
            assert "unsupported action_type" in first.reason
            assert not mailbox.in_flight  # before: "x" stayed in flight for good
            # The engine is busy: one message fills the inbox; repeats come.
            await nc.publish(subjects.hints("w0"), pin_message("q"))
            await until(lambda: bool(mailbox.inbound))
            await nc.publish(subjects.hints("w0"), _hints("x", "kv.donor"))
            assert await _next(outcomes) == first  # before: no answer at all
            await nc.publish(subjects.advice("w0"), _advice("x", core))
            full = await _next(outcomes)  # before: the hint action's rejection again
            assert (full.action_id, full.action_type, full.status.value) == (
                "x", "kv.donor", "rejected")
            assert "inbox full" in full.reason
            assert transport.counters.repeats_answered_again == 1
            assert transport.counters.repeats_in_flight == 0
            h.step()
            assert (await _next(outcomes)).action_id == "q"
            # The advice's retry is applied: it is no hint's repeat.
            await nc.publish(subjects.advice("w0"), _advice("x", core))
            await until(lambda: bool(mailbox.inbound))
            h.step()
            donor = await _next(outcomes)
            assert (donor.action_id, donor.status.value) == ("x", "accepted"), donor.reason
            assert not mailbox.in_flight
            assert core.counters.internal_errors == 0


async def test_a_long_action_type_or_advice_id_is_rejected_unechoed_and_not_remembered(
        nats_url: str, subject_prefix: str) -> None:
    """A 530 KB action_type and a 600 KB advice_id (schemas._codec.MAX_ID_CHARS). Before,
    each answer echoed them (the advice's twice: 1.2 MB, past max_payload, dropped) and
    ``Mailbox.answered`` kept the hint's at full length: ~100k such answers held ~100 GB."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            core, transport = h.connector.core, h.connector.transport
            await until(lambda: transport.set_up)
            turn(h, "s", [1, 2, 3])
            huge_type = _hints("big", "T" * 530_000)
            huge_id = _advice("A" * 600_000, core)
            assert max(len(huge_type), len(huge_id)) < nc.max_payload
            await nc.publish(subjects.hints("w0"), huge_type)
            await nc.publish(subjects.advice("w0"), huge_id)
            await nc.publish(subjects.hints("w0"), pin_message("after"))
            # The advice is answered by the transport on decoding (nothing to apply).
            await until(lambda: len(core.mailbox.inbound) == 2)
            while core.mailbox.inbound:
                h.step()
            got = {}
            for _ in range(3):
                outcome = await _next(outcomes)
                got[outcome.action_id] = outcome
            typed, advised, after = got["big"], got[""], got["after"]
            assert (typed.action_type, typed.status.value) == ("", "rejected")
            assert typed.reason.startswith("action_type is longer than 256 characters")
            assert (advised.action_type, advised.status.value) == ("kv.donor", "rejected")
            assert "advice_id is longer than 256 characters" in advised.reason
            assert max(len(typed.reason), len(advised.reason)) < 500
            assert after.status.value == "accepted", after.reason
            remembered = core.mailbox.answered
            assert set(remembered) == {"big", "after"}  # an empty id is remembered by none
            assert max(len(o.action_type) + len(o.reason) for o in remembered.values()) < 500
            assert transport.counters.oversize_dropped == 0
            hints = h.connector._read_stats()[HINTS_KEY]
            assert hints["kv.donor|rejected"] == 1  # each answer counted
            assert sum(n for key, n in hints.items() if key.endswith("|rejected")) == 2


async def test_an_outcome_past_max_payload_is_cut_or_dropped_and_the_rest_go_out(
        nats_url: str, subject_prefix: str) -> None:
    """The wire can no longer make such outcomes (ids, types and quoted text are bounded:
    the test above), so they are queued as the engine queues its own: the transport's
    guard for a path not foreseen. Before the guard, an oversize one went back to the head
    of the outcome queue for good: nothing of that worker was published again."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            core, transport = h.connector.core, h.connector.transport
            await until(lambda: transport.set_up)
            big = HintOutcome(message_id="m", action_id="big", action_type="kv.pin",
                              worker_id="w0", status=OutcomeStatus.REJECTED,
                              reason="R" * 1_100_000, at=time.time())
            ids = HintOutcome(message_id="A" * 600_000, action_id="A" * 600_000,
                              action_type="kv.donor", worker_id="w0",
                              status=OutcomeStatus.REJECTED, reason="r", at=time.time())
            core.mailbox.put_outcomes([big, ids], remember=False)
            turn(h, "s", [1, 2, 3])
            await nc.publish(subjects.hints("w0"), pin_message("after"))
            await until(lambda: len(core.mailbox.inbound) == 1)
            h.step()
            cut = await _next(outcomes)
            assert (cut.action_id, cut.status.value) == ("big", "rejected")
            assert cut.reason.endswith(CUT_NOTE)
            assert len(cut.reason) == REASON_KEPT_CHARS + len(CUT_NOTE)
            # The second names its id twice (1.2 MB): it cannot go out.
            after = await _next(outcomes)  # before: neither, nor anything later
            assert (after.action_id, after.status.value) == ("after", "accepted"), after.reason
            assert transport.counters.oversize_dropped == 1
            assert h.connector._read_stats()["publish_errors"]["oversize"] == 1
            assert not core.mailbox.outcomes


async def test_a_release_report_past_max_payload_goes_out_in_parts(
        nats_url: str, subject_prefix: str) -> None:
    """Accepted Pins whose ids are 40 KB each, all given back at once by a prefix-cache
    reset: one report of 1.2 MB. It goes out in halves (before: it blocked the release
    queue, and the KV event batches and snapshot pages behind it, for good)."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        releases = await collect(nc, subjects.releases("w0"))
        with plugin(nats_url, subject_prefix, pin_budget_fraction=0.8,
                    create_events_stream=False) as h:
            core, transport = h.connector.core, h.connector.transport
            await until(lambda: transport.set_up)
            turn(h, "s", list(range(1, 31)))
            hashes = core.index.session_blocks("s")
            assert len(hashes) == 30
            ids = [f"{i:02d}" + "p" * 40_000 for i in range(30)]
            for action_id, block_hash in zip(ids, hashes):
                # In-process (the wire bounds ids: schemas._codec.MAX_ID_CHARS); the
                # transport's guard is for a path not foreseen.
                (pin,) = core.apply_hints(DecodedHints("m", [ParsedAction(
                    action_id, ActionType.PIN,
                    PinPayload(target=Target(block_hashes=[block_hash])))]))
                assert pin.status.value == "accepted", pin.reason
            assert h.kv_cache_manager.reset_prefix_cache()
            got: list[str] = []
            while len(got) < 30:
                report = decode_releases((await asyncio.wait_for(releases.get(), 5)).data)
                got += [r.action_id for r in report.releases]
            assert sorted(got) == ids
            assert transport.counters.oversize_dropped == 0
            assert transport.counters.releases_published == 2
