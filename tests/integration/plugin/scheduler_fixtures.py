"""Helpers for the plugin tests on vLLM's real Scheduler and block pool (no model): a
headless scheduler with the connector loaded by module path, exactly as a server loads it,
and turns and hints applied through the connector's PluginCore."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import nats

from kvhint.engine_plugin.config import LOGGER_NAME
from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.schemas import (
    HintOutcome,
    HintOwner,
    KvHintsEnvelope,
    PinPayload,
    RetainPayload,
    Subjects,
    Target,
    encode_hints,
    make_action,
)

BS = 32
_ids = itertools.count(1)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def plugin_log_lines() -> Iterator[list[str]]:
    """The plugin's INFO-and-up log lines while the block runs (vLLM's loggers do not
    propagate to the root, so caplog does not see them)."""
    log = logging.getLogger(LOGGER_NAME)
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def sched(num_blocks: int = 64, **extra: Any) -> HeadlessScheduler:
    config = {"worker_id": "w0", **extra}
    return build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=num_blocks, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config=config))


@contextmanager
def nats_plugin(nats_url: str, prefix: str, **extra: Any) -> Iterator[HeadlessScheduler]:
    """A headless scheduler whose plugin talks to NATS at ``nats_url`` as worker w0 (a
    heartbeat every 0.2 s), shut down on exit. The tests step the engine by hand, slower
    than a real one: no ``deferred`` answers unless asked (``defer_after_s``)."""
    config = {"worker_id": "w0", "nats_url": nats_url, "subject_prefix": prefix,
              "heartbeat_interval_s": 0.2, "defer_after_s": 5.0, **extra}
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config=config))
    try:
        yield h
    finally:
        h.connector.shutdown()


def empty_blocks_first(pool: Any) -> int:
    """How many free blocks that hold nothing lead ``pool``'s (vLLM's BlockPool) free
    queue: an allocation takes them before any cached block, and the plugin never puts
    cached blocks before them (they cost no hit when taken). A test that wants pressure
    on cached blocks asks for this many blocks more."""
    queue = pool.free_block_queue
    count, block = 0, queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail and block.block_hash is None:
        count, block = count + 1, block.next_free_block
    return count


def prompt(block_ids: list[int], tail: int = 5) -> list[int]:
    return tokens_for_block_ids(block_ids, BS) + [3] * tail


def turn(h: HeadlessScheduler, session: str | None, block_ids: list[int],
         max_tokens: int = 1) -> Any:
    return h.run(h.make_request(prompt(block_ids), session_id=session, max_tokens=max_tokens))


def turn_hit(h: HeadlessScheduler, session: str | None, block_ids: list[int]) -> int:
    """Run a turn; return the prefix-cache tokens vLLM reused for it at admission."""
    request = h.add(h.make_request(prompt(block_ids), session_id=session))
    hits: list[int] = []
    h.step(lambda _: hits.append(request.prefill_stats.num_local_cached_tokens))
    h.run_until_done()
    return hits[0]


def hint(h: HeadlessScheduler, payload: Any, action_id: str | None = None) -> HintOutcome:
    action_id = action_id or f"a{next(_ids)}"
    envelope = KvHintsEnvelope(protocol_version="1", message_id=f"m-{action_id}",
                               actions=[make_action(action_id, payload)])
    (outcome,) = h.connector.core.apply_hints(encode_hints(envelope))
    return outcome


def owned_retain(h: HeadlessScheduler, session: str, priority: int, owner: HintOwner,
                 action_id: str | None = None) -> HintOutcome:
    """A Retain of ``session`` for ``owner`` (10 minutes)."""
    return hint(h, RetainPayload(target=Target(session_id=session), priority=priority,
                                 ttl_s=600, owner=owner), action_id)


def retained_of(h: HeadlessScheduler, session: str) -> int:
    """How many of ``session``'s blocks the plugin retains now."""
    core = h.connector.core
    retained = set(core.executor.holds.keys()["retained"])
    return len(retained.intersection(core.index.session_blocks(session)))


def cached_tokens(h: HeadlessScheduler, block_ids: list[int]) -> int:
    """What a new request with this prefix would hit (side-effect free lookup)."""
    _, hit, _ = h.kv_cache_manager.get_computed_blocks(h.make_request(prompt(block_ids)))
    return hit


def flood(h: HeadlessScheduler, requests: int, first_id: int = 10_000) -> None:
    for i in range(requests):
        base = first_id + 10 * i
        turn(h, f"filler-{i}", [base, base + 1, base + 2, base + 3])


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Returns once ``predicate()`` holds; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def step_until(h: HeadlessScheduler, predicate: Callable[[], bool],
                     timeout_s: float = 10.0) -> None:
    """Step the scheduler like an awake engine until ``predicate`` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        h.step()
        await asyncio.sleep(0.01)


def pin_message(action_id: str, session: str = "s", message_id: str | None = None) -> bytes:
    """A hints message (the router's side of the wire) pinning ``session`` for 30 s."""
    return encode_hints(KvHintsEnvelope(
        protocol_version="1", message_id=message_id or f"m-{action_id}",
        actions=[make_action(action_id, PinPayload(target=Target(session_id=session), ttl_s=30))]))


async def collect(nc: Any, subject: str) -> asyncio.Queue:
    """A queue of the messages the NATS client ``nc`` receives on ``subject`` from now."""
    queue: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        await queue.put(msg)

    await nc.subscribe(subject, cb=on_msg)
    return queue


@asynccontextmanager
async def nats_client(url: str) -> AsyncIterator[Any]:
    """A NATS client on ``url`` (the test's side of the wire: the router's hints it sends,
    the plugin's messages it reads), drained at the end."""
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.drain()


@asynccontextmanager
async def events_stream_reader(nats_url: str, subjects: Subjects
                               ) -> AsyncIterator[tuple[Any, Any]]:
    """A NATS client and its JetStream context, for a test that reads what a plugin under
    ``subjects`` published; at the end, that events stream (the plugin made it) is deleted
    and the client drained."""
    async with nats_client(nats_url) as nc:
        js = nc.jetstream()
        try:
            yield nc, js
        finally:
            await js.delete_stream(subjects.events_stream)
