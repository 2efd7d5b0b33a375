"""Sessions a router from before ``ended_explicitly`` ended, restored from the store by a
router that has the flag, against a real NATS server and the real store (SQLite): one its
client ended still takes no agent hints (409) after the restart; one the planner
abandoned when idle still takes them, as before the restart.

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
from feed_helpers import until
from test_service_sessions_api_contract import RETAIN, _turn, router_with_owner_plugin

pytestmark = pytest.mark.usefixtures("throwaway_streams")


async def test_a_session_its_client_ended_stays_ended_for_hints_across_a_restart(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Before, every such session was read as not ended by its client: its agent's hints
    were taken again after the restart, though the client had said it was over."""
    stub = stub_workers[0]
    async with router_with_owner_plugin(tmp_path, nats_url, subject_prefix, stub,
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
    _as_written_before_the_flag(tmp_path / "router.db")

    async with router_with_owner_plugin(tmp_path, nats_url, subject_prefix, stub,
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


def _as_written_before_the_flag(database: Path) -> None:
    """The stored sessions' planner state without ``ended_explicitly``."""
    engine = sa.create_engine(f"sqlite:///{database}")
    sessions = sa.Table("sessions", sa.MetaData(), autoload_with=engine)
    with engine.begin() as conn:
        rows = conn.execute(sa.select(sessions.c.tenant, sessions.c.session_id,
                                      sessions.c.plan)).all()
        assert len(rows) == 3
        for tenant, session_id, plan in rows:
            assert "ended_explicitly" in plan
            older = {k: v for k, v in plan.items() if k != "ended_explicitly"}
            conn.execute(sessions.update()
                         .where(sessions.c.tenant == tenant,
                                sessions.c.session_id == session_id)
                         .values(plan=older))
    engine.dispose()
