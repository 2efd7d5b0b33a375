"""A tenant admin's answers carry no other tenant's data (security review: its workers
view showed each worker's outcome ``feedback``, with the rejection reasons of other
tenants' hints, ``last_http_error`` and ``http_failures``, from every tenant's traffic,
and the heartbeat's ``last_event_seq``). Every admin answer it can read is checked for
the other tenant's session ids; the fleet admin still sees all of it.

The plugin here is this test publishing wire messages (as in test_service_feed.py): it
rejects every hint, naming the session in its reason, so the other tenant's session id
lands in the worker's feedback and in that tenant's hint rows; b's first hint it rejects
as a type the worker cannot do (a capability: the worker's feedback, every tenant's).
A tenant admin sees the worker's capability feedback and its own tenant's, not another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_registered, status, until
from kvhint.router.devstack.nats_server import free_port
from kvhint.schemas import (
    Amount,
    HintOutcome,
    OutcomeStatus,
    Subjects,
    decode_hints,
    encode_outcome,
)
from kvhint.schemas.outcomes import REJECTED_UNSUPPORTED

pytestmark = pytest.mark.usefixtures("throwaway_streams")

ROOT, A_ADMIN, B_ADMIN = ({"authorization": f"Bearer {key}"} for key in ("root", "aa", "ab"))
# Null for a tenant admin: every tenant's traffic (admin_api.worker_view).
FLEET_ONLY = ("http_failures", "last_http_error", "requests", "inflight",
              "index_blocks", "held_by_hints")
# What the plugin answers b's first hint: nothing of b's in it (a worker's capability).
CAPABILITY_REASON = f"{REJECTED_UNSUPPORTED}action version on this worker"
# The worker-wide figures the plugin's reasons may name (tenant_reasons.py): a tenant
# reads its reasons without them.
BUDGET_CLAUSE = "retain budget: 0 of 4 blocks fit (max_retained_blocks=400)"


async def _turn(client: httpx.AsyncClient, url: str, key: str, session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", headers={
        "authorization": f"Bearer {key}"}, json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert response.status_code == 200, response.text


async def test_a_tenant_admin_sees_no_other_tenants_data_in_any_admin_answer(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)

    async def plugin(msg) -> None:  # noqa: ANN001 - rejects every action, naming its session
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            session = action.payload.target.session_id
            reason = (CAPABILITY_REASON if session == "b/b-private-0"
                      else f"not for {session}; {BUDGET_CLAUSE}")
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id="w0",
                status=OutcomeStatus.REJECTED, reason=reason,
                requested=Amount(4, 128), applied=Amount(0, 0), at=time.time())))

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    # w-dead: nothing listens there; a turn tried there fails (and is retried on w0),
    # leaving its error text.
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url), ("w-dead", f"http://127.0.0.1:{free_port()}")],
        nats_url=nats_url, subject_prefix=subject_prefix, admin_keys=["root"],
        tenants=[{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
                 {"name": "b", "api_keys": ["kb"], "admin_keys": ["ab"]}])
    beating: asyncio.Task[None] | None = None
    try:
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            runtime, url = router.runtime, router.url
            await plugin_registered(runtime, nc, subjects)
            beating = asyncio.create_task(_heartbeats(nc, subjects))
            # a's own turn first: its hint is rejected before b's disable the type on w0.
            await _turn(client, url, "ka", "a-own")
            await until(lambda: runtime.hints.status_counts_of("a") == {"rejected": 1})
            for n in range(4):
                await _turn(client, url, "kb", f"b-private-{n}")
            await until(lambda: not runtime.workers.get("w-dead").http_up)
            # Two of b's rejected in a row: the planner stops sending that type to w0,
            # and the feedback keeps the reason (b's session id in it).
            await until(lambda: runtime.hints.feedback.get("w0") is not None
                        and bool(runtime.hints.feedback["w0"].view("b").disabled_reasons))

            async def read(path: str, headers: dict[str, str]) -> httpx.Response:
                response = await client.get(f"{url}{path}", headers=headers)
                assert response.status_code == 200, (path, response.text)
                return response

            paths = ("/admin/workers", "/admin/workers/w0", "/admin/workers/w-dead",
                     "/admin/overview", "/admin/hints", "/admin/sessions",
                     "/admin/sessions?source=store", "/admin/sessions/a/a-own")
            for path in paths:
                answer = await read(path, A_ADMIN)
                assert "b-private" not in answer.text, path
            a_workers = {w["worker_id"]: w
                         for w in (await read("/admin/workers", A_ADMIN)).json()["workers"]}
            overview = (await read("/admin/overview", A_ADMIN)).json()
            for worker in [*a_workers.values(), *overview["workers"],
                           (await read("/admin/workers/w-dead", A_ADMIN)).json()]:
                assert all(worker[field] is None for field in FLEET_ONLY), worker
            # What carries no tenant's traffic is still shown: liveness and capabilities.
            assert a_workers["w-dead"]["http_up"] is False
            assert a_workers["w0"]["plugin_alive"] is True
            status = a_workers["w0"]["status"]
            assert status["usage"] is None and status["last_event_seq"] is None
            assert status["block_size"] == 32 and status["budgets"]["max_pinned_blocks"] == 100
            assert a_workers["w0"]["stream"]["applied_seq"] is None
            # Its feedback: the worker's capability part (b's capability rejection, which
            # says nothing of b) and a's own part (its one rejection); b's part is not in
            # it (before: the whole feedback was null for a tenant admin).
            feedback = a_workers["w0"]["feedback"]
            assert set(feedback["tenants"]) == {"a"}, feedback
            assert sum(feedback["rejections_in_row"].values()) >= 1, feedback
            assert sum(feedback["tenants"]["a"]["rejections_in_row"].values()) == 1, feedback
            assert {w["worker_id"]: w["feedback"] for w in overview["workers"]}["w0"] \
                == feedback
            # a's own figures: its own session and hint (rejected), not b's.
            assert overview["hint_status_counts"] == {"rejected": 1}
            assert [h["session_id"] for h in overview["hints"]] == ["a-own"]

            # The fleet admin sees all of it.
            fleet = {w["worker_id"]: w
                     for w in (await read("/admin/workers", ROOT)).json()["workers"]}
            assert fleet["w-dead"]["last_http_error"] and fleet["w-dead"]["http_failures"] >= 1
            assert "b-private" in str(fleet["w0"]["feedback"]["tenants"]["b"]["disabled_reasons"])
            assert fleet["w0"]["status"]["last_event_seq"] == 0
            assert fleet["w0"]["status"]["usage"]["gpu_blocks_total"] == 512
            assert fleet["w0"]["requests"] == 5
            for path in ("/admin/overview", "/admin/hints", "/admin/sessions"):
                assert "b-private" in (await read(path, ROOT)).text, path
            # And b's admin its own tenant's (the per-tenant figures).
            b_hints = (await read("/admin/hints", B_ADMIN)).json()
            assert b_hints["hints"] and any("b-private" in h["reason"]
                                            for h in b_hints["hints"])
            b_feedback = (await read("/admin/workers/w0", B_ADMIN)).json()["feedback"]
            assert set(b_feedback["tenants"]) == {"b"}, b_feedback
            assert "b-private" in str(b_feedback["tenants"]["b"]["disabled_reasons"])
            assert "a-own" not in str(b_feedback)
            assert "max_retained_blocks" not in str(b_feedback)
            assert "max_retained_blocks" in str(fleet["w0"]["feedback"])
            assert b_feedback["rejections_in_row"] == feedback["rejections_in_row"]
    finally:
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        await nc.drain()


async def _heartbeats(nc, subjects: Subjects) -> None:  # noqa: ANN001
    """w0's plugin stays alive (heard every 0.3 s) however long the test takes."""
    while True:
        await asyncio.sleep(0.3)
        await nc.publish(subjects.status("w0"), status("w0", "e1", 0))
