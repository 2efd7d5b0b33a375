"""A Prefetch waits on its worker until its ``deadline_s`` (answered ``deferred``
meanwhile), and the router waits for its final answer that long and
``OUTCOME_DEADLINE_S`` more (SentAction.outcome_due), before and after a router restart.
Before, the router expired any action ``OUTCOME_DEADLINE_S`` (120 s) after it sent it (or
after the restart that restored it): a Prefetch of ``deadline_s=300`` still waiting on the
worker ended ``expired`` at 120 s, and its real answer at 300 s came as another router's
(``foreign_hint_messages{kind="outcome"}``); an agent could meanwhile send its id again
(no longer pending), which replaced the waiting Prefetch on the worker.

End to end: the real router app, its SQLite store and NATS, and the real plugin's
HintCore on vLLM's real Scheduler and block pool answering w0's hints (the test carries
w0's hints to it and its outcomes back, on the plugin's own clock, moved on; w0's
heartbeat is played, as in the other service tests). The router's later ticks are its
dispatcher's ``expire`` called at a later time."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_on_nats, plugin_registered, until
from kvhint.engine_plugin.headless import HeadlessSchedulerSpec, build_scheduler
from kvhint.router.policy import PlannerConfig
from kvhint.router.service.hint_dispatch import OUTCOME_DEADLINE_S, HintDispatcher, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

BS = 32


def _prefetch(hashes: list[int], deadline_s: float, action_id: str) -> dict:
    """An agent's Prefetch of blocks no engine has (it waits for them until its deadline)."""
    return {"actions": [{"action_type": "kv.prefetch", "action_id": action_id,
                         "payload": {"target": {"block_hashes": hashes},
                                     "deadline_s": deadline_s}}], "wait_s": 1}


def _count(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.hints.labels("kv.prefetch", outcome, "api")._value.get()


async def test_a_prefetch_waiting_past_the_outcome_deadline_gets_its_answer(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}))
    core = h.connector.core
    plugin_now = [time.time()]
    core.use_clock(lambda: plugin_now[0])
    nc = await nats.connect(nats_url)

    answer = await plugin_on_nats(nc, subjects, core)
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, hints={"enabled": False})
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects, core.supported_actions())
            turn = await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "session_id": "s1",
                "messages": [{"role": "user", "content": "s1: " + "x" * 400}]})
            assert turn.status_code == 200, turn.text
            ids = []
            for name, hashes, deadline_s in (("short", [901, 902, 903], 300),
                                             ("long", [911, 912], 600)):
                sent = await client.post(f"{router.url}/v1/sessions/s1/hints",
                                         json=_prefetch(hashes, deadline_s, name))
                assert sent.status_code == 202, sent.text
                (action,) = sent.json()["actions"]
                assert action["status"] == "deferred", action
                ids.append(action["action_id"])
            short_id, long_id = ids
            short = runtime.hints.pending[short_id]
            # The router's tick 200 s on: both still wait on the worker, and here.
            # Before: both expired ("no terminal outcome within 120s").
            assert runtime.hints.expire(time.time() + 200) == 0
            assert set(runtime.hints.pending) == {short_id, long_id}
            assert short.status == "deferred"
            # Sent again meanwhile, the id is still the pending action (409): it does not
            # go out again to replace the waiting Prefetch on the worker.
            again = await client.post(f"{router.url}/v1/sessions/s1/hints",
                                      json=_prefetch([901, 902, 903], 300, "short"))
            assert again.status_code == 409, again.text
        # The router restarts (its store and the outcome stream's cursor kept) while both
        # still wait on the worker: restored, each waits as long again.
        async with running_router(settings) as router:
            runtime, metrics = router.runtime, router.runtime.metrics
            await plugin_registered(runtime, nc, subjects, core.supported_actions())
            assert set(runtime.hints.pending) == {short_id, long_id}
            assert runtime.hints.expire(time.time() + 200) == 0
            # The plugin's deadline for the short one passes: its final answer comes and
            # is this router's (not expired, not another router's).
            plugin_now[0] += 301
            (outcome,) = core.advance()
            assert (outcome.action_id, outcome.status.value) == (short_id, "missing")
            await answer([outcome])
            await until(lambda: short_id not in runtime.hints.pending)
            (record,) = [a for a in runtime.hints.recent if a.action_id == short_id]
            assert record.status == "missing", record
            assert (_count(metrics, "missing"), _count(metrics, "expired")) == (1, 0)
            assert 'foreign_hint_messages_total{kind="outcome"}' not in \
                metrics.render().decode()
            # Never answered, the long one waits OUTCOME_DEADLINE_S past its deadline
            # (counted from its send), no longer.
            long = runtime.hints.pending[long_id]
            due = long.created_at + 600 + OUTCOME_DEADLINE_S
            assert runtime.hints.expire(due - 1) == 0
            assert runtime.hints.expire(due + 1) == 1
            assert (long.status, long.reason) == (
                "expired", "no terminal outcome within 120s past its deadline_s=600")
            assert _count(metrics, "expired") == 1
    finally:
        await nc.drain()
        h.connector.shutdown()


def test_a_restarted_engine_is_not_waited_for_until_its_prefetchs_deadline() -> None:
    """A new engine epoch (the worker's engine restarted) forgot the Prefetches it had
    waiting and never answers them: each is waited for OUTCOME_DEADLINE_S from then, not
    until its own deadline (the router's clock injected; the action restored from its
    stored row, the path a router restart takes)."""
    now = [1_000_000.0]
    registry = WorkerRegistry([("w0", "http://w0")])
    hints = HintDispatcher(None, Subjects("t"), registry, None, RouterMetrics(),
                           PlannerConfig(), seed=1, clock=lambda: now[0])
    row = SentAction(action_id="kva-p", message_id="m", worker_id="w0", tenant="default",
                     session_id="s1", action_type="kv.prefetch", source="api",
                     trigger="api", payload={"target": {"block_hashes": [1, 2]},
                                             "deadline_s": 3600.0},
                     status="deferred", created_at=now[0], updated_at=now[0],
                     requested_blocks=2, scope="prefetch:default/s1",
                     expires_at=now[0] + 3600).row()
    hints.restore([], [row])
    assert hints.expire(now[0] + 1000) == 0  # still waiting on its (old) engine
    now[0] += 10
    hints.reset_worker("w0")
    assert hints.expire(now[0] + OUTCOME_DEADLINE_S - 1) == 0
    assert hints.expire(now[0] + OUTCOME_DEADLINE_S + 1) == 1
    (record,) = hints.recent
    assert record.status == "expired" and "engine restart" in record.reason
