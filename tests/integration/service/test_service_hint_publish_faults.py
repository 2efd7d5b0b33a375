"""Hint sends when NATS misbehaves, against a NATS server this test owns (stops, freezes,
kills), the real router app and two workers whose plugins this test plays: the order one
worker's envelopes leave in, a send queued behind a publish that cannot return
(router/service/hint_send.py ``PublishOrder``), and what an agent's call NATS refused
leaves behind (router/service/sessions_api.py: its rate, a refused Demote).

No fake: a publish that awaits is caused for real. The server is stopped (SIGSTOP: its
socket stays open and nobody reads it), the router's connection is filled past nats-py's
2 MiB pending buffer (publishes through the router's own link on a subject nobody reads),
and from then on every publish of the router queues its message and then waits on a
forced flush, which has no timeout, until the server reads again. Killed while frozen,
the server leaves those publishes waiting until a server answers on its address again,
while a new publish fails at once (the link is not connected).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import ACTIONS_WITH_OWNER, until
from kvhint.router.devstack.nats_server import NatsServerProcess
from kvhint.router.service.nats_link import PUBLISH_FLUSH_TIMEOUT_S
from kvhint.schemas import (
    Amount,
    Budgets,
    HintOutcome,
    OutcomeStatus,
    Subjects,
    Usage,
    WorkerStatus,
    decode_hints,
    encode_outcome,
    encode_status,
)

WORKERS = ("w0", "w1")
PREFIX = "kvhintorder"


def _status(worker: str, seq: int) -> bytes:
    """A heartbeat with a long interval: a freeze of a few seconds never makes the
    router declare the plugin dead (3 missed intervals)."""
    return encode_status(WorkerStatus(
        worker_id=worker, epoch="e1", model="tiny", cache_namespace="ns", block_size=32,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions=ACTIONS_WITH_OWNER,
        budgets=Budgets(max_pinned_blocks=100, max_pin_ttl_s=600, max_retained_blocks=400,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=512, gpu_blocks_free=400, kv_usage=0.2),
        last_event_seq=seq, interval_s=30.0, at=time.time()))


class Plugins:
    """Both workers' plugins as this test plays them: every action received is noted in
    order and accepted (2 blocks; a release, priority 0, none)."""

    def __init__(self, nc: Any, subjects: Subjects) -> None:
        self.nc, self.subjects = nc, subjects
        self.received: dict[str, list[str]] = {w: [] for w in WORKERS}

    async def subscribe(self) -> None:
        for worker in WORKERS:
            await self.nc.subscribe(self.subjects.hints(worker),
                                    cb=functools.partial(self._on_hints, worker))

    async def _on_hints(self, worker: str, msg: Any) -> None:
        envelope = decode_hints(msg.data)
        for action in envelope.actions:
            self.received[worker].append(action.action_id)
            blocks = 0 if getattr(action.payload, "priority", None) == 0 else 2
            await self.nc.publish(self.subjects.outcomes(worker), encode_outcome(HintOutcome(
                message_id=envelope.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id=worker,
                status=OutcomeStatus.ACCEPTED, requested=Amount(blocks, 32 * blocks),
                applied=Amount(blocks, 32 * blocks), at=time.time())))


@pytest.fixture
def nats_own(tmp_path: Path) -> Iterator[NatsServerProcess]:
    """A NATS server of this test's (``own_nats`` with a frozen one thawed before it is
    stopped: a stopped process would not answer SIGTERM)."""
    server = NatsServerProcess(store_dir=tmp_path / "nats-store",
                               log_path=tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        _signal(server, signal.SIGCONT)
        server.close()


def _signal(server: NatsServerProcess, sig: signal.Signals) -> None:
    proc = server._proc  # the child's pid: NatsServerProcess offers stop/start only
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, sig)


@asynccontextmanager
async def fleet(tmp_path: Path, server: NatsServerProcess, stubs: list[StubWorker],
                **settings: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient, Plugins]]:
    subjects = Subjects(PREFIX)
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    plugins = Plugins(nc, subjects)
    await plugins.subscribe()

    async def heartbeats() -> None:
        for seq in range(1, 1_000_000):
            for worker in WORKERS:
                await nc.publish(subjects.status(worker), _status(worker, seq))
            await asyncio.sleep(0.25)

    config = router_settings(tmp_path, list(zip(WORKERS, (s.url for s in stubs))),
                             nats_url=server.url, subject_prefix=PREFIX,
                             hints={"tick_s": 3600.0}, **settings)
    beating = asyncio.create_task(heartbeats())
    try:
        async with running_router(config) as router, \
                httpx.AsyncClient(timeout=60) as client:
            runtime = router.runtime
            assert await runtime.link.wait_connected(10)
            await until(lambda: all((w := runtime.workers.get(x)) is not None
                                    and w.plugin_alive for x in WORKERS))
            yield router, client, plugins
    finally:
        beating.cancel()
        server.start()  # up again (a no-op when up): the plugins' client closes cleanly
        await until(lambda: nc.is_connected)
        await nc.close()


async def _turn(client: httpx.AsyncClient, url: str, session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert response.status_code == 200, response.text


def _claim(worker: str, wait_s: float = 0) -> dict[str, Any]:
    return {"actions": [{"action_type": "kv.retain", "payload": {"priority": 100}}],
            "worker_id": worker, "wait_s": wait_s}


async def _flush_blocked(runtime: Any) -> list[asyncio.Task[bool]]:
    """The router's connection filled (the server frozen) until a publish waits on its
    flush; the junk publishes, to wait for once the server reads again."""
    junk: list[asyncio.Task[bool]] = []
    for _ in range(64):
        junk.append(asyncio.create_task(runtime.link.publish("junk.fill", b"x" * (256 << 10))))
        await asyncio.sleep(0.02)
        if not junk[-1].done():
            return junk
    raise AssertionError("no publish waited: the server still reads")


def _recorded(runtime: Any, worker: str, session: str | None = None,
              trigger: str | None = None) -> str | None:
    """The id of a pending action of ``session`` (or of ``trigger``) on ``worker``."""
    for record in runtime.hints.pending.values():
        if record.worker_id == worker and (session is None or record.session_id == session) \
                and (trigger is None or record.trigger == trigger):
            return record.action_id
    return None


async def test_a_send_to_two_workers_keeps_its_place_on_the_second(
        tmp_path: Path, nats_own: NatsServerProcess,
        stub_workers: list[StubWorker]) -> None:
    """A session's end releases the agent's claims on w0 and w1 in one send, while a
    claim of another session is being published to w0 (it waits on its flush). A hints
    call to w1 recorded after the end's release must reach w1 after it: the release was
    recorded first. Before, the send waited on w0's lock before it even began w1's
    envelope, the later call took w1's free lock and went out first."""
    async with fleet(tmp_path, nats_own, stub_workers) as (router, client, plugins):
        url, runtime = router.url, router.runtime
        for session in ("s", "t"):
            await _turn(client, url, session)
        for worker in WORKERS:
            claimed = await client.post(f"{url}/v1/sessions/s/hints", json=_claim(worker, 5))
            assert claimed.status_code == 200, claimed.text
            assert claimed.json()["actions"][0]["status"] == "accepted"
        _signal(nats_own, signal.SIGSTOP)
        junk = await _flush_blocked(runtime)
        first = asyncio.create_task(client.post(f"{url}/v1/sessions/t/hints",
                                                json=_claim("w0")))
        await until(lambda: _recorded(runtime, "w0", "t") is not None)
        ending = asyncio.create_task(client.delete(f"{url}/v1/sessions/s"))
        await until(lambda: _recorded(runtime, "w1", trigger="end:agent_release") is not None)
        release = _recorded(runtime, "w1", trigger="end:agent_release")
        later = asyncio.create_task(client.post(f"{url}/v1/sessions/t/hints",
                                                json=_claim("w1")))
        await until(lambda: _recorded(runtime, "w1", "t") is not None)
        claim = _recorded(runtime, "w1", "t")
        await asyncio.sleep(0.3)  # the later call as far as it goes while frozen
        _signal(nats_own, signal.SIGCONT)
        for response in await asyncio.gather(first, ending, later):
            assert response.status_code in (200, 202), response.text
        await asyncio.gather(*junk)
        await until(lambda: {release, claim} <= set(plugins.received["w1"]))
        received = plugins.received["w1"]
        assert received.index(release) < received.index(claim), received


