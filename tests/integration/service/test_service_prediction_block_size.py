"""A cache prediction is checked (its accuracy metric) and learnt from only when the
prompt was hashed at the block size the worker's own heartbeat gave: against a real NATS
and the real router app, w0's "plugin" (this test publishing wire messages) sends KV
events before its first heartbeat, as a starting worker may."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import chat, status, stored, until
from kvhint.schemas import EventBatchMeta, Subjects, decode_status, encode_status

pytestmark = pytest.mark.usefixtures("throwaway_streams")

_PREDICTED = 'kvhint_router_cached_tokens_actual_total{predicted="%s",worker="w0"}'
_UNHEARD = 'kvhint_router_drops_total{what="cached_prediction_unchecked:block_size_unheard"}'


async def test_a_prediction_before_the_workers_block_size_is_heard_is_not_checked(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """w0's events come first (its stream live, its index view exact) and its heartbeat,
    naming 32-token blocks, later. Until then the router hashes at its ``block_size``
    setting (16): no hash of that can match w0's blocks, so the prediction (nothing
    cached) is not compared with what w0 reports, and the skip is counted. Before, it
    was reported (and learnt from) as exact. Once the heartbeat is heard the prompt is
    hashed at 32 and the prediction checked."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                               subject_prefix=subject_prefix)
    assert settings.block_size == 16

    async def metrics_text(client: httpx.AsyncClient, url: str) -> str:
        return (await client.get(f"{url}/metrics")).text

    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await runtime.link.wait_set_up(10)
            await nc.publish(subjects.events("w0"), stored([1, 2], None, None),
                             headers=EventBatchMeta("w0", "e1", 1).to_headers())
            await until(lambda: runtime.ingestor.view_exact("w0"))
            assert runtime.workers.get("w0").status is None  # no heartbeat yet
            await chat(client, router.url, "early", "x" * 300)
            text = await metrics_text(client, router.url)
            assert _PREDICTED % "false" in text and _PREDICTED % "true" not in text
            assert f"{_UNHEARD} 1.0" in text
            for attempt in range(5):  # a chat within 1.5 heartbeats (0.75 s) of one
                await nc.publish(subjects.status("w0"), status("w0", "e1", 1))
                await nc.flush()
                await until(lambda: runtime.workers.get("w0").status is not None)
                await chat(client, router.url, f"heard{attempt}", "y" * 300)
                if _PREDICTED % "true" in await metrics_text(client, router.url):
                    break
            text = await metrics_text(client, router.url)
            assert _PREDICTED % "true" in text
            assert f"{_UNHEARD} 1.0" in text  # the heartbeat's block size: none since
    finally:
        await nc.drain()


_OTHER = ('kvhint_router_drops_total'
          '{what="cached_prediction_unchecked:hash_config_differs"}')


def _status_seeded(worker: str, seed: str) -> bytes:
    """w's heartbeat (32-token blocks, sha256) with its own NONE_HASH seed."""
    return encode_status(msgspec.structs.replace(
        decode_status(status(worker, "e1", 1)), none_hash_seed=seed))


async def test_a_worker_hashing_with_another_seed_is_not_checked(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """w0 and w1 both give 32-token blocks, but w1 hashes with another NONE_HASH seed (a
    fleet configured apart). The router hashes every prompt as the candidate heard
    first does; w1 holds none of those hashes, so a prediction for w1 is not checked
    against what it reports, and is counted apart from an unheard block size. Before,
    the check compared block sizes only, and w1's predictions (nothing cached) were
    reported and learnt as exact."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url), ("w1", stub_workers[1].url)],
        nats_url=nats_url, subject_prefix=subject_prefix)
    seeds = {"w0": "vllm-none-hash", "w1": "another-seed"}
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await runtime.link.wait_set_up(10)
            for worker in ("w0", "w1"):
                await nc.publish(subjects.events(worker), stored([1, 2], None, None),
                                 headers=EventBatchMeta(worker, "e1", 1).to_headers())
            await until(lambda: all(runtime.ingestor.view_exact(w) for w in seeds))
            landed: dict[str, int] = {"w0": 0, "w1": 0}
            for n in range(40):
                for worker, seed in seeds.items():  # fresh: within 1.5 heartbeats
                    await nc.publish(subjects.status(worker), _status_seeded(worker, seed))
                await nc.flush()
                await until(lambda: all(runtime.workers.get(w).status is not None
                                        for w in seeds))
                answer = await client.post(f"{router.url}/v1/chat/completions", json={
                    "model": "stub", "session_id": f"s{n}",
                    "messages": [{"role": "user", "content": f"{n} " + "z" * 300}]})
                assert answer.status_code == 200
                landed[answer.headers["x-kvhint-worker"]] += 1
                if landed["w0"] and landed["w1"]:
                    break
            assert landed["w0"] and landed["w1"], landed
            text = (await client.get(f"{router.url}/metrics")).text
            assert 'predicted="true",worker="w1"' not in text
            assert _PREDICTED % "true" in text  # w0's, hashed as w0 hashes
            assert f"{_OTHER} {float(landed['w1'])}" in text
            assert _UNHEARD not in text
    finally:
        await nc.drain()
