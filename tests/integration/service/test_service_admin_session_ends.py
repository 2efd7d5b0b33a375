"""How the admin API shows a session's end, against the real router app, a real NATS
server and the real store (SQLite): one its client ended and one the planner abandoned
when idle are both ``state: ended``; the memory views tell them apart by
``planner.ended_explicitly``, as the store view does by ``plan.ended_explicitly``. A
session abandoned and then ended by its client takes that end's time as its
``ended_at``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import StubWorker
from feed_helpers import router_with_accepting_plugin, until
from kvhint.router.service.sessions import SessionRecord
from test_service_sessions_api_contract import _turn

pytestmark = pytest.mark.usefixtures("throwaway_streams")


async def _views(client: httpx.AsyncClient, url: str) -> tuple[dict[str, Any], ...]:
    """Each ended session as the memory list, the memory detail and the store list show
    it, by session id."""
    listed = await client.get(f"{url}/admin/sessions", params={"state": "ended"})
    stored = await client.get(f"{url}/admin/sessions",
                              params={"state": "ended", "source": "store"})
    assert listed.status_code == 200 and stored.status_code == 200
    memory = {row["session_id"]: row for row in listed.json()["sessions"]}
    detail = {}
    for session in memory:
        one = await client.get(f"{url}/admin/sessions/default/{session}")
        assert one.status_code == 200, one.text
        detail[session] = one.json()
    return memory, detail, {row["session_id"]: row for row in stored.json()["sessions"]}


async def _abandon(runtime: Any, session: str) -> None:  # noqa: ANN401 - RouterRuntime
    """The planner gives ``session`` up when idle (an hour by default, shortened)."""
    runtime.hints.planner_config = dataclasses.replace(runtime.hints.planner_config,
                                                       abandon_after_s=0.5)
    await until(lambda: runtime.sessions.get("default", session).state == "ended")


async def test_the_memory_views_tell_a_client_end_from_an_abandonment(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Before, both read ``state: ended`` in memory with nothing else apart: only the
    store view (``plan.ended_explicitly``) told them apart."""
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                            stub_workers[0], hints={"tick_s": 0.1}
                                            ) as (router, client, _):
        for session in ("deleted", "abandoned"):
            await _turn(client, router.url, session)
        assert (await client.delete(f"{router.url}/v1/sessions/deleted")).status_code == 200
        await _abandon(router.runtime, "abandoned")
        memory, detail, stored = await _views(client, router.url)
        expected = {"deleted": True, "abandoned": False}
        assert set(memory) == set(expected) == set(stored)
        for session, explicitly in expected.items():
            for view in (memory[session], detail[session]):
                assert view["state"] == "ended"
                assert view["planner"]["ended_explicitly"] is explicitly, (session, view)
            assert stored[session]["plan"]["ended_explicitly"] is explicitly


async def test_a_client_end_after_an_abandonment_is_when_the_session_ended(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A session the planner abandoned, then DELETEd by its client: its ``ended_at`` is
    the DELETE's, and the plan's ``last_activity`` the same clock reading, as any end by
    its client (``SessionLifecycle.end``). So a row of it that a router from before
    ``ended_explicitly`` saves again without the flag is still read as ended by its
    client (``sessions._ended_explicitly_before_the_flag``); one only abandoned is not.
    Before, ``ended_at`` kept the abandonment's time."""
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                            stub_workers[0], hints={"tick_s": 0.1}
                                            ) as (router, client, _):
        runtime = router.runtime
        for session in ("abandoned", "only_abandoned"):
            await _turn(client, router.url, session)
        await _abandon(runtime, "abandoned")
        await until(lambda: runtime.sessions.get("default", "only_abandoned").state == "ended")
        abandoned_at = runtime.sessions.get("default", "abandoned").ended_at
        ended = await client.delete(f"{router.url}/v1/sessions/abandoned")
        assert ended.status_code == 200, ended.text
        record = runtime.sessions.get("default", "abandoned")
        assert record.ended_at > abandoned_at
        assert record.plan.last_activity == record.ended_at
        memory, detail, stored = await _views(client, router.url)
        for view in (memory["abandoned"], detail["abandoned"], stored["abandoned"]):
            assert view["ended_at"] == record.ended_at, view
        assert memory["abandoned"]["planner"]["ended_explicitly"] is True
        assert stored["abandoned"]["plan"]["ended_explicitly"] is True
        # A repeated DELETE is no new end: the time stays the first client end's.
        assert (await client.delete(f"{router.url}/v1/sessions/abandoned")).status_code == 200
        assert runtime.sessions.get("default", "abandoned").ended_at == record.ended_at
    for session, explicitly in (("abandoned", True), ("only_abandoned", False)):
        row = dict(stored[session])
        row["plan"] = {k: v for k, v in row["plan"].items() if k != "ended_explicitly"}
        assert SessionRecord.from_row(row).plan.ended_explicitly is explicitly, session
