"""Which engine answered a hint survives a router restart, on SQLite and PostgreSQL: the
store keeps the answer's ``at`` (the worker's clock, ``answered_at``) and, for an action a
worker's new epoch let go while it waited, that epoch's start (``reset_by_engine_at``;
revision 0008), so HintDispatcher.reset_worker decides after a restart as before it.

- A hint the worker's new engine answered before the router heard that engine, and before
  the router restarted: the new epoch, heard after the restart, keeps its holding. Before,
  the restored router knew no answer time and let it go: the budgets believed room free
  that the new engine held.
- A hint that epoch let go while it waited, answered by the new engine after the router
  restarted: its holding comes back. Before, the restored router capped the answer at the
  reset's 0 and held nothing.

End to end: the real router app restarted on the same store and NATS; the engines are
the real plugin core on vLLM's real KVCacheManager (the test carries w0's hints to the
engine it names and the outcomes back; heartbeats are played, as in the other service
tests)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import status, until
from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import EngineIdentity, PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager
from kvhint.router.policy import Holdings
from kvhint.schemas import Subjects, encode_outcome, new_epoch

pytestmark = pytest.mark.usefixtures("throwaway_streams")

BS = 32


def _engine(epoch_start: float) -> tuple[PluginCore, list[int]]:
    """A plugin core over a real KVCacheManager, started at ``epoch_start``, with four
    blocks of one prompt cached (their hashes, root first)."""
    cache = build_kv_cache_manager(block_size=BS, num_blocks=64)
    core = PluginCore.attach(
        cache.manager, PluginConfig(worker_id="w0", retain_budget_fraction=0.5),
        identity=EngineIdentity(worker_id="w0", epoch=new_epoch(epoch_start)))
    request = cache.make_request(list(range(100, 100 + 4 * BS + 1)), session_id="p")
    assert cache.admit(request) is not None
    cache.finish(request)
    core.sync()
    return core, core.index.session_blocks("p")


async def test_a_router_restart_keeps_which_engine_answered(
        tmp_path: Path, database_url: str, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    old_epoch = new_epoch(time.time() - 60)  # the engine w0 had; gone now
    engine, hashes = _engine(time.time())  # the new one, on w0's hints subject
    actions = engine.supported_actions()
    nc = await nats.connect(nats_url)
    received: list[bytes] = []

    async def on_hints(msg: nats.aio.msg.Msg) -> None:
        received.append(msg.data)

    await nc.subscribe(subjects.hints("w0"), cb=on_hints)

    async def answer() -> None:
        """The new engine takes the hints w0 was sent since the last call, answers them."""
        for data in received:
            for outcome in engine.apply_hints(data):
                await nc.publish(subjects.outcomes("w0"), encode_outcome(outcome))
        received.clear()

    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, database_url=database_url, hints={"enabled": False})
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            hints, ledger = runtime.hints, runtime.hints.holdings
            assert await runtime.link.wait_set_up(10)
            await nc.publish(subjects.status("w0"),
                             status("w0", old_epoch, 0, actions=actions))
            await until(lambda: runtime.workers.get("w0").plugin_alive)
            turn = await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "session_id": "s1",
                "messages": [{"role": "user", "content": "hello " * 50}]})
            assert turn.status_code == 200, turn.text

            async def send(action_id: str, action_type: str, payload: dict) -> str:
                before = len(received)
                sent = await client.post(f"{router.url}/v1/sessions/s1/hints", json={
                    "actions": [{"action_type": action_type, "action_id": action_id,
                                 "payload": payload}], "wait_s": 0})
                assert sent.status_code in (200, 202), sent.text
                await until(lambda: len(received) == before + 1)
                return sent.json()["actions"][0]["action_id"]

            pin = await send("pin", "kv.pin", {"target": {"block_hashes": hashes[:2]},
                                               "ttl_s": 600})
            await answer()  # the new engine, not heard yet, answers the Pin
            await until(lambda: pin not in hints.pending)
            retain = await send("retain", "kv.retain", {
                "target": {"block_hashes": hashes[2:]}, "priority": 50, "ttl_s": 600})
            retain_hints = received.pop()  # not answered yet
            assert ledger.worker("w0") == Holdings(2, 2)

        # Restarted before hearing the new engine; then its first heartbeat: a new epoch.
        async with running_router(settings) as router:
            runtime = router.runtime
            hints, ledger = runtime.hints, runtime.hints.holdings
            assert ledger.worker("w0") == Holdings(2, 2)
            assert runtime.workers.get("w0").epoch == old_epoch
            assert await runtime.link.wait_set_up(10)
            await nc.publish(subjects.status("w0"),
                             status("w0", engine.identity.epoch, 1, actions=actions))
            # (Its epoch restored from the store: the old engine's, heard before.)
            await until(lambda: runtime.workers.get("w0").epoch == engine.identity.epoch)
            # The Pin the new engine answered stays; the Retain it has not is let go.
            # Before: Holdings() (the restored Pin's answer time unknown, let go too).
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(2, 0)
            assert hints.pending[retain].release_reason == "reset"

        # Restarted again; the new engine now answers the Retain the reset let go.
        async with running_router(settings) as router:
            runtime = router.runtime
            hints, ledger = runtime.hints, runtime.hints.holdings
            assert ledger.worker("w0") == Holdings(2, 0)
            assert await runtime.link.wait_set_up(10)
            received.append(retain_hints)
            await answer()
            await until(lambda: retain not in hints.pending)
            (record,) = [r for r in hints.recent if r.action_id == retain]
            assert (record.status, record.applied_blocks, record.release_reason) \
                == ("accepted", 2, None), record
            assert (engine.executor.pinned_blocks, engine.executor.retained_blocks) == (2, 2)
            # Before: Holdings(2, 0) (the answer capped at the reset's 0).
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(2, 2)

        # And once more: the store says the same (the Retain's row no longer "reset").
        async with running_router(settings) as router:
            assert router.runtime.hints.holdings.worker("w0") == Holdings(2, 2)
    finally:
        await nc.drain()
