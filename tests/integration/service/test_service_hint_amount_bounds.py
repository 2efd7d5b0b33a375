"""Hint amounts past what the store and the workers can hold: a worker's outcome echoing
a huge ``requested`` (an older plugin resolved an unbounded ``prefix_tokens``) is held to
the store's 32-bit columns, counted, and its row written; an agent's ``prefix_tokens``
past the worker's GPU cache is refused at the sessions API, nothing sent."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import nats
import pytest
import sqlalchemy as sa

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_registered, until
from kvhint.router.service.hint_records import MAX_STORED_AMOUNT
from kvhint.router.store.models import HintActionRow
from kvhint.schemas import (
    Amount,
    HintOutcome,
    OutcomeStatus,
    Subjects,
    decode_hints,
    encode_outcome,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")

HUGE_BLOCKS, HUGE_TOKENS = 6 * 10**28, 10**30


async def _chat(client: httpx.AsyncClient, url: str, session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert response.status_code == 200, response.text


async def test_an_outcome_past_the_stores_columns_is_held_to_them_and_its_row_written(
        tmp_path: Path, database_url: str, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The plugin (played here, as an older one answered a prefix_tokens of 10**30)
    echoes requested 6e28 blocks: before, the row insert failed on the 32-bit column
    (store_row_rejected) and the action's history was lost; now the amounts are held to
    2**31-1, counted as outcome_amount_clamped, and the row is written."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)

    async def answer(msg) -> None:  # noqa: ANN001
        decoded = decode_hints(msg.data)
        for action in decoded.actions:  # the planner's own actions answered as usual
            huge = action.action_id.endswith(":r1")
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id="w0",
                status=OutcomeStatus.CLIPPED, reason="clipped",
                requested=Amount(HUGE_BLOCKS, HUGE_TOKENS) if huge else Amount(2, 64),
                applied=Amount(2, 64), at=time.time())))

    await nc.subscribe(subjects.hints("w0"), cb=answer)
    config = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                             subject_prefix=subject_prefix, database_url=database_url)
    try:
        async with running_router(config) as router, httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            await _chat(client, router.url, "s")
            response = await client.post(f"{router.url}/v1/sessions/s/hints", json={
                "actions": [{"action_type": "kv.retain", "action_id": "r1",
                             "payload": {"priority": 50}}]})
            assert response.status_code == 200, response.text
            (action,) = response.json()["actions"]
            assert action["status"] == "clipped"
            assert action["requested_blocks"] == MAX_STORED_AMOUNT
            assert action["requested_tokens"] == MAX_STORED_AMOUNT
            metrics = runtime.metrics
            await until(lambda: metrics.drops.labels(
                "outcome_amount_clamped")._value.get() >= 1, 3)
            assert metrics.drops.labels("outcome_amount_clamped")._value.get() == 1
            await runtime.writer.flush()
            assert metrics.drops.labels("store_row_rejected")._value.get() == 0
            with sa.create_engine(database_url).connect() as conn:
                row = conn.execute(sa.select(HintActionRow.status,
                                             HintActionRow.requested_blocks).where(
                    HintActionRow.action_id == action["action_id"])).one()
            assert tuple(row) == ("clipped", MAX_STORED_AMOUNT)
    finally:
        await nc.drain()


async def test_an_agents_prefix_tokens_past_the_workers_cache_is_refused(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """w0's heartbeat says 512 blocks of 32 tokens: a target of more prefix tokens is
    refused (422, nothing sent), as the plugin refuses it; up to the cache is sent."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    received: list[str] = []

    async def answer(msg) -> None:  # noqa: ANN001
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            if action.action_id.startswith("kva-"):  # the API's, not the planner's
                received.append(action.action_id)
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id="w0",
                status=OutcomeStatus.ACCEPTED, requested=Amount(2, 64),
                applied=Amount(2, 64), at=time.time())))

    await nc.subscribe(subjects.hints("w0"), cb=answer)
    config = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                             subject_prefix=subject_prefix)
    try:
        async with running_router(config) as router, httpx.AsyncClient(timeout=30) as client:
            await plugin_registered(router.runtime, nc, subjects)
            await _chat(client, router.url, "s")
            url = f"{router.url}/v1/sessions/s/hints"
            for tokens in (10**30, 512 * 32 + 1):
                refused = await client.post(url, json={"actions": [{
                    "action_type": "kv.retain",
                    "payload": {"target": {"prefix_tokens": tokens}}}]})
                assert refused.status_code == 422, refused.text
                assert f"prefix_tokens={tokens} is more than the 16384 tokens" \
                    in refused.text
            fits = await client.post(url, json={"actions": [{
                "action_type": "kv.retain", "action_id": "r-fits",
                "payload": {"target": {"prefix_tokens": 512 * 32}}}]})
            assert fits.status_code == 200, fits.text
            await until(lambda: len(received) == 1, 3)
            assert received[0].endswith("r-fits")
    finally:
        await nc.drain()
