"""The load a Responses follow-up books on a replica that did not relay the response it
follows (another replica did, sharing the store): that replica's id map has no usage of
the response (responses_api.py ``follow_up_of``), so the session's record, continued
from the store, gives the conversation's size: its last turn's prompt, as the worker's
usage counted it (routing_service.py ``conversation_of_session``), booked on the worker
as load only. Before, the body alone was booked there (2 tokens of a 3,000-token
conversation). Real router apps, one store, a stand-in worker."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from conftest import router_settings, running_router, sample, scrape
from feed_helpers import until
from test_service_responses_api import create
from test_service_responses_load import PROMPT, SizedStub

from kvhint.router.policy.routed_load import prompt_blocks

INPUT = "and then?"


@dataclass
class HeldStub(SizedStub):
    """A SizedStub that holds each follow-up's answer until ``release`` is set, so the
    load booked for it can be read while it is in flight."""

    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        if body.get("previous_response_id") is not None:
            await self.release.wait()
        return await super()._create(request)


@pytest.mark.parametrize("names_session", [True, False], ids=["named", "unnamed"])
async def test_a_follow_up_relayed_by_another_replica_books_its_sessions_size(
        tmp_path: Path, tiny_model_dir: Path, database_url: str,
        names_session: bool) -> None:
    """A relays a response (3,000 prompt tokens) in session "agent"; B relays its
    follow-up, naming the session or not (then read from the store). B's id map holds
    no usage of A's response; the session's record, continued from the store, names the
    same worker: while the follow-up is in flight on B, the worker's KV blocks booked
    are the conversation's (3,000 tokens) plus the new input's, and its prefill the new
    input plus the prompt's last partial block (the whole blocks are likely still
    cached there). Load only: nothing is predicted, nothing learnt."""
    stub = HeldStub(str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)], database_url=database_url,
                                   salt_secret="replicas-share-this-secret",
                                   store_flush_interval_s=3600.0)
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(running_router(settings))
            b = await stack.enter_async_context(running_router(settings))
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
            made = await client.post(f"{a.url}/v1/responses",
                                     json=create(session_id="agent"))
            assert made.status_code == 200, made.text
            await a.runtime.writer.flush()
            routing = b.runtime.routing
            routing.clock = lambda: 1000.0  # held still: the recent load does not decay
            samples = await scrape(client, b.url)
            predicted_before = sample(samples, "kvhint_router_cached_tokens_actual_total",
                                      worker="w0", predicted="true") or 0
            follow_up: dict[str, Any] = {"model": "stub", "input": INPUT,
                                         "previous_response_id": made.json()["id"]}
            if names_session:
                follow_up["session_id"] = "agent"
            sent = asyncio.ensure_future(client.post(f"{b.url}/v1/responses",
                                                     json=follow_up))
            await until(lambda: routing._loads.get("w0") is not None
                        and routing._loads.get("w0").active_blocks > 0)
            block = routing.default_block_size
            load = routing._loads.get("w0")
            assert load is not None
            new_input = len(INPUT) // 4
            assert load.active_blocks == prompt_blocks(PROMPT + new_input, block)
            assert load.pending_prefill == new_input + PROMPT % block
            stub.release.set()
            answer = await sent
            assert answer.status_code == 200, answer.text
            assert stub.received[-1]["session_id"] == "default/agent"
            assert load.recent.prefill_tokens == pytest.approx(new_input + PROMPT % block)
            assert (load.pending_prefill, load.active_blocks) == (0, 0)
            record = b.runtime.sessions.get("default", "agent")
            assert record is not None and record.turns == 2
            assert record.predicted_cached_tokens == 0
            samples = await scrape(client, b.url)
            assert (sample(samples, "kvhint_router_cached_tokens_actual_total",
                           worker="w0", predicted="true") or 0) == predicted_before
    finally:
        stub.release.set()  # a failed assertion leaves no follow-up held at the stop
        await stub.stop()


async def test_a_follow_up_of_a_response_made_in_no_session_books_its_body_alone(
        tmp_path: Path, tiny_model_dir: Path, database_url: str) -> None:
    """A relays a turn of session "agent" (its record on w0, 3,000 prompt tokens) and a
    response made in no session. B's follow-up of the latter names "agent": that
    session's record is not the response's conversation, so B books the body alone."""
    stub = HeldStub(str(tiny_model_dir))
    stub.release.set()
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)], database_url=database_url,
                                   salt_secret="replicas-share-this-secret",
                                   store_flush_interval_s=3600.0)
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(running_router(settings))
            b = await stack.enter_async_context(running_router(settings))
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
            for extra in ({"session_id": "agent"}, {}):
                made = await client.post(f"{a.url}/v1/responses", json=create(**extra))
                assert made.status_code == 200, made.text
            await a.runtime.writer.flush()
            routing = b.runtime.routing
            routing.clock = lambda: 1000.0
            answer = await client.post(f"{b.url}/v1/responses", json={
                "model": "stub", "input": INPUT, "session_id": "agent",
                "previous_response_id": made.json()["id"]})
            assert answer.status_code == 200, answer.text
            record = b.runtime.sessions.get("default", "agent")
            assert record is not None and record.turns == 2  # the stored session's
            load = routing._loads.get("w0")
            assert load is not None
            assert load.recent.prefill_tokens == pytest.approx(len(INPUT) // 4)
    finally:
        await stub.stop()
