"""Donor advice arriving over NATS while the engine's inbox is full, with a real NATS server
and vLLM's real scheduler (the test steps the headless scheduler where the engine would).

Before: the transport only counted such an advice (``inbound_dropped``) and never answered
it, against "one terminal outcome per action"; and the transport's memory of answers keyed
an advice's answer and a hint action's by the bare id, so an advice sharing a hint's id
replaced that hint's answer, and the hint's repeat got the advice's ``kv.donor`` outcome.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.metrics import HINTS_KEY
from kvhint.schemas import DonorAdvice, HintOutcome, Subjects, decode_outcome, encode_advice
from scheduler_fixtures import collect, nats_client, pin_message
from scheduler_fixtures import nats_plugin as plugin
from scheduler_fixtures import turn, until


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


def _advice(advice_id: str, core: PluginCore, session: str = "s") -> bytes:
    return encode_advice(DonorAdvice(
        advice_id=advice_id, session_id="t", namespace=core.cache_namespace,
        donor_block_hashes=core.index.session_blocks(session), similarity=0.9,
        at=time.time()))


async def _next(outcomes: asyncio.Queue) -> HintOutcome:
    return decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)


async def test_advice_that_finds_the_inbox_full_is_answered_rejected_and_counted(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            core = h.connector.core
            await until(lambda: h.connector.transport.set_up)
            turn(h, "s", [1, 2])
            await nc.publish(subjects.hints("w0"), pin_message("p"))  # fills the inbox
            await until(lambda: bool(core.mailbox.inbound))
            await nc.publish(subjects.advice("w0"), _advice("d1", core))
            full = await _next(outcomes)
            assert (full.action_id, full.action_type, full.status.value) == (
                "d1", "kv.donor", "rejected")
            assert "inbox full" in full.reason
            assert core.mailbox.counters.inbound_dropped == 1
            h.step()
            assert (await _next(outcomes)).action_id == "p"
            # Transient: its retry is applied.
            await nc.publish(subjects.advice("w0"), _advice("d1", core))
            await until(lambda: bool(core.mailbox.inbound))
            h.step()
            retry = await _next(outcomes)
            assert (retry.action_id, retry.status.value) == ("d1", "accepted"), retry.reason
            hints = h.connector._read_stats()[HINTS_KEY]
            assert hints["kv.donor|rejected"] == 1 and hints["kv.donor|accepted"] == 1


async def test_advice_and_hint_sharing_an_id_keep_their_own_answers_for_repeats(
        nats_url: str, subject_prefix: str) -> None:
    """The executor keeps an advice and a hint action of one id apart; so must the
    transport's memory: a repeat finding the inbox full gets its own first answer."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, inbound_buffer=1, pin_budget_fraction=0.2,
                    create_events_stream=False) as h:
            core, transport = h.connector.core, h.connector.transport
            await until(lambda: transport.set_up)
            turn(h, "s", [1, 2, 3])
            await nc.publish(subjects.hints("w0"), pin_message("x"))
            await until(lambda: bool(core.mailbox.inbound))
            h.step()
            pin = await _next(outcomes)
            assert (pin.action_id, pin.action_type, pin.status.value) == (
                "x", "kv.pin", "accepted")
            await nc.publish(subjects.advice("w0"), _advice("x", core))
            await until(lambda: bool(core.mailbox.inbound))
            h.step()
            donor = await _next(outcomes)
            assert (donor.action_id, donor.action_type) == ("x", "kv.donor")
            # The engine is busy: one message fills the inbox; repeats of both come.
            await nc.publish(subjects.hints("w0"), pin_message("q"))
            await until(lambda: bool(core.mailbox.inbound))
            await nc.publish(subjects.hints("w0"), pin_message("x"))
            again = await _next(outcomes)
            assert again == pin  # before: the advice's kv.donor outcome
            await nc.publish(subjects.advice("w0"), _advice("x", core))
            assert await _next(outcomes) == donor
            assert transport.counters.repeats_answered_again == 2
