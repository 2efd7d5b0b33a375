"""RoutingService hashes long prompts on one kind of queue, the runtime's FairHashQueue
(per-tenant queues, bounded): there is no second, FIFO executor path that tests and
benchmarks exercised instead of the live one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvhint.router.hashing import PromptHashes
from kvhint.router.service.hash_queue import FairHashQueue
from kvhint.router.service.inbound import Endpoint, parse_inbound

from tests.unit.service.test_service_planning import TENANT, build


def test_a_plain_executor_is_refused_and_the_fair_queue_hashes_long_prompts() -> None:
    """Before, any Executor was taken (and run FIFO, without the per-tenant bound): a
    test or a benchmark passing one measured a path the router never runs."""
    routing = build(["w0", "w1"])[-1]
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        with pytest.raises(TypeError, match="FairHashQueue"):
            dataclasses.replace(routing, hash_executor=pool)
    finally:
        pool.shutdown()

    threads: list[str] = []

    class Hasher:
        def hash_chat(self, body, config):  # noqa: ANN001
            threads.append(threading.current_thread().name)
            return PromptHashes(tuple(range(40)), tuple(range(1, 11)), 4)

    queue = FairHashQueue(threads=1, thread_name_prefix="kvhint-hash")
    routing = dataclasses.replace(routing, hasher=Hasher(), hash_executor=queue,
                                  hash_thread_min_tokens=0)
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}
    inbound = parse_inbound(Endpoint.CHAT, json.dumps(body).encode(), TENANT, None, None)
    try:
        assert asyncio.run(routing.plan(inbound, None, 0)).exact
    finally:
        queue.shutdown()
    assert [t.startswith("kvhint-hash") for t in threads] == [True]
