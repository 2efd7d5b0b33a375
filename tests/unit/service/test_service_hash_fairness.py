"""The prompt-hashing threads are shared fairly across tenants (security review:
head-of-line blocking): one tenant's burst of long prompts delays another tenant's
hashing by about one job, not by the whole burst; a tenant's backlog is bounded
(``routing.hash_queue_per_tenant``), the excess routed without hashes and counted.

The hasher here is a stub that sleeps: fairness is an ordering of jobs in time, and a
real tokenizer's time per prompt varies with the machine's load (two shared cores), so
the stub gives each job a fixed, known length. Everything else (routing, parsing, the
queue, the threads) is the router's own."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

from kvhint.router.hashing import PromptHashes
from kvhint.router.service.hash_queue import FairHashQueue, TenantQueueFull
from kvhint.router.service.inbound import Endpoint, InboundRequest, parse_inbound
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import Tenant

from tests.unit.service.test_service_planning import build

JOB_S = 0.1
A = Tenant("a", None, TenantBudget())
B = Tenant("b", None, TenantBudget())


class _SlowHasher:
    """Hashes every prompt in JOB_S; records which tenant's job finished when."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self.started = threading.Event()

    def hash_chat(self, body, config):  # noqa: ANN001
        self.started.set()
        time.sleep(JOB_S)
        self.finished.append(body["messages"][0]["content"][0])
        return PromptHashes(tuple(range(40)), tuple(range(1, 11)), 4)


def _chat(tenant: Tenant) -> InboundRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": tenant.name * 50}]}
    return parse_inbound(Endpoint.CHAT, json.dumps(body).encode(), tenant, None, None)


def _routing(hasher: _SlowHasher, executor):  # noqa: ANN001, ANN202
    _registry, metrics, _l, _h, _s, _lc, _index, routing = build(["w0", "w1"])
    # Every prompt on the hashing threads (none is short enough to hash inline).
    return metrics, dataclasses.replace(routing, hasher=hasher, hash_executor=executor,
                                        hash_thread_min_tokens=0)


async def test_one_tenants_burst_delays_another_by_about_one_job() -> None:
    hasher = _SlowHasher()
    queue = FairHashQueue(threads=1, per_tenant=64)
    _metrics, routing = _routing(hasher, queue)
    try:
        burst = [asyncio.ensure_future(routing.plan(_chat(A), None, 0)) for _ in range(8)]
        await asyncio.to_thread(hasher.started.wait, 5)  # A's first job is running
        started = time.monotonic()
        alone = await routing.plan(_chat(B), None, 0)
        waited = time.monotonic() - started
        plans = await asyncio.gather(*burst)
    finally:
        queue.shutdown(wait=True)
    assert alone.exact and all(plan.exact for plan in plans)
    # B's one job ran right after the A job that was running when it came: not after
    # the eight of them (FIFO: position 8).
    assert hasher.finished.index("b") <= 1, hasher.finished
    assert waited < 5 * JOB_S, waited  # FIFO: about 8 * JOB_S


async def test_a_tenant_over_its_queue_bound_is_routed_without_hashes_and_counted() -> None:
    hasher = _SlowHasher()
    queue = FairHashQueue(threads=1, per_tenant=3)
    metrics, routing = _routing(hasher, queue)
    try:
        first = asyncio.ensure_future(routing.plan(_chat(A), None, 0))
        await asyncio.to_thread(hasher.started.wait, 5)
        # One running, three waiting: the other four are over A's bound.
        rest = asyncio.gather(*(routing.plan(_chat(A), None, 0) for _ in range(7)))
        plans = [*await rest, await first]
        other = await routing.plan(_chat(B), None, 0)
    finally:
        queue.shutdown(wait=True)
    assert sum(plan.exact for plan in plans) == 4, [plan.exact for plan in plans]
    assert all(plan.block_hashes == () for plan in plans if not plan.exact)
    assert other.exact  # B has a bound of its own
    assert ('kvhint_router_drops_total{what="prompt_hashing:tenant_queue_full"} 4.0'
            in metrics.render().decode())


def test_a_lone_tenant_uses_every_thread_and_rounds_alternate() -> None:
    release = threading.Event()
    running: list[str] = []

    def job(name: str) -> str:
        running.append(name)
        release.wait(5)
        return name

    queue = FairHashQueue(threads=2, per_tenant=8)
    try:
        first = [queue.submit("a", job, f"a{i}") for i in range(4)]
        deadline = time.monotonic() + 5
        while len(running) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(running) == ["a0", "a1"]  # both threads on the only tenant
        later = [queue.submit("b", job, "b0"), queue.submit("c", job, "c0")]
        assert queue.waiting("a") == 2
        release.set()
        assert [f.result(5) for f in first + later] == ["a0", "a1", "a2", "a3", "b0", "c0"]
        # The two waiting tenants came before A's third and fourth jobs.
        assert set(running[2:4]) == {"b0", "c0"}, running
    finally:
        queue.shutdown(wait=True)
    try:
        queue.submit("a", job, "late")
    except RuntimeError:
        pass
    else:
        raise AssertionError("a shut-down queue took a job")


def test_a_full_tenant_queue_refuses_and_cancelled_jobs_never_run() -> None:
    gate = threading.Event()
    ran: list[int] = []

    def job(n: int) -> None:
        gate.wait(5)
        ran.append(n)

    queue = FairHashQueue(threads=1, per_tenant=2)
    try:
        futures = [queue.submit("a", job, 0)]
        deadline = time.monotonic() + 5
        while queue.waiting("a") and time.monotonic() < deadline:
            time.sleep(0.01)  # job 0 is running
        futures += [queue.submit("a", job, 1), queue.submit("a", job, 2)]
        try:
            queue.submit("a", job, 3)
        except TenantQueueFull:
            pass
        else:
            raise AssertionError("a tenant went over its bound")
        assert futures[1].cancel()
        gate.set()
        futures[2].result(5)
    finally:
        queue.shutdown(wait=True)
    assert ran == [0, 2]
