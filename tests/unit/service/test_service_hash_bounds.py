"""Where, and whether, the router hashes a prompt: a body whose text sits where the
estimate does not look (a long ``role``, a million empty messages) must not be tokenized
on the event loop, and a prompt surely longer than the workers take is not tokenized at
all (security review: one 31 MB request stalled /health for 29 s)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

from kvhint.router.hashing import PromptHashes
from kvhint.router.service.hash_queue import FairHashQueue
from kvhint.router.service.inbound import Endpoint, InboundRequest, parse_inbound

from tests.unit.service.test_service_planning import TENANT, build


class _Hasher:
    def __init__(self, tokens: int = 40) -> None:
        self.threads: list[str] = []
        self.tokens = tokens

    def hash_chat(self, body, config):  # noqa: ANN001
        self.threads.append(threading.current_thread().name)
        return PromptHashes(tuple(range(self.tokens)), tuple(range(1, self.tokens // 4 + 1)), 4)


def _chat(messages: list[dict]) -> InboundRequest:
    body = {"model": "m", "messages": messages}
    return parse_inbound(Endpoint.CHAT, json.dumps(body).encode(), TENANT, "s", None)


def _routing(hasher: _Hasher, executor: FairHashQueue, **fields):
    _registry, metrics, _l, _h, _s, _lc, _index, routing = build(["w0", "w1"])
    return metrics, dataclasses.replace(routing, hasher=hasher, hash_executor=executor,
                                        **fields)


def test_text_outside_content_and_many_empty_messages_are_hashed_on_the_thread() -> None:
    hasher = _Hasher()
    executor = FairHashQueue(threads=1)
    _metrics, routing = _routing(hasher, executor)
    long_role = _chat([{"role": "u" * 20_000, "content": ""}])
    empties = _chat([{"role": "u", "content": ""}] * 2_000)
    short = _chat([{"role": "user", "content": "hi"}])
    assert not routing.hash_inline(long_role) and not routing.hash_inline(empties)
    assert routing.hash_inline(short)
    try:
        for inbound in (long_role, empties, short):
            assert asyncio.run(routing.plan(inbound, None, 0)).exact
    finally:
        executor.shutdown()
    assert [t.startswith("kvhint-hash") for t in hasher.threads] == [True, True, False]


def test_a_prompt_surely_over_the_max_length_is_not_hashed_and_is_counted() -> None:
    hasher = _Hasher()
    executor = FairHashQueue(threads=1)
    metrics, routing = _routing(hasher, executor, max_prompt_tokens=1000)
    too_many = _chat([{"role": "u", "content": ""}] * 1001)  # >= 1 token per message
    too_big = _chat([{"role": "user", "content": "x" * 9000}])  # > 8 bytes per token
    try:
        plans = [asyncio.run(routing.plan(i, None, 0)) for i in (too_many, too_big)]
        # Hashed, but the tokenizer says it is longer than the workers take.
        hasher.tokens = 1004
        over = asyncio.run(routing.plan(_chat([{"role": "user", "content": "y"}]), None, 0))
    finally:
        executor.shutdown()
    assert len(hasher.threads) == 1
    assert all(not p.exact and p.block_hashes == () for p in (*plans, over))
    assert ('kvhint_router_drops_total{what="prompt_hashing:over_max_length"} 3.0'
            in metrics.render().decode())
