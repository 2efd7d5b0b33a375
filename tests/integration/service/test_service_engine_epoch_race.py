"""A hint that reaches a worker's new engine before the router has heard that engine's
first heartbeat is the new engine's: the reset of the worker at that heartbeat (a new
epoch: HintDispatcher.reset_worker) must not forget it.

- Answered before the heartbeat (the answer's ``at``, the worker's clock, at or after the
  new epoch's start): its holding stays, its row is not marked ``reset``.
- Still waiting at the heartbeat: let go then (which engine has it is not known yet),
  but the new engine's answer brings its holding back.
- An older engine's late answer (``at`` before the new epoch's start) brings nothing
  back: that engine's holds went with it.

Before, the reset forgot all three, though the new engine held the first two: the
worker's and tenant's budgets believed that room free until the next protection.

End to end: the real router app and NATS; the engines are the real plugin core on vLLM's
real KVCacheManager (the test carries w0's hints to the engine it names and the outcomes
back; heartbeats are played, as in the other service tests)."""

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


def _engine(epoch_start: float, clock_behind_s: float = 0.0
            ) -> tuple[PluginCore, list[int]]:
    """A plugin core over a real KVCacheManager, started at ``epoch_start``, with four
    blocks of one prompt cached (their hashes, root first)."""
    cache = build_kv_cache_manager(block_size=BS, num_blocks=64)
    core = PluginCore.attach(
        cache.manager, PluginConfig(worker_id="w0", retain_budget_fraction=0.5),
        clock=lambda: time.time() - clock_behind_s,
        identity=EngineIdentity(worker_id="w0", epoch=new_epoch(epoch_start)))
    request = cache.make_request(list(range(100, 100 + 4 * BS + 1)), session_id="p")
    assert cache.admit(request) is not None
    cache.finish(request)
    core.sync()
    return core, core.index.session_blocks("p")


async def test_a_reset_keeps_what_the_new_engine_was_sent_before_it_was_heard(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    # The old engine started a minute ago; the new one now (its clock the same host's).
    old_engine, _ = _engine(time.time() - 60, clock_behind_s=30)
    engine, hashes = _engine(time.time())
    nc = await nats.connect(nats_url)
    received: list[bytes] = []

    async def on_hints(msg: nats.aio.msg.Msg) -> None:
        received.append(msg.data)

    await nc.subscribe(subjects.hints("w0"), cb=on_hints)

    async def answer(core: PluginCore) -> None:
        """``core`` takes the hints w0 was sent since the last call and answers them."""
        for data in received:
            for outcome in core.apply_hints(data):
                await nc.publish(subjects.outcomes("w0"), encode_outcome(outcome))
        received.clear()

    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, hints={"enabled": False})
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            hints, ledger = runtime.hints, runtime.hints.holdings
            assert await runtime.link.wait_set_up(10)
            actions = engine.supported_actions()
            await nc.publish(subjects.status("w0"),
                             status("w0", old_engine.identity.epoch, 0, actions=actions))
            await until(lambda: runtime.workers.get("w0").plugin_alive)
            turn = await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "session_id": "s1",
                "messages": [{"role": "user", "content": "hello " * 50}]})
            assert turn.status_code == 200, turn.text

            async def send(action_id: str, action_type: str, payload: dict) -> dict:
                before = len(received)
                sent = await client.post(f"{router.url}/v1/sessions/s1/hints", json={
                    "actions": [{"action_type": action_type, "action_id": action_id,
                                 "payload": payload}], "wait_s": 0})
                assert sent.status_code in (200, 202), sent.text
                await until(lambda: len(received) == before + 1)
                return sent.json()["actions"][0]

            # The old engine is gone, the new one took w0's hints subject, unheard yet.
            pin = await send("pin", "kv.pin", {"target": {"block_hashes": hashes[:2]},
                                               "ttl_s": 600})
            await answer(engine)
            await until(lambda: pin["action_id"] not in hints.pending)
            assert ledger.worker("w0") == Holdings(2, 0)
            retain = await send("retain", "kv.retain", {
                "target": {"block_hashes": hashes[2:]}, "priority": 50, "ttl_s": 600})
            late = await send("late", "kv.retain", {
                "target": {"block_hashes": hashes[:1]}, "priority": 40, "ttl_s": 600})
            late_hints = received.pop()  # held back: the old engine answers it, late
            # (The late one's block is pinned already: counted once, as pinned.)
            assert ledger.worker("w0") == Holdings(2, 2)

            # The new engine's first heartbeat: the router resets w0.
            await nc.publish(subjects.status("w0"),
                             status("w0", engine.identity.epoch, 1, actions=actions))
            await until(lambda: runtime.workers.get("w0").status.epoch
                        == engine.identity.epoch)
            # Before: Holdings() (the answered Pin forgotten too).
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(2, 0)
            (record,) = [r for r in hints.recent if r.action_id == pin["action_id"]]
            assert record.release_reason is None, record

            # The new engine answers the Retain it was sent: its holding comes back.
            await answer(engine)
            await until(lambda: retain["action_id"] not in hints.pending)
            assert (engine.executor.pinned_blocks, engine.executor.retained_blocks) == (2, 2)
            # Before: Holdings(2, 0) (and, before the keep above, Holdings()).
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(2, 2)
            (record,) = [r for r in hints.recent if r.action_id == retain["action_id"]]
            assert (record.status, record.release_reason) == ("accepted", None), record

            # The old engine's late answer (given before the new engine started) brings
            # nothing back: what it held went with it.
            received.append(late_hints)
            await answer(old_engine)
            await until(lambda: late["action_id"] not in hints.pending)
            (record,) = [r for r in hints.recent if r.action_id == late["action_id"]]
            assert (record.status, record.release_reason) == ("accepted", "reset"), record
            assert late["action_id"] not in ledger
            assert ledger.worker("w0") == Holdings(2, 2)
    finally:
        await nc.drain()
