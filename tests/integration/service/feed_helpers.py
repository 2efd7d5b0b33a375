"""What the router's NATS-side tests publish as w0's plugin: heartbeats, KV events, hold
releases, and a chat turn through the router (wire messages built with the schemas)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
from nats.aio.client import Client as NatsClient
from conftest import router_settings, running_router
from nats.js import api

from kvhint.schemas import (
    Amount,
    BlockStored,
    Budgets,
    HintOutcome,
    HoldRelease,
    HoldsReleased,
    KVEventBatch,
    OutcomeStatus,
    ReleaseReason,
    Subjects,
    Usage,
    WorkerStatus,
    encode_event_batch,
    encode_outcome,
    encode_releases,
    encode_status,
)

@asynccontextmanager
async def router_hearing_nats(tmp_path: Path, nats_url: str, subject_prefix: str
                              ) -> AsyncIterator[tuple[Any, httpx.AsyncClient, NatsClient]]:
    """A router with no configured worker, linked to NATS with its subscriptions in place;
    an HTTP client; and a NATS client to publish as workers' plugins do (drained at the
    end)."""
    nc = await nats.connect(nats_url)
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            assert await router.runtime.link.wait_connected(10)
            await asyncio.sleep(0.3)  # subscriptions in place
            yield router, client, nc
    finally:
        await nc.drain()


async def add_blocking_stream(js: object, subjects: Subjects, prefix: str, kind: str) -> str:
    """A stream of another name that holds the ``kind`` subjects (``events``,
    ``outcomes``, ...): the router's create of its own then fails. Returns its name (the
    test deletes it)."""
    name = f"BLOCK_{prefix.replace('.', '_').upper()}"
    await js.add_stream(api.StreamConfig(  # type: ignore[attr-defined]
        name=name, subjects=[subjects.all_of(kind)], storage=api.StorageType.MEMORY,
        max_bytes=1 << 20))
    return name


ACTIONS = {"kv.pin": ["1.0"], "kv.retain": ["1.0"], "kv.demote": ["1.0"],
           "kv.share": ["1.0"], "kv.prefetch": ["1.0"]}


# What a plugin of this version advertises (owners apart on kv.retain, kv.pin, kv.demote).
ACTIONS_WITH_OWNER = {"kv.pin": ["1.0", "1.1", "1.2"], "kv.retain": ["1.0", "1.1", "1.2"],
                      "kv.demote": ["1.0", "1.2"], "kv.share": ["1.0"], "kv.prefetch": ["1.0"]}


def status(worker: str, epoch: str, seq: int, url: str | None = None,
           actions: dict[str, list[str]] | None = None) -> bytes:
    return encode_status(WorkerStatus(
        worker_id=worker, epoch=epoch, model="tiny", cache_namespace="ns", block_size=32,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions=ACTIONS if actions is None else actions,
        budgets=Budgets(max_pinned_blocks=100, max_pin_ttl_s=600, max_retained_blocks=400,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=512, gpu_blocks_free=400, kv_usage=0.2),
        last_event_seq=seq, interval_s=0.5, at=time.time(), http_url=url))


def stored(hashes: list[int], parent: int | None, session: str | None) -> bytes:
    return encode_event_batch(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[1] * 32 * len(hashes),
        block_size=32, lora_id=None, medium="GPU", lora_name=None, session_id=session)]))


async def until(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def chat(client: httpx.AsyncClient, url: str, session: str, content: str,
               system: str | None = None) -> None:
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "messages": messages, "session_id": session})


async def publish_release(nc, subjects: Subjects, action_id: str,  # noqa: ANN001
                          action_type: str, session: str | None, released: int, left: int,
                          reason: ReleaseReason) -> None:
    """What w0's plugin sends when an accepted action loses ``released`` blocks unasked
    and keeps ``left`` (32-token blocks)."""
    await nc.publish(subjects.releases("w0"), encode_releases(HoldsReleased(
        worker_id="w0", at=time.time(), releases=[HoldRelease(
            action_id=action_id, action_type=action_type, session_id=session, reason=reason,
            released=Amount(released, 32 * released), held=Amount(left, 32 * left))])))


async def publish_accepted(nc, subjects: Subjects, message_id: str,  # noqa: ANN001
                           action_id: str, action_type: str, blocks: int) -> None:
    """w0's plugin accepted the action whole: ``blocks`` (32-token blocks) applied."""
    await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
        message_id=message_id, action_id=action_id, action_type=action_type,
        worker_id="w0", status=OutcomeStatus.ACCEPTED, requested=Amount(blocks, 32 * blocks),
        applied=Amount(blocks, 32 * blocks), at=time.time())))


async def plugin_registered(runtime, nc, subjects: Subjects,  # noqa: ANN001
                            actions: dict[str, list[str]] | None = None) -> None:
    """The router is connected to NATS and has heard w0's plugin (one heartbeat)."""
    assert await runtime.link.wait_connected(10)
    await asyncio.sleep(0.3)
    await nc.publish(subjects.status("w0"), status("w0", "e1", 0, actions=actions))
    await until(lambda: runtime.workers.get("w0").plugin_alive)
