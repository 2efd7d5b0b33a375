"""A hint action is recorded before its envelope is published (router/service/hint_send.py),
against a real NATS server, the real router app and its store: what comes while a
publish awaits (another hints call's budget check, the same action id again, a session's
end, the action's own outcome, the router stopping) finds it recorded, and a publish NATS
refuses puts the records back as they were.

A publish awaits only when the NATS client waits on its flush (a full outbound buffer),
which no test can bring about on cue: :class:`PublishGate` holds one publish of the
router's link on an event instead. It holds it after the real publish (the message is on
its way, as when nats-py waits on its flush), or before it (a client that waits before it
queues). Everything else is real: the router, NATS, the store, and w0's "plugin", this
test answering w0's hints as a plugin does (feed_helpers.AcceptingPlugin: every claim
accepted with 2 blocks, a release, priority 0, holding none) and sending its heartbeats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from conftest import StubWorker, router_settings, running_router, sample, scrape
from feed_helpers import router_with_accepting_plugin, until
from kvhint.router.service.nats_link import NatsLink
from kvhint.schemas import KvHintsEnvelope, decode_hints

pytestmark = pytest.mark.usefixtures("throwaway_streams")

RETAIN = {"actions": [{"action_type": "kv.retain", "payload": {"priority": 100}}],
          "wait_s": 0}


def pin(*hashes: int, action_id: str | None = None) -> dict[str, Any]:
    """A Pin of these blocks (named: the router counts exactly them)."""
    action: dict[str, Any] = {"action_type": "kv.pin",
                              "payload": {"target": {"block_hashes": list(hashes)}}}
    if action_id is not None:
        action["action_id"] = action_id
    return {"actions": [action], "wait_s": 5}


class PublishGate:
    """Holds the router's publish of the first envelope that ``matches`` until
    :meth:`open` (the fake: a publish that awaits cannot be caused on cue otherwise).
    ``after``: held once the real publish has queued the message, else before it."""

    def __init__(self, link: NatsLink, matches: Callable[[KvHintsEnvelope], bool],
                 after: bool) -> None:
        self._link, self._publish = link, link.publish
        self._matches, self._after = matches, after
        self.reached, self._go = asyncio.Event(), asyncio.Event()
        self.envelope: KvHintsEnvelope | None = None

    async def _held(self, subject: str, data: bytes) -> bool:
        envelope = decode_hints(data)
        if self.envelope is not None or not self._matches(envelope):
            return await self._publish(subject, data)
        self.envelope = envelope
        if self._after:
            ok = await self._publish(subject, data)
            self.reached.set()
            await self._go.wait()
            return ok
        self.reached.set()
        await self._go.wait()
        return await self._publish(subject, data)

    def install(self) -> None:
        self._link.publish = self._held  # type: ignore[method-assign]

    def open(self) -> None:
        self._go.set()

    @property
    def action_id(self) -> str:
        assert self.envelope is not None
        return self.envelope.actions[0].action_id


@asynccontextmanager
async def gate(link: NatsLink, matches: Callable[[KvHintsEnvelope], bool],
               after: bool = True) -> AsyncIterator[PublishGate]:
    """A :class:`PublishGate` on ``link``, opened and taken off at the end whatever
    happens (a router cannot stop while a request waits on it)."""
    held = PublishGate(link, matches, after)
    held.install()
    try:
        yield held
    finally:
        held.open()
        del link.publish  # the class's own again


def priority(envelope: KvHintsEnvelope) -> int | None:
    return getattr(envelope.actions[0].payload, "priority", None)


async def _turn(client: httpx.AsyncClient, url: str, session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert response.status_code == 200, response.text


async def test_two_hints_calls_of_a_tenant_cannot_both_take_room_for_one(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The tenant's pin budget has room for one 2-block Pin. A second call that comes
    while the first call's Pin is being published finds it counted: 429. Before, the
    first was recorded only once its publish returned, the second passed the same budget,
    and the tenant held twice its cap. The same action id sent again meanwhile is the
    pending action (409); before, it went out a second time."""
    cap = [{"name": "default", "budget": {"max_pinned_blocks": 2}}]
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                            stub_workers[0], tenants=cap
                                            ) as (router, client, _plugin):
        url, holdings = router.url, router.runtime.hints.holdings
        for session in ("s1", "s2", "s3"):
            await _turn(client, url, session)
        mine = "kva-default:mine"
        # Held before it is queued: the worker must not answer it meanwhile.
        async with gate(router.runtime.hints._link,
                        lambda e: e.actions[0].action_id == mine, after=False) as held:
            first = asyncio.create_task(client.post(f"{url}/v1/sessions/s1/hints",
                                                    json=pin(1, 2, action_id="mine")))
            await asyncio.wait_for(held.reached.wait(), 10)
            second = await client.post(f"{url}/v1/sessions/s2/hints", json=pin(3, 4))
            again = await client.post(f"{url}/v1/sessions/s3/hints",
                                      json={"actions": [{"action_type": "kv.retain",
                                                         "action_id": "mine"}]})
            held.open()
            assert (await first).status_code == 200
        assert second.status_code == 429, second.text
        assert "would hold 4 pinned blocks (limit 2)" in second.json()["error"]["message"]
        assert again.status_code == 409, again.text
        assert holdings.tenant("default").pinned_blocks == 2


