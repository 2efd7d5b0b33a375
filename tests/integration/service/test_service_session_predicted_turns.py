"""A session's ``predicted_cached_tokens`` (``/admin/sessions``, the dashboard's sessions
table) counts the answered turns' predictions only, as its ``prompt_tokens`` and
``cached_tokens`` count their usage and ``kvhint_router_cached_tokens_predicted_total``
counts the fleet's: against a stub worker (its failure on cue) whose plugin the test
plays on real NATS (a heartbeat, and KV events holding the session's prompt)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import nats

from conftest import StubWorker, router_settings, running_router, sample, scrape
from feed_helpers import status, stored, until
from kvhint.schemas import EventBatchMeta, Subjects

CHAT = {"model": "stub", "max_tokens": 4,
        "messages": [{"role": "user", "content": "read the file and tell me " + "x" * 300}]}
SESSION = {"x-session-id": "agent-1"}


async def test_a_failed_turns_prediction_is_not_the_sessions(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Found in a first-hour review of ``make run``: a turn the worker refused (a 400) was
    predicted a hit and added it to the session's predicted cached tokens at routing,
    though the session's cached tokens (from the usage) never could count it: the
    session read as mispredicted (320 predicted, 288 cached) while the fleet's counters
    agreed (320 and 320)."""
    stub = stub_workers[0]
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            # Set up: wait_connected comes before the subscriptions (a heartbeat then is lost).
            assert await runtime.link.wait_set_up(10)
            url = f"{router.url}/v1/chat/completions"
            # w0's plugin heard (the prompt is hashed as it hashes), then its cache holds
            # the session's first prompt.
            await nc.publish(subjects.status("w0"), status("w0", "e1", 0, stub.url))
            await until(lambda: runtime.workers.get("w0").plugin_alive)
            first = await client.post(url, json=CHAT, headers=SESSION)
            assert first.status_code == 200, first.text
            record = runtime.sessions.get("default", "agent-1")
            hashes = list(record.answered_block_hashes)
            assert len(hashes) >= 2
            await nc.publish(subjects.events("w0"), stored(hashes, None, "default/agent-1"),
                             headers=EventBatchMeta("w0", "e1", 1).to_headers())
            await until(lambda: bool(runtime.index.worker_block_counts("w0")))
            predicted_before = record.predicted_cached_tokens

            async def turn(mode: str) -> int:
                stub.mode = mode
                # A heartbeat within the plugin's interval: the index's view is current.
                await nc.publish(subjects.status("w0"), status("w0", "e1", 1, stub.url))
                await nc.flush()
                await asyncio.sleep(0.05)
                return (await client.post(url, json=CHAT, headers=SESSION)).status_code

            assert await turn("status:400") == 400
            assert record.inflight == 0
            assert record.predicted_cached_tokens == predicted_before
            assert await turn("ok") == 200
            samples = await scrape(client, router.url)
            fleet = sample(samples, "kvhint_router_cached_tokens_predicted_total",
                           worker="w0")
            assert fleet is not None and fleet > 0  # the answered turn was predicted
            assert record.predicted_cached_tokens == predicted_before + fleet
            session = (await client.get(f"{router.url}/admin/sessions/default/agent-1")
                       ).json()
            assert session["predicted_cached_tokens"] == predicted_before + fleet
    finally:
        await nc.drain()