async def test_a_send_behind_a_publish_nats_cannot_finish_fails_at_once(
        tmp_path: Path, nats_own: NatsServerProcess,
        stub_workers: list[StubWorker]) -> None:
    """A claim to w0 waits on its flush when the server dies. A hints call to w0 made
    then is answered at once, its action failed ("NATS not connected"), as it is with
    nothing in flight. Before, it waited on w0's lock, held by the publish that returns
    only when a server answers again: every send to w0 (the planner's tick, a session's
    end, agents' calls) hung for as long as NATS was away."""
    async with fleet(tmp_path, nats_own, stub_workers) as (router, client, _plugins):
        url, runtime = router.url, router.runtime
        for session in ("t", "u"):
            await _turn(client, url, session)
        _signal(nats_own, signal.SIGSTOP)
        junk = await _flush_blocked(runtime)
        stuck = asyncio.create_task(client.post(f"{url}/v1/sessions/t/hints",
                                                json=_claim("w0")))
        await until(lambda: _recorded(runtime, "w0", "t") is not None)
        _signal(nats_own, signal.SIGKILL)
        await until(lambda: not runtime.link.connected)
        try:
            refused = await asyncio.wait_for(
                client.post(f"{url}/v1/sessions/u/hints", json=_claim("w0")), 5)
        finally:
            nats_own.start()  # a server on the address again: the waiting publish returns
        assert refused.status_code == 200, refused.text
        (action,) = refused.json()["actions"]
        assert action["status"] == "failed" and action["reason"] == "NATS not connected"
        assert action["action_id"] not in runtime.hints.holdings
        assert (await stuck).status_code in (200, 202)
        await asyncio.gather(*junk)


