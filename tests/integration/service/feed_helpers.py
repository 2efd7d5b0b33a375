"""What the router's NATS-side tests publish as w0's plugin: heartbeats, KV events, hold
releases, and a chat turn through the router (wire messages built with the schemas); and
w0's plugin played whole, accepting every hint (:class:`AcceptingPlugin`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
from nats.aio.client import Client as NatsClient
from conftest import StubWorker, router_settings, running_router
from nats.js import api
from nats.js.errors import NotFoundError

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
    decode_hints,
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
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await router.runtime.link.wait_set_up(10)
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


@asynccontextmanager
async def router_beside_blocking_stream(
        tmp_path: Path, nats_url: str, subject_prefix: str, kind: str
        ) -> AsyncIterator[tuple[Any, NatsClient, Any, str]]:
    """A router with no configured worker, started while a stream of another name holds
    its ``kind`` subjects (:func:`add_blocking_stream`); a NATS client and its JetStream
    context; and that stream's name. At the end the stream is deleted (unless the test
    did) and the client drained."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    blocker = await add_blocking_stream(js, subjects, subject_prefix, kind)
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router:
            yield router, nc, js, blocker
    finally:
        try:
            await js.delete_stream(blocker)
        except NotFoundError:
            pass
        await nc.drain()


ACTIONS = {"kv.pin": ["1.0"], "kv.retain": ["1.0"], "kv.demote": ["1.0"],
           "kv.share": ["1.0"], "kv.prefetch": ["1.0"]}


# What a plugin of this version advertises (owners apart on kv.retain, kv.pin, kv.demote,
# kv.prefetch).
ACTIONS_WITH_OWNER = {"kv.pin": ["1.0", "1.1", "1.2"], "kv.retain": ["1.0", "1.1", "1.2"],
                      "kv.demote": ["1.0", "1.2"], "kv.share": ["1.0"],
                      "kv.prefetch": ["1.0", "1.2"]}


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
    # Set up: wait_connected comes before the subscriptions and streams.
    assert await runtime.link.wait_set_up(10)
    await nc.publish(subjects.status("w0"), status("w0", "e1", 0, actions=actions))
    await until(lambda: runtime.workers.get("w0").plugin_alive)


async def plugin_on_nats(nc, subjects: Subjects, core,  # noqa: ANN001 - NATS, PluginCore
                         worker_id: str = "w0"
                         ) -> Callable[[Iterable[HintOutcome]], Awaitable[None]]:
    """The real plugin ``core`` on ``worker_id``'s subjects, as its NATS transport puts
    it: each hints message applied (``core.apply_hints``), its outcomes published. Returns
    what publishes the outcomes a test has the core settle itself (``core.advance()``)."""

    async def answer(outcomes: Iterable[HintOutcome]) -> None:
        for outcome in outcomes:
            await nc.publish(subjects.outcomes(worker_id), encode_outcome(outcome))

    async def on_hints(msg: Any) -> None:  # noqa: ANN401 - a NATS message
        await answer(core.apply_hints(msg.data))

    await nc.subscribe(subjects.hints(worker_id), cb=on_hints)
    return answer


class AcceptingPlugin:
    """w0's plugin as a test plays it: every claim accepted with 2 blocks, a release
    (priority 0) holding none; ``answer`` False: it takes hints and answers none.
    ``received``: the (action id, payload) of every action w0 was sent, in order."""

    def __init__(self, nc: NatsClient, subjects: Subjects, answer: bool = True) -> None:
        self.nc, self.subjects, self.answer = nc, subjects, answer
        self.received: list[tuple[str, Any]] = []

    @property
    def action_ids(self) -> list[str]:
        return [action_id for action_id, _ in self.received]

    async def on_hints(self, msg: Any) -> None:  # noqa: ANN401 - a NATS message
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            self.received.append((action.action_id, action.payload))
            if self.answer:
                releases = getattr(action.payload, "priority", None) == 0
                await publish_accepted(self.nc, self.subjects, decoded.message_id,
                                       action.action_id, action.action_type.value,
                                       0 if releases else 2)


@asynccontextmanager
async def router_with_accepting_plugin(
        tmp_path: Path, nats_url: str, subject_prefix: str, stub: StubWorker,
        actions: dict[str, list[str]] = ACTIONS_WITH_OWNER, answer: bool = True,
        **settings: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient, AcceptingPlugin]]:
    """A router over w0 (``stub``), whose plugin (1.2, or what ``actions``
    advertises) the test plays (:class:`AcceptingPlugin`), heartbeats kept coming (the
    worker stays live while the planner's idle review runs)."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    plugin = AcceptingPlugin(nc, subjects, answer)
    await nc.subscribe(subjects.hints("w0"), cb=plugin.on_hints)

    async def heartbeats() -> None:
        for seq in range(1, 1_000_000):
            await asyncio.sleep(0.25)
            await nc.publish(subjects.status("w0"),
                             status("w0", "e1", seq, actions=actions))

    config = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                             subject_prefix=subject_prefix, **settings)
    beating = None
    try:
        async with running_router(config) as router, \
                httpx.AsyncClient(timeout=30) as client:
            await plugin_registered(router.runtime, nc, subjects, actions)
            beating = asyncio.create_task(heartbeats())
            yield router, client, plugin
    finally:
        if beating is not None:
            beating.cancel()
        await nc.drain()
