"""A hints call refused for what no session changes (no actions or too many, a bad or
pending action id, the tenant's per-minute rate) is refused before the session's store
read: neither ``session_reads_total`` (a session not in memory) nor
``session_refreshes_total`` (one in memory, read again before each call) moves. Calls
that pass those checks still read it first (the budgets need the session's worker and
prompt). On SQLite and PostgreSQL, with the real router app, NATS and store (w0's plugin
played by the test, as in test_service_hints_api).

Before, every one of these refusals read the session first: a lookup by key (~0.2 ms on
SQLite, ~0.7 ms on PostgreSQL, far more through the loop on a busy router) and a read slot
of the tenant's, so an agent retrying over its rate cost the store a read a try."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import StubWorker, scrape
from test_service_hints_api import _chat, router_with_plugin

pytestmark = pytest.mark.usefixtures("throwaway_streams")

ADMIN = {"authorization": "Bearer aa"}
RETAIN = {"action_type": "kv.retain", "payload": {"priority": 50}}
READS = ("kvhint_router_session_reads_total", "kvhint_router_session_refreshes_total")


async def test_a_call_refused_whatever_the_session_holds_reads_no_session(
        tmp_path: Path, database_url: str, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"],
                "budget": {"max_actions_per_minute": 2}}]
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=tenants, database_url=database_url
                                  ) as (router, client, _plugin):
        await _chat(client, router.url, "s1", "ka")

        async def reads() -> float:
            samples = await scrape(client, router.url)
            return sum(value for (name, _labels), value in samples.items() if name in READS)

        async def call(session: str, body: dict) -> tuple[int, str]:
            response = await client.post(f"{router.url}/v1/sessions/{session}/hints",
                                         json=body, headers=ADMIN)
            return response.status_code, response.json().get("error", {}).get("type", "")

        # A call that passes reads a session in memory again where replicas may share
        # the store (PostgreSQL; on SQLite, one router's own, it is not: session_refresh).
        per_call = 1 if database_url.startswith("postgresql") else 0
        before = await reads()
        assert await call("s1", {"actions": [RETAIN]}) == (200, "")
        assert await reads() == before + per_call
        refused = [({"actions": []}, 422),
                   ({"actions": [RETAIN] * 3}, 422),  # more than a minute's rate
                   ({"actions": [{**RETAIN, "action_id": "bad id"}]}, 422),
                   ({"actions": [{**RETAIN, "action_id": "x"}] * 2}, 422)]  # given twice
        before = await reads()
        for session in ("s1", "elsewhere"):  # in memory; not (another replica's?)
            for body, code in refused:
                status, _ = await call(session, body)
                assert status == code, (session, body, status)
            assert await reads() == before, session
        assert await call("s1", {"actions": [RETAIN]}) == (200, "")  # the rate's second
        after_second = await reads()
        assert after_second == before + per_call  # the second call's read only
        for session in ("s1", "elsewhere"):
            over = await client.post(f"{router.url}/v1/sessions/{session}/hints",
                                     json={"actions": [RETAIN]}, headers=ADMIN)
            assert over.status_code == 429 and "per minute" in over.text, over.text
            assert 1 <= int(over.headers["retry-after"]) <= 60
        # Before: a read per refused call (of "elsewhere" on SQLite; of both here on
        # PostgreSQL), above and here.
        assert await reads() == after_second
