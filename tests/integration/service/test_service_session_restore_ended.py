"""Sessions a router from before ``ended_explicitly`` ended, restored from the store by a
router that has the flag, against a real NATS server and the real store (SQLite): one its
client ended still takes no agent hints (409) after the restart; one the planner
abandoned when idle still takes them, as before the restart, until its client ends it:
then it is one its client ended, stored so, as a session of today's rows is.

Such a router (release before the flag, or an older one in a rolling upgrade) wrote the
planner's state without the key; its rows are made here by running today's router and
taking the key out of its rows, which leaves them as the older one wrote them (it wrote
every other field the same, and stamped an end the same way: lifecycle.end)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import sqlalchemy as sa

from conftest import StubWorker
from feed_helpers import router_with_accepting_plugin, until
from test_service_sessions_api_contract import RETAIN, _turn

pytestmark = pytest.mark.usefixtures("throwaway_streams")


async def test_a_session_its_client_ended_stays_ended_for_hints_across_a_restart(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Before, every such session was read as not ended by its client: its agent's hints
    were taken again after the restart, though the client had said it was over."""
    stub = stub_workers[0]
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix, stub,
                                        hints={"tick_s": 0.1}) as (router, client, _):
        runtime = router.runtime
        for session in ("deleted", "header", "abandoned"):
            await _turn(client, router.url, session)
        assert (await client.delete(f"{router.url}/v1/sessions/deleted")).status_code == 200
        ended = await client.post(f"{router.url}/v1/chat/completions", json={
            "model": "stub", "session_id": "header",
            "messages": [{"role": "user", "content": "header: " + "x" * 400}]},
            headers={"x-session-end": "true"})
        assert ended.status_code == 200, ended.text
        # The planner gives "abandoned" up when idle (an hour by default, shortened).
        runtime.hints.planner_config = dataclasses.replace(runtime.hints.planner_config,
                                                           abandon_after_s=0.5)
        await until(lambda: runtime.sessions.get("default", "abandoned").state == "ended")
        await runtime.writer.flush()
    _as_written_before_the_flag(tmp_path / "router.db", 3)

    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix, stub,
                                        hints={"tick_s": 3600.0}) as (router, client, _):
        sessions = router.runtime.sessions
        assert {sessions.get("default", s).state
                for s in ("deleted", "header", "abandoned")} == {"ended"}
        for session in ("deleted", "header"):
            refused = await client.post(f"{router.url}/v1/sessions/{session}/hints",
                                        json=RETAIN)
            assert refused.status_code == 409, (session, refused.text)
            assert "was ended" in refused.json()["error"]["message"]
        hinted = await client.post(f"{router.url}/v1/sessions/abandoned/hints", json=RETAIN)
        assert hinted.status_code == 200, hinted.text


async def test_an_abandoned_session_its_client_then_ends_is_ended_by_its_client(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Two sessions the planner abandoned, stored by a router from before the flag, are
    restored as abandoned (their agents' hints taken); their clients then end them with a
    DELETE, one in memory, one forgotten from it (recalled from the store). Each is then
    one its client ended, as a session of today's rows is: the agent's claim released,
    hints refused (409), the stored plan carrying ``ended_explicitly`` (what the admin
    API's store view shows), and so across the next restart too."""
    stub = stub_workers[0]
    sessions_ids = ("abandoned", "forgotten")
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix, stub,
                                        hints={"tick_s": 0.1}) as (router, client, _):
        runtime = router.runtime
        for session in sessions_ids:
            await _turn(client, router.url, session)
        runtime.hints.planner_config = dataclasses.replace(runtime.hints.planner_config,
                                                           abandon_after_s=0.5)
        await until(lambda: all(runtime.sessions.get("default", s).state == "ended"
                                for s in sessions_ids))
        await runtime.writer.flush()
    _as_written_before_the_flag(tmp_path / "router.db", 2)

    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix, stub,
                                        hints={"tick_s": 3600.0}) as (router, client, plugin):
        url, runtime = router.url, router.runtime
        for session in sessions_ids:
            record = runtime.sessions.get("default", session)
            assert record.state == "ended" and not record.plan.ended_explicitly
            hinted = await client.post(f"{url}/v1/sessions/{session}/hints", json=RETAIN)
            assert hinted.status_code == 200, hinted.text
        await runtime.writer.flush()
        runtime.sessions.forget(runtime.sessions.get("default", "forgotten"))
        for session in sessions_ids:
            claims = len(plugin.received)
            ended = await client.delete(f"{url}/v1/sessions/{session}")
            assert ended.status_code == 200, ended.text
            assert ended.json()["state"] == "ended"
            (release,) = ended.json()["hints"]
            assert release["trigger"] == "end:agent_release"
            await until(lambda: len(plugin.received) == claims + 1)
            assert runtime.sessions.get("default", session).plan.ended_explicitly
            refused = await client.post(f"{url}/v1/sessions/{session}/hints", json=RETAIN)
            assert refused.status_code == 409, (session, refused.text)
        stored = await client.get(f"{url}/admin/sessions", params={"source": "store"})
        rows = {row["session_id"]: row for row in stored.json()["sessions"]}
        for session in sessions_ids:
            assert rows[session]["state"] == "ended"
            assert rows[session]["plan"]["ended_explicitly"] is True, rows[session]

    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix, stub,
                                        hints={"tick_s": 3600.0}) as (router, client, _):
        for session in sessions_ids:
            assert router.runtime.sessions.get("default", session).plan.ended_explicitly
            refused = await client.post(f"{router.url}/v1/sessions/{session}/hints",
                                        json=RETAIN)
            assert refused.status_code == 409, (session, refused.text)


def _as_written_before_the_flag(database: Path, expected: int) -> None:
    """The stored sessions' planner state without ``ended_explicitly``."""
    engine = sa.create_engine(f"sqlite:///{database}")
    sessions = sa.Table("sessions", sa.MetaData(), autoload_with=engine)
    with engine.begin() as conn:
        rows = conn.execute(sa.select(sessions.c.tenant, sessions.c.session_id,
                                      sessions.c.plan)).all()
        assert len(rows) == expected
        for tenant, session_id, plan in rows:
            assert "ended_explicitly" in plan
            older = {k: v for k, v in plan.items() if k != "ended_explicitly"}
            conn.execute(sessions.update()
                         .where(sessions.c.tenant == tenant,
                                sessions.c.session_id == session_id)
                         .values(plan=older))
    engine.dispose()
