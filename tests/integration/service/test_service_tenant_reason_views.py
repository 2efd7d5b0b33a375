"""What a tenant reads of its hints' outcomes, against a real NATS server, the real router
and its store: its own action (status, what it asked and holds), not the worker-wide
budget figures the plugin's reason names (the room left in a budget every tenant shares,
what other Prefetches wait for). A fleet admin reads the worker's words.

The plugin here is this test answering w0's hints with the real plugin's wording
(tests/integration/plugin/test_plugin_tenant_reasons.py reads it off the real plugin).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_registered
from kvhint.schemas import (
    Amount,
    HintOutcome,
    OutcomeStatus,
    Subjects,
    decode_hints,
    encode_outcome,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")

# What w0 says of a Pin its pin budget clipped: 3 blocks were free, of 100.
WORKER_REASON = "pin budget: 3 of 8 new blocks fit (max_pinned_blocks=100); ttl clipped"
ROOT, A_ADMIN = ({"authorization": f"Bearer {key}"} for key in ("root", "aa"))


async def test_a_tenant_reads_its_clipped_hints_without_the_workers_budget_figures(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """a's admin pins a's session through the hints API; w0 clips it (3 of 8 blocks, its
    budget full of other holders'). The answer, a's admin views (hints, the session's
    hints, the overview) say it was clipped, what a asked (8) and holds (3), and that
    the worker's shared budget had no room: not how many blocks were free nor the
    budget. Before, the reason was passed through as the worker wrote it: how much of
    the worker's pin budget every other tenant held at that moment. The planner is off:
    the hints API's action is the only one."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)

    async def plugin(msg) -> None:  # noqa: ANN001
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id="w0",
                status=OutcomeStatus.CLIPPED, reason=WORKER_REASON,
                requested=Amount(8, 256), applied=Amount(3, 96), at=time.time())))

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, admin_keys=["root"], hints={"enabled": False},
        tenants=[{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
                 {"name": "b", "api_keys": ["kb"]}])
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            await plugin_registered(router.runtime, nc, subjects)
            url = router.url
            turn = await client.post(f"{url}/v1/chat/completions", headers={
                "authorization": "Bearer ka"}, json={
                "model": "stub", "session_id": "s1",
                "messages": [{"role": "user", "content": "s1: " + "x" * 400}]})
            assert turn.status_code == 200, turn.text
            answer = await client.post(f"{url}/v1/sessions/s1/hints", headers=A_ADMIN, json={
                "actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 300}}]})
            assert answer.status_code == 200, answer.text
            (action,) = answer.json()["actions"]
            assert (action["status"], action["requested_blocks"], action["applied_blocks"]) == (
                "clipped", 8, 3)
            shown = ("pin budget: the worker's, shared by every tenant, had no room for the "
                     "rest; ttl clipped")
            assert action["reason"] == shown

            async def reasons(path: str, headers: dict[str, str], key: str) -> list[str]:
                response = await client.get(f"{url}{path}", headers=headers)
                assert response.status_code == 200, (path, response.text)
                return [h["reason"] for h in response.json()[key]]

            for path, key in (("/admin/hints", "hints"), ("/admin/overview", "hints"),
                              ("/admin/sessions/a/s1", "hints")):
                assert await reasons(path, A_ADMIN, key) == [shown], path
                assert await reasons(path, ROOT, key) == [WORKER_REASON], path
    finally:
        await nc.drain()
