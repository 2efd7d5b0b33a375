"""A tenant admin's store views are limited to its tenant in the query itself (tenancy
review): ``/admin/sessions?source=store`` and ``/admin/hints`` with a ``limit`` return the
tenant's own newest rows even where another tenant's are newer still (a filter applied
after the store's ``LIMIT`` would return fewer, or none), on SQLite and PostgreSQL; and a
session id another tenant uses answers exactly as one nobody uses, on every call that
names a session (the sessions API's DELETE and hints, the admin API's read and end), so
no answer tells a tenant which ids another tenant has."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import sqlalchemy as sa

from conftest import StubWorker, router_settings, running_router
from kvhint.router.store.models import HintActionRow

ROOT, A_ADMIN, A_CLIENT = ({"authorization": f"Bearer {key}"} for key in ("root", "aa", "ka"))
TENANTS = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
           {"name": "b", "api_keys": ["kb"], "admin_keys": ["ab"]}]


async def _turn(client: httpx.AsyncClient, url: str, key: str, session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "session_id": session}, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def _hint(tenant: str, number: int, at: float) -> dict:
    # A terminal Prefetch: nothing a restart would restore as pending or held.
    return {"action_id": f"kvh-{tenant}-{number}", "message_id": f"m-{tenant}-{number}",
            "tenant": tenant, "session_id": f"{tenant}-{number}", "worker_id": "w0",
            "action_type": "kv.prefetch", "source": "planner", "trigger": "test",
            "payload": {"deadline_s": 5.0}, "status": "accepted", "reason": "",
            "requested_blocks": 1, "requested_tokens": 32, "applied_blocks": 1,
            "applied_tokens": 32, "created_at": at, "updated_at": at}


async def test_a_tenant_admins_store_views_limit_in_the_query_not_after_it(
        tmp_path: Path, stub_workers: list[StubWorker], database_url: str) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               database_url=database_url, admin_keys=["root"],
                               tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = router.url
        for n in range(3):  # a's sessions first: b's are all newer
            await _turn(client, url, "ka", f"a-{n}")
        for n in range(5):
            await _turn(client, url, "kb", f"b-{n}")
        now = time.time()
        # The router writes w0's row behind (the writer's first flush, 50 ms in): the
        # actions below name it, refused by their key before it lands.
        await router.runtime.writer.flush()
        engine = sa.create_engine(settings.database_url)
        try:
            with engine.begin() as conn:
                for n in range(3):
                    conn.execute(HintActionRow.__table__.insert().values(
                        _hint("a", n, now - 100 + n)))
                for n in range(5):
                    conn.execute(HintActionRow.__table__.insert().values(
                        _hint("b", n, now - 10 + n)))
        finally:
            engine.dispose()

        async def get(path: str, headers: dict[str, str], **params: str) -> dict:
            response = await client.get(f"{url}{path}", params=params, headers=headers)
            assert response.status_code == 200, (path, response.text)
            return response.json()

        # The fleet admin's newest two are b's: a filter after the LIMIT leaves a nothing.
        fleet = await get("/admin/sessions", ROOT, source="store", limit="2")
        assert [s["session_id"] for s in fleet["sessions"]] == ["b-4", "b-3"]
        fleet_hints = await get("/admin/hints", ROOT, limit="2")
        assert [h["action_id"] for h in fleet_hints["hints"]] == ["kvh-b-4", "kvh-b-3"]

        own = await get("/admin/sessions", A_ADMIN, source="store", limit="2")
        assert [(s["tenant"], s["session_id"]) for s in own["sessions"]] \
            == [("a", "a-2"), ("a", "a-1")]
        own = await get("/admin/sessions", A_ADMIN, source="store", limit="2",
                        state="active")
        assert [s["session_id"] for s in own["sessions"]] == ["a-2", "a-1"]
        hints = await get("/admin/hints", A_ADMIN, limit="2")
        assert [h["action_id"] for h in hints["hints"]] == ["kvh-a-2", "kvh-a-1"]
        assert hints["counts_by_status"] == {"accepted": 3}
        hints = await get("/admin/hints", A_ADMIN, limit="2", worker_id="w0",
                          status="accepted")
        assert [h["action_id"] for h in hints["hints"]] == ["kvh-a-2", "kvh-a-1"]
        # Another tenant's session named by its id, in a's scope: a's (none).
        assert (await get("/admin/hints", A_ADMIN, session_id="b-4"))["hints"] == []


async def test_another_tenants_session_id_answers_as_an_id_nobody_uses(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               admin_keys=["root"], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = router.url
        # b's sessions: plain, one spelt as a worker-side id of a's, one with a '/'.
        for session in ("taken", "a/taken", "x/taken"):
            await _turn(client, url, "kb", session)

        async def answers(session: str) -> list[tuple[int, str]]:
            """What a's keys get for ``session`` (its id put where each call takes it),
            the id itself blanked out of each message."""
            calls = [
                client.delete(f"{url}/v1/sessions/{session}", headers=A_CLIENT),
                client.delete(f"{url}/v1/sessions/{session}", headers=A_ADMIN),
                client.post(f"{url}/v1/sessions/{session}/hints", headers=A_ADMIN,
                            json={"actions": [{"action_type": "kv.pin"}]}),
                client.get(f"{url}/admin/sessions/a/{session}", headers=A_ADMIN),
                client.post(f"{url}/admin/sessions/a/{session}/end", headers=A_ADMIN),
            ]
            out = []
            for call in calls:
                response = await call
                out.append((response.status_code,
                            response.json()["error"]["message"].replace(session, "ID")))
            return out

        for taken, unused in (("taken", "never"), ("a/taken", "a/never"),
                              ("x/taken", "x/never"), ("b/taken", "b/never")):
            got = await answers(taken)
            assert got == await answers(unused), (taken, got)
            assert {status for status, _ in got} == {404}, got
        # b's sessions are untouched: none ended.
        for session in ("taken", "a/taken", "x/taken"):
            assert router.runtime.sessions.get("b", session).state == "active"
