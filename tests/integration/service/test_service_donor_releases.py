"""A donor advice's release never lands on a hint action of the same id, against a real
NATS server and the real router.

The plugin keys a donor advice's retain apart from hint actions' claims and reports its
release with ``action_type`` ``kv.donor`` under the advice's id (engine_plugin
hold_records.DonorClaim), which may be a hint action's id too. The router attributes a
release to a hint action only for a hint's type; a donor's is counted
(``foreign_hint_messages{kind="donor_release"}``), one of an unknown type dropped and
counted (``release_unknown_type``). The "plugin" is this test publishing wire messages
with the schemas (as in test_service_holdings.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import chat, plugin_registered, publish_accepted, publish_release, until
from kvhint.schemas import DONOR_ACTION_TYPE, ReleaseReason, Subjects, decode_hints

pytestmark = pytest.mark.usefixtures("throwaway_streams")


async def test_a_donor_release_of_a_hint_actions_id_leaves_the_hint_alone(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The planner's Retain is waiting for its outcome when a donor release of its id
    comes (it must not cap the coming outcome), then held when another comes (it must not
    shrink the holding, the session's protection or the stored row), and a release of a
    type the router does not know changes nothing either. A hint release of the id still
    applies."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    sent: list[tuple[str, str, str, str | None]] = []

    async def plugin(msg) -> None:  # noqa: ANN001 - a NATS message
        decoded = decode_hints(msg.data)
        sent.extend((decoded.message_id, a.action_id, a.action_type.value,
                     a.payload.target.session_id) for a in decoded.actions)

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    # No planner tick in the test's time (a new Retain would replace the holding).
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                               subject_prefix=subject_prefix, hints={"tick_s": 3600.0})
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            metrics = runtime.metrics
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            await until(lambda: len(sent) >= 1)
            message_id, action_id, action_type, session = sent.pop()
            assert action_type == "kv.retain" and action_id in runtime.hints.pending
            # A donor advice of the same id lost all 3 of its blocks before the Retain's
            # outcome came: the outcome is not capped by it.
            await publish_release(nc, subjects, action_id, DONOR_ACTION_TYPE, session, 3, 0,
                                  ReleaseReason.PRESSURE)
            await until(lambda: metrics.foreign_messages.labels("donor_release")
                        ._value.get() == 1)
            await publish_accepted(nc, subjects, message_id, action_id, action_type, 4)
            await until(lambda: action_id not in runtime.hints.pending)
            assert runtime.hints.holdings.worker("w0").retained_blocks == 4
            # Held now: another donor release of the id, and one of an unknown type.
            await publish_release(nc, subjects, action_id, DONOR_ACTION_TYPE, session, 2, 0,
                                  ReleaseReason.DISPLACED)
            await publish_release(nc, subjects, action_id, "kv.newer-claim", session, 4, 0,
                                  ReleaseReason.RESET)
            await until(lambda: metrics.drops.labels("release_unknown_type")
                        ._value.get() == 1)
            assert metrics.foreign_messages.labels("donor_release")._value.get() == 2
            assert metrics.foreign_messages.labels("release")._value.get() == 0
            assert runtime.hints.holdings.worker("w0").retained_blocks == 4
            assert runtime.hints.holdings.tenant("default").retained_blocks == 4
            detail = (await client.get(f"{router.url}/admin/sessions/default/agent")).json()
            assert detail["planner"]["protection"]["blocks"] == 4
            (recent,) = [h for h in (await client.get(f"{router.url}/admin/overview")).json()[
                "hints"] if h["action_id"] == action_id]
            assert (recent["applied_blocks"], recent["release_reason"],
                    recent["held_after_release_blocks"]) == (4, None, None)
            text = (await client.get(f"{router.url}/metrics")).text
            assert "kvhint_router_hold_released_blocks_total{" not in text
            # The Retain's own release of the same id still applies.
            await publish_release(nc, subjects, action_id, action_type, session, 3, 1,
                                  ReleaseReason.DISPLACED)
            await until(lambda: runtime.hints.holdings.worker("w0").retained_blocks == 1)
            detail = (await client.get(f"{router.url}/admin/sessions/default/agent")).json()
            assert detail["planner"]["protection"]["blocks"] == 1
            assert metrics.hold_releases.labels("kv.retain", "displaced")._value.get() == 3
    finally:
        await nc.drain()


async def test_a_donor_outcome_of_a_hint_actions_id_leaves_the_hint_alone(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A donor advice's answer (``kv.donor``) under a pending Retain's id: before, it
    settled the Retain with the advice's status and amounts (the ledger held the advice's
    9 resident blocks as the Retain's, and the Retain's own outcome then counted as a
    duplicate). Now it is counted apart and the Retain's own outcome settles it."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    sent: list[tuple[str, str, str]] = []

    async def plugin(msg) -> None:  # noqa: ANN001 - a NATS message
        decoded = decode_hints(msg.data)
        sent.extend((decoded.message_id, a.action_id, a.action_type.value)
                    for a in decoded.actions)

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                               subject_prefix=subject_prefix, hints={"tick_s": 3600.0})
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            metrics = runtime.metrics
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            await until(lambda: len(sent) >= 1)
            message_id, action_id, action_type = sent.pop()
            assert action_type == "kv.retain" and action_id in runtime.hints.pending
            # Both from one connection on one subject: they arrive in this order.
            await publish_accepted(nc, subjects, action_id, action_id, DONOR_ACTION_TYPE, 9)
            await publish_accepted(nc, subjects, message_id, action_id, action_type, 4)
            await until(lambda: action_id not in runtime.hints.pending)
            assert runtime.hints.holdings.worker("w0").retained_blocks == 4
            assert metrics.drops.labels("outcome_duplicate")._value.get() == 0
            assert metrics.foreign_messages.labels("donor_outcome")._value.get() == 1
            (recent,) = [h for h in (await client.get(f"{router.url}/admin/overview")).json()[
                "hints"] if h["action_id"] == action_id]
            assert recent["applied_blocks"] == 4
    finally:
        await nc.drain()
