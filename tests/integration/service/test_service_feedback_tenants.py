"""Outcome feedback between tenants, against a real NATS server and the real router:
tenant b's rejected planner hints turn a hint type off for b alone, unless the worker's
reason says it cannot do the action at all, which holds for every tenant.

The plugin here is this test answering w0's hints: a's accepted whole, b's rejected with
the reason the case gives (tests/integration/plugin checks the real plugin's reasons
classify as these do: test_plugin_tenant_reasons.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_registered, status, until
from kvhint.engine_plugin.inbound_checks import NO_PREFIX_CACHE_REASON
from kvhint.schemas import (
    Amount,
    HintOutcome,
    OutcomeStatus,
    Subjects,
    decode_hints,
    encode_outcome,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")

# What an action of b's own makes a worker answer (engine_plugin/executor.py): its
# target named less than one block of b's session.
B_OWN_REASON = "prefix_tokens 16 is less than one block (32 tokens)"


class TenantPlugin:
    """w0's plugin: every action of tenant a's sessions accepted whole, every action of
    b's rejected with ``b_reason``; what each tenant was sent, by type."""

    def __init__(self, nc, subjects: Subjects, b_reason: str) -> None:  # noqa: ANN001
        self.nc, self.subjects, self.b_reason = nc, subjects, b_reason
        self.sent: dict[str, list[str]] = {"a": [], "b": []}

    async def answer(self, msg) -> None:  # noqa: ANN001
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            tenant = (action.payload.target.session_id or "").partition("/")[0]
            kind = action.action_type.value
            self.sent.setdefault(tenant, []).append(kind)
            rejected = tenant == "b"
            await self.nc.publish(self.subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=kind, worker_id="w0",
                status=OutcomeStatus.REJECTED if rejected else OutcomeStatus.ACCEPTED,
                reason=self.b_reason if rejected else "", requested=Amount(4, 128),
                applied=Amount(0, 0) if rejected else Amount(4, 128), at=time.time())))


@asynccontextmanager
async def _router(tmp_path: Path, nats_url: str, subject_prefix: str,
                  stub_workers: list[StubWorker], b_reason: str
                  ) -> AsyncIterator[tuple[Any, httpx.AsyncClient, TenantPlugin]]:
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    plugin = TenantPlugin(nc, subjects, b_reason)
    await nc.subscribe(subjects.hints("w0"), cb=plugin.answer)
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, admin_keys=["root"],
        tenants=[{"name": "a", "api_keys": ["ka"]}, {"name": "b", "api_keys": ["kb"]}])
    beating: asyncio.Task[None] | None = None
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            await plugin_registered(router.runtime, nc, subjects)
            beating = asyncio.create_task(_heartbeats(nc, subjects))
            yield router, client, plugin
    finally:
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        await nc.drain()


async def _turn(router: Any, client: httpx.AsyncClient, key: str, session: str,
                hinted: bool = True) -> None:
    """One turn of ``session``, and its planner hint's outcome taken (``hinted``), else
    time for one to reach the plugin (proving none is sent takes a wait)."""
    tenant = key[1:]
    done = sum(router.runtime.hints.status_counts_of(tenant).values())
    response = await client.post(f"{router.url}/v1/chat/completions", headers={
        "authorization": f"Bearer {key}"}, json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert response.status_code == 200, response.text
    if hinted:
        await until(lambda: sum(router.runtime.hints.status_counts_of(tenant).values()) > done)
        return
    await until(lambda: router.runtime.sessions.get(tenant, session).turns == 1)
    await asyncio.sleep(0.5)


async def _b_disables_a_type(router: Any, client: httpx.AsyncClient) -> frozenset[str]:
    """b's turns until its rejections turn a type off for b on w0; that type."""
    hints = router.runtime.hints
    for n in range(6):
        await _turn(router, client, "kb", f"b-{n}")
        if "w0" in hints.feedback and hints.feedback["w0"].view("b").disabled_actions:
            return hints.feedback["w0"].view("b").disabled_actions
    raise AssertionError("b's rejections turned nothing off")


async def test_one_tenants_rejections_never_turn_another_tenants_hints_off(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """b's planner hints (Retains here) are rejected for what their targets named in
    b's own sessions: after two in a row the planner stops sending that type to w0 for
    b. a's next turn still gets it there. Before, feedback was the worker's: b's
    rejections turned the type off on w0 for a too, until the engine restarted."""
    async with _router(tmp_path, nats_url, subject_prefix, stub_workers,
                       B_OWN_REASON) as (router, client, plugin):
        await _turn(router, client, "ka", "a-1")
        off = await _b_disables_a_type(router, client)
        feedback = router.runtime.hints.feedback["w0"]
        assert feedback.view("a").disabled_actions == frozenset()
        assert feedback.view(None).disabled_actions == frozenset()  # not the worker's
        first = len(plugin.sent["a"])
        await _turn(router, client, "ka", "a-2")
        assert set(plugin.sent["a"][first:]) & off, (off, plugin.sent)


async def test_a_worker_that_cannot_do_an_action_has_it_off_for_every_tenant(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The same, but w0 answers b "prefix caching is off": that says what the worker
    cannot do, for anyone. The type goes off for a too (the capability signal is kept),
    and a's next turn sends no action of it there."""
    async with _router(tmp_path, nats_url, subject_prefix, stub_workers,
                       NO_PREFIX_CACHE_REASON) as (router, client, plugin):
        off = await _b_disables_a_type(router, client)
        assert router.runtime.hints.feedback["w0"].view("a").disabled_actions == off
        await _turn(router, client, "ka", "a-1", hinted=False)
        assert not set(plugin.sent["a"]) & off, (off, plugin.sent)


async def _heartbeats(nc, subjects: Subjects) -> None:  # noqa: ANN001
    """w0's plugin stays alive (heard every 0.3 s) however long the test takes."""
    while True:
        await asyncio.sleep(0.3)
        await nc.publish(subjects.status("w0"), status("w0", "e1", 0))