async def test_a_planner_protection_published_during_an_end_is_not_held_after_it(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A turn ending in tool calls has the planner protect the session; a DELETE lands
    while that Pin/Retain is being published. The end supersedes it (the worker gets the
    protection, then the end's action), and once both are answered nothing of the session
    is held. Before, the end found no protection to supersede, the protection was
    recorded after it, and the router counted its blocks (against the tenant's and the
    worker's budgets) until its TTL, though the worker had let it go."""
    stub = stub_workers[0]
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix, stub,
                                            hints={"tick_s": 3600.0}
                                            ) as (router, client, plugin):
        url, runtime = router.url, router.runtime
        holdings, scope = runtime.hints.holdings, "default/gap"
        await _turn(client, url, "gap")
        stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
        protects = {"kv.pin", "kv.retain"}
        async with gate(runtime.hints._link,
                        lambda e: e.actions[0].action_type.value in protects
                        and (priority(e) or 2) > 1) as held:
            turn = asyncio.create_task(_turn(client, url, "gap"))
            await asyncio.wait_for(held.reached.wait(), 10)
            ending = asyncio.create_task(client.delete(f"{url}/v1/sessions/gap"))
            await until(lambda: runtime.sessions.get("default", "gap").state == "ended")
            held.open()
            await turn
            ended = await ending
        assert ended.status_code == 200, ended.text
        (end_action,) = ended.json()["hints"]
        protection = held.action_id
        await until(lambda: end_action["action_id"] in plugin.action_ids)
        assert plugin.action_ids.index(protection) < plugin.action_ids.index(
            end_action["action_id"])
        await until(lambda: any(r.action_id == end_action["action_id"]
                                for r in runtime.hints.recent))  # the end's answered
        assert protection not in holdings
        assert holdings.worker("w0").pinned_blocks == 0
        if end_action["payload"].get("priority") == 0:  # a release: holds nothing
            assert not holdings.workers_holding(scope)


async def test_an_outcome_that_comes_before_the_publish_returns_is_the_actions(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The worker answers an agent's Retain while the router's publish of it has not
    returned yet. The outcome is that action's: accepted, holding what it applied.
    Before, the action was not recorded yet, its outcome was counted as another router's
    and lost, and the action waited pending for OUTCOME_DEADLINE_S."""
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                            stub_workers[0]) as (router, client, plugin):
        url, hints = router.url, router.runtime.hints
        await _turn(client, url, "early")
        before = await _foreign_outcomes(client, url)
        async with gate(hints._link, lambda e: priority(e) == 100) as held:
            hinting = asyncio.create_task(client.post(f"{url}/v1/sessions/early/hints",
                                                      json=RETAIN))
            await asyncio.wait_for(held.reached.wait(), 10)

            async def took() -> None:  # the outcome taken in (as its action's, or foreign)
                while not (any(r.action_id == held.action_id for r in hints.recent)
                           or await _foreign_outcomes(client, url) > before):
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(took(), 10)
            held.open()
            hinted = await hinting
        assert hinted.status_code == 200, hinted.text
        (claim,) = hinted.json()["actions"]
        assert claim["status"] == "accepted" and claim["applied_blocks"] == 2
        assert await _foreign_outcomes(client, url) == before
        assert hints.holdings.api_on_worker("default", "w0").retained_blocks == 2


async def _foreign_outcomes(client: httpx.AsyncClient, url: str) -> float:
    return sample(await scrape(client, url), "kvhint_router_foreign_hint_messages_total",
                  kind="outcome") or 0.0


async def test_a_send_the_stopping_router_cancels_mid_publish_is_stored_and_restored(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The planner's idle review gives a session up (its tick's release goes out) and
    the router stops while that publish has not returned: the stop cancels the tick. The
    message was queued, so the worker gets it; the action's row was queued for the store
    before the publish, so it is saved (pending, no answer yet), and the router started
    again on the store waits for its outcome. Before, the row was queued after the
    publish returned, never, and the router knew nothing of an action its worker got."""
    stub = stub_workers[0]
    settings: dict[str, Any] = {"hints": {"tick_s": 0.1}}
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix, stub,
                                            answer=False, **settings
                                            ) as (router, client, plugin):
        runtime = router.runtime
        stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
        await _turn(client, router.url, "idle")
        await until(lambda: len(plugin.action_ids) == 1)  # the planner's protection
        # Only the tick sends from here: its idle review gives the session up. Left held
        # (no request waits on it): the stop cancels the tick inside its publish.
        held = PublishGate(runtime.hints._link, lambda e: True, after=True)
        held.install()
        runtime.hints.planner_config = dataclasses.replace(runtime.hints.planner_config,
                                                           abandon_after_s=0.3)
        await asyncio.wait_for(held.reached.wait(), 10)
        await until(lambda: held.action_id in plugin.action_ids)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'router.db'}")
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, source FROM hint_actions "
                                    "WHERE action_id = :a"), {"a": held.action_id}).all()
    engine.dispose()
    assert rows == [("pending", "planner")]
    config = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                             subject_prefix=subject_prefix, **settings)
    async with running_router(config) as restarted:
        assert held.action_id in restarted.runtime.hints.pending