async def _nats_down(server: NatsServerProcess, runtime: Any) -> None:
    server.stop()
    await until(lambda: not runtime.link.connected)


async def test_an_agents_demote_nats_refused_leaves_the_planners_claims(
        tmp_path: Path, nats_own: NatsServerProcess,
        stub_workers: list[StubWorker]) -> None:
    """A turn ending in tool calls has the planner protect the session on its worker;
    then NATS is down and the agent's Demote fails. The worker never got it, so the
    planner's protection still holds there: in the holdings (budgets count it) and in
    the session's plan (its idle reviews go on). Before, the Demote's effects on the
    planner were applied whatever its publish did: the holding dropped, the session left
    demoted until its next turn."""
    stub = stub_workers[0]
    async with fleet(tmp_path, nats_own, stub_workers) as (router, client, _plugins):
        url, runtime = router.url, router.runtime
        holdings = runtime.hints.holdings
        stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
        await _turn(client, url, "s")
        record = runtime.sessions.get("default", "s")
        worker = record.worker_id
        await until(lambda: holdings.holds(worker, "default/s"))
        await _nats_down(nats_own, runtime)
        demoted = await client.post(f"{url}/v1/sessions/s/hints", json={
            "actions": [{"action_type": "kv.demote"}]})
        assert demoted.status_code == 200, demoted.text
        assert demoted.json()["actions"][0]["status"] == "failed"
        assert holdings.holds(worker, "default/s")
        assert record.plan.protection is not None and not record.plan.agent_demoted


async def test_actions_nats_refused_cost_no_rate(
        tmp_path: Path, nats_own: NatsServerProcess,
        stub_workers: list[StubWorker]) -> None:
    """A tenant may send one action a minute. Its agent's claim fails while NATS is down;
    once NATS is back, the same claim again is sent (and accepted), not refused over the
    rate for a minute. Before, the failed action counted against the rate."""
    rate = [{"name": "default", "budget": {"max_actions_per_minute": 1}}]
    async with fleet(tmp_path, nats_own, stub_workers, tenants=rate) as (router, client,
                                                                         plugins):
        url, runtime = router.url, router.runtime
        await _turn(client, url, "s")
        await _nats_down(nats_own, runtime)
        failed = await client.post(f"{url}/v1/sessions/s/hints", json=_claim("w0"))
        assert failed.json()["actions"][0]["status"] == "failed", failed.text
        nats_own.start()
        # w0's client back too (it subscribes again as it reconnects): a hint the router
        # sends before that finds no subscriber and is lost.
        await until(lambda: runtime.link.connected and plugins.nc.is_connected)
        again = await client.post(f"{url}/v1/sessions/s/hints", json=_claim("w0"))
        assert again.status_code in (200, 202), again.text
        (sent,) = again.json()["actions"]
        assert sent["status"] != "failed"
        await until(lambda: sent["action_id"] in plugins.received["w0"])


async def test_a_publish_to_a_server_that_stopped_reading_returns_in_bounded_time(
        tmp_path: Path, nats_own: NatsServerProcess,
        stub_workers: list[StubWorker]) -> None:
    """The server frozen (its socket open, nothing read) and the router's connection full,
    a publish waits on nats-py's forced flush, which had no bound: it returned only when
    the server read again, and with it whatever sent it (the planner's tick, an end, an
    agent's hints call) hung. It returns within PUBLISH_FLUSH_TIMEOUT_S now, its message
    still queued (delivered once the server reads), the timeout counted as a client
    error."""
    async with fleet(tmp_path, nats_own, stub_workers) as (router, _client, _plugins):
        runtime = router.runtime
        _signal(nats_own, signal.SIGSTOP)
        try:
            junk = await _flush_blocked(runtime)
            started = time.monotonic()
            waited = await asyncio.wait_for(
                runtime.link.publish("junk.fill", b"x"), PUBLISH_FLUSH_TIMEOUT_S + 3)
            assert waited is True  # queued, not refused: the link is still connected
            assert time.monotonic() - started < PUBLISH_FLUSH_TIMEOUT_S + 3
            assert "FlushTimeoutError" in (runtime.link.last_error or "")
        finally:
            _signal(nats_own, signal.SIGCONT)
        await asyncio.gather(*junk)
