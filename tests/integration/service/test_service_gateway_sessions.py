"""The gateway's sessions against stub workers: the lifecycle (tool gaps, the end header),
what survives a restart, and sessions that come back after being forgotten."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}


async def test_session_lifecycle_tool_gap_and_end_header(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = f"{router.url}/v1/chat/completions"
        await client.post(url, json=CHAT, headers={"x-session-id": "agent-1"})
        record = router.runtime.sessions.get("default", "agent-1")
        assert record.state == "tool_gap" and record.open_gap["tools"] == ["search"]
        assert record.plan.gap_kind == "search"
        await asyncio.sleep(0.2)
        stub.finish_reason, stub.tool_names = "stop", []
        await client.post(url, json={**CHAT, "prompt_cache_key": "agent-1"})
        assert record.state == "active" and record.turns == 2
        assert record.gaps[0]["tools"] == ["search"] and record.gaps[0]["seconds"] >= 0.2
        await client.post(url, json=CHAT, headers={"x-session-id": "agent-1",
                                                   "x-session-end": "true"})
        assert record.state == "ended" and record.turns == 3
        detail = (await client.get(f"{router.url}/admin/sessions/default/agent-1")).json()
        assert detail["state"] == "ended" and detail["prompt_tokens"] == 120
        assert detail["cached_tokens"] == 96 and detail["gaps"][0]["tools"] == ["search"]


async def test_sessions_survive_a_restart(tmp_path: Path,
                                          stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for turn in range(3):
            await client.post(f"{router.url}/v1/chat/completions",
                              json={**CHAT, "session_id": "keep"})
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        record = router.runtime.sessions.get("default", "keep")
        assert record is not None and record.turns == 3 and record.worker_id == "w0"
        assert record.plan.turns == 3
        await client.post(f"{router.url}/v1/chat/completions", json={**CHAT, "session_id": "keep"})
        assert record.turns == 4


async def test_workers_learned_from_heartbeats_come_back_only_if_heard_lately(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A restart brings back the workers the router learned from heartbeats (in the
    store) that it heard within session_forget_s; before, a pod gone for a week came
    back routable on every restart, and took first requests and retries."""
    from kvhint.router.store.database import create_store_engine, migrate
    from kvhint.router.store.models import WorkerRow

    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    engine = create_store_engine(settings.database_url)
    migrate(engine)
    now = time.time()
    with engine.begin() as conn:
        for worker_id, heard in (("recent", now - 60), ("old-pod", now - 7 * 86400),
                                 ("never", None)):
            conn.execute(WorkerRow.__table__.insert().values(
                worker_id=worker_id, url="http://127.0.0.1:9", from_config=False,
                last_seen=heard))
    engine.dispose()
    async with running_router(settings) as router:
        assert sorted(w.worker_id for w in router.runtime.workers.all()) == ["recent", "w0"]


async def test_a_session_back_after_being_forgotten_continues_its_stored_history(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A session forgotten from memory (idle past session_forget_s, or evicted) that
    comes back continues the history the store keeps; before, a blank record replaced
    it and its first save wiped the stored turns, counters and planner state."""
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        runtime = router.runtime
        for _turn in range(3):
            await client.post(f"{router.url}/v1/chat/completions",
                              json={**CHAT, "session_id": "back"})
        record = runtime.sessions.get("default", "back")
        assert record is not None and record.turns == 3
        await runtime.writer.flush()
        runtime.sessions.forget(record)
        await client.post(f"{router.url}/v1/chat/completions",
                          json={**CHAT, "session_id": "back"})
        again = runtime.sessions.get("default", "back")
        assert again is not None and again is not record
        assert again.turns == 4 and again.plan.turns == 4
        assert again.created_at == record.created_at
        await client.post(f"{router.url}/v1/chat/completions",
                          json={**CHAT, "session_id": "brand-new"})
        assert runtime.sessions.get("default", "brand-new").turns == 1
        # Ended while forgotten from memory: the stored session ends (before, a 404), by
        # the client and by an admin.
        for session, ending in (("back", "/v1/sessions/back"),
                                ("brand-new", "/admin/sessions/default/brand-new/end")):
            await runtime.writer.flush()
            runtime.sessions.forget(runtime.sessions.get("default", session))
            ended = await (client.delete(f"{router.url}{ending}") if ending.startswith("/v1")
                           else client.post(f"{router.url}{ending}",  # dev mode, no key
                                            headers={"x-kvhint-request": "1"}))
            assert ended.status_code == 200, ended.text
            assert runtime.sessions.get("default", session).state == "ended"


async def test_a_store_that_cannot_be_read_does_not_fail_a_returning_sessions_turn(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """The lookup of a forgotten session's stored row fails (here: its table is gone):
    the turn is served with a record of its own, and the failure is counted."""
    from sqlalchemy import text

    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        runtime = router.runtime
        await client.post(f"{router.url}/v1/chat/completions", json={**CHAT, "session_id": "x"})
        runtime.sessions.forget(runtime.sessions.get("default", "x"))
        await runtime.writer.flush()
        with runtime.engine.begin() as conn:
            conn.execute(text("ALTER TABLE sessions RENAME TO sessions_away"))
        response = await client.post(f"{router.url}/v1/chat/completions",
                                     json={**CHAT, "session_id": "x"})
        assert response.status_code == 200
        metrics = (await client.get(f"{router.url}/metrics")).text
        assert 'kvhint_router_drops_total{what="store_read_error"} 1.0' in metrics
        # An admin read of the store that fails for good (the table is gone) is a 500
        # naming the cause, neither a 503 to retry for ever nor a 500 counted as the
        # router's internal error (test_service_admin_store_errors has the cases).
        stored = await client.get(f"{router.url}/admin/sessions", params={"source": "store"})
        assert stored.status_code == 500, stored.text
        assert "no such table: sessions" in stored.json()["error"]["message"]
        metrics = (await client.get(f"{router.url}/metrics")).text
        assert 'what="internal_error"' not in metrics
        with runtime.engine.begin() as conn:
            conn.execute(text("ALTER TABLE sessions_away RENAME TO sessions"))