async def test_a_publish_nats_refuses_puts_back_what_its_action_superseded(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """An agent's second Retain of a session supersedes its first in the router's
    records as soon as it is sent; NATS then refuses its publish (the router's
    connection closed meanwhile, as a stop or a lost server does). The second ends
    ``failed``, counted as before, and the first, which the worker still holds, is held
    again. Before, the second was recorded only once published, so neither a budget
    check nor an end during its publish saw it."""
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                            stub_workers[0]) as (router, client, _plugin):
        url, hints = router.url, router.runtime.hints
        holdings, scope = hints.holdings, "agent:default/s"
        await _turn(client, url, "s")
        first = await client.post(f"{url}/v1/sessions/s/hints", json={**RETAIN, "wait_s": 5})
        assert first.status_code == 200, first.text
        (claim,) = first.json()["actions"]
        assert holdings.api_on_worker("default", "w0").retained_blocks == 2
        before = await scrape(client, url)
        async with gate(hints._link, lambda e: True, after=False) as held:
            again = asyncio.create_task(client.post(f"{url}/v1/sessions/s/hints",
                                                    json=RETAIN))
            await asyncio.wait_for(held.reached.wait(), 10)
            assert held.action_id in holdings and claim["action_id"] not in holdings
            await router.runtime.link.close()  # NATS refuses what is published now
            held.open()
            refused = await again
        assert refused.status_code == 200, refused.text
        (failed,) = refused.json()["actions"]
        assert failed["status"] == "failed" and failed["reason"] == "NATS not connected"
        assert holdings.workers_holding(scope) == ["w0"] and claim["action_id"] in holdings
        assert held.action_id not in holdings and held.action_id not in hints.pending
        assert holdings.api_on_worker("default", "w0").retained_blocks == 2
        after = await scrape(client, url)
        for name, labels in (("kvhint_router_drops_total", {"what": "hint_unsent"}),
                             ("kvhint_router_hints_total",
                              {"action": "kv.retain", "outcome": "failed", "source": "api"})):
            assert (sample(after, name, **labels) or 0) - (
                sample(before, name, **labels) or 0) == 1
        assert time.time() < claim["expires_at"]
