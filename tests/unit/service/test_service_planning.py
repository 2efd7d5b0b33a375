"""Routing glue, session lifecycle and hint dispatch with the real policy and index;
NATS is replaced by a recording link (tests/integration/service uses a real server)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from kvhint.router.kv_index import BlocksStored, InMemoryClusterKvIndex, KvEventIngestor
from kvhint.router.policy import GapObserved, PlannedAction, PlannerConfig, RoutingConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.inbound import Endpoint, InboundRequest, parse_inbound
from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.metrics_state import StateSample
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.routing_service import RoutePlan, RoutingService
from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.settings_sections import RoutingSettings
from kvhint.router.service.tenancy import Tenant
from kvhint.router.service.workers import HeartbeatVerdict, WorkerRegistry
from kvhint.schemas import (
    Amount,
    Budgets,
    HintOutcome,
    OutcomeStatus,
    PinPayload,
    Subjects,
    Target,
    Usage,
    WorkerStatus,
    decode_hints,
    make_action,
)
from kvhint.schemas.events import EventBatchMeta

TENANT = Tenant("default", None, TenantBudget())
ACTIONS = {t: ["1.0"] for t in ("kv.pin", "kv.retain", "kv.prefetch", "kv.share")}


class RecordingLink:
    """Stands in for NatsLink.publish (the one call the dispatcher makes)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes) -> bool:
        self.sent.append((subject, payload))
        return True


def status(worker: str, epoch: str = "e1") -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker, epoch=epoch, model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash", supported_actions=ACTIONS,
        budgets=Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time())


def build(workers: list[str], budget: TenantBudget | None = None):
    registry = WorkerRegistry([(w, f"http://{w}") for w in workers])
    for worker in workers:
        assert registry.on_heartbeat(status(worker)) is HeartbeatVerdict.FIRST
    metrics = RouterMetrics()
    link = RecordingLink()
    hints = HintDispatcher(link, Subjects("t"), registry, None, metrics, PlannerConfig(),
                           seed=1, budget_of=lambda _tenant: budget)
    sessions = SessionRegistry(None, max_sessions=100)
    lifecycle = SessionLifecycle(sessions, hints, metrics, hints_enabled=True,
                                 forget_after_s=3600)
    index = InMemoryClusterKvIndex()
    routing = RoutingService(registry, metrics, RoutingConfig(), hasher=None,
                             default_block_size=4, index=index)
    return registry, metrics, link, hints, sessions, lifecycle, index, routing


def _plan(routing: RoutingService, inbound: InboundRequest, session_worker: str | None,
          session_turns: int) -> RoutePlan:
    return asyncio.run(routing.plan(inbound, session_worker, session_turns))


def test_single_worker_is_decided_without_hashing_then_completed() -> None:
    _registry, _m, _l, _h, _s, _lc, index, routing = build(["w0"])
    inbound = parse_inbound(Endpoint.COMPLETION, b'{"prompt": [1,2,3,4,5,6,7,8,9]}',
                            TENANT, None, None)
    plan = _plan(routing, inbound, None, 0)
    assert plan.deferred and plan.decision.worker_id == "w0"
    # Without a hasher the completion keeps the estimate (nothing to hash with).
    assert not asyncio.run(routing.complete(plan, inbound)).deferred


def test_overlap_from_the_index_steers_routing() -> None:
    _registry, _m, _l, _h, _s, _lc, index, routing = build(["w0", "w1"])
    index.apply(BlocksStored("w1", [11, 12, 13], None))

    class Hasher:  # the hashing layer's contract: body -> PromptHashes
        def hash_completion(self, body, config, first_only=False):  # noqa: ANN001
            from kvhint.router.hashing import PromptHashes

            return [PromptHashes(tuple(range(14)), (11, 12, 13), 4)]

    routing.hasher = Hasher()  # type: ignore[assignment]
    inbound = parse_inbound(Endpoint.COMPLETION, b'{"model": "m", "prompt": "x"}', TENANT,
                            None, None)
    plan = _plan(routing, inbound, None, 0)
    assert plan.decision.worker_id == "w1"
    assert plan.predicted_for("w1") == 12 and plan.decision.fallbacks == ("w0",)


def test_tool_gap_pins_and_outcomes_feed_back() -> None:
    registry, metrics, link, hints, sessions, lifecycle, _index, _routing = build(["w0"])

    # The router has learned that "search" answers in about two seconds.
    hints.observe([GapObserved("search", 1, 2.0)] * 20, "default")
    seen_kinds: list[str] = []

    async def scenario() -> None:
        record = lifecycle.begin_turn("default", "s1")
        await lifecycle.routed(record, "w0", prompt_tokens=400, predicted_cached=0,
                               block_hashes=())
        observed = ResponseObservation(finish_reason="tool_calls", tool_names=["search"],
                                       prompt_tokens=400, completion_tokens=8, cached_tokens=0)
        await lifecycle.finished(record, "w0", observed, session_end=False)
        assert record.state == "tool_gap" and record.open_gap["tools"] == ["search"]
        subject, payload = link.sent[-1]
        assert subject == "t.v1.hints.w0"
        decoded = decode_hints(payload)
        action = decoded.actions[0]
        # The planner protects the session for the gap (which of Pin/Retain is its call).
        kind = action.action_type.value
        assert kind in ("kv.pin", "kv.retain")
        assert action.payload.target.session_id == "default/s1"
        seen_kinds.append(kind)
        # The worker clips it: recorded, counted, fed back (a clipped pin shrinks the pin room).
        record_action = hints.on_outcome(HintOutcome(
            message_id=decoded.message_id, action_id=action.action_id, action_type=kind,
            worker_id="w0", status=OutcomeStatus.CLIPPED, reason="budget",
            requested=Amount(100, 400), applied=Amount(25, 100), at=time.time()))
        assert record_action.status == "clipped" and not hints.pending
        if kind == "kv.pin":
            assert hints.feedback["w0"].view("default").pin_ask_scale < 1.0
        assert hints.on_outcome(HintOutcome(
            message_id="m", action_id="unknown", worker_id="w0",
            status=OutcomeStatus.ACCEPTED, at=time.time())) is None
        # The next turn closes the gap; the end releases.
        await asyncio.sleep(0.01)
        record = lifecycle.begin_turn("default", "s1")
        assert record.gaps[-1]["tools"] == ["search"]
        await lifecycle.routed(record, "w0", 420, 400, ())
        await lifecycle.end(record)
        assert record.state == "ended" and record.plan.ended

    asyncio.run(scenario())
    text = metrics.render().decode()
    assert (f'kvhint_router_hints_total{{action="{seen_kinds[0]}",outcome="clipped",'
            'source="planner"} 1.0') in text
    # Not a drop: another router replica's action, normal in a fleet of routers.
    assert 'kvhint_router_foreign_hint_messages_total{kind="outcome"} 1.0' in text
    assert "kvhint_router_drops_total{" not in text


def test_hints_without_nats_are_failed_and_counted() -> None:
    registry, metrics, _link, _hints, sessions, _lc, _index, _routing = build(["w0"])
    hints = HintDispatcher(None, Subjects("t"), registry, None, metrics, PlannerConfig(), seed=1)
    lifecycle = SessionLifecycle(sessions, hints, metrics, True, 3600)

    async def scenario() -> None:
        record = lifecycle.begin_turn("default", "s2")
        await lifecycle.routed(record, "w0", 400, 0, ())
        await lifecycle.finished(record, "w0", ResponseObservation(
            finish_reason="tool_calls", tool_names=["x"], prompt_tokens=400,
            completion_tokens=1, cached_tokens=0), session_end=False)

    asyncio.run(scenario())
    assert hints.status_counts.get("failed") == 1 and not hints.pending
    # The planner does not count the unsent protection as held: its next review asks again.
    record = sessions.get("default", "s2")
    assert record is not None and record.plan.awaiting_return
    assert record.plan.protection is None
    assert 'kvhint_router_drops_total{what="hint_unsent"} 1.0' in metrics.render().decode()


def test_the_lifecycle_retains_a_prefix_shared_by_live_sessions_once_per_retain() -> None:
    registry, metrics, link, hints, sessions, lifecycle, _index, _routing = build(["w0"])
    system = (101, 102, 103, 104)  # four blocks every session starts with
    for number in range(4):
        record = sessions.open("default", f"s{number}", time.time())
        record.worker_id = "w0"
        record.last_block_hashes = (*system, 1000 + number, 2000 + number)
    other = sessions.open("other", "x", time.time())  # another tenant: never pooled
    other.worker_id, other.last_block_hashes = "w0", system
    asyncio.run(lifecycle.tick())
    payloads = [decode_hints(p).actions[0] for _s, p in link.sent]
    retains = [a for a in payloads if a.payload.target.block_hashes == list(system)]
    assert len(retains) == 1 and retains[0].action_type.value == "kv.retain"
    asyncio.run(lifecycle.tick())  # within the scan period and still protected: no repeat
    assert len(link.sent) == len(payloads)


def test_balance_floor_keeps_new_work_on_its_cached_prefix_at_low_load() -> None:
    """At low load one 484-token prompt puts a worker 8% over the mean. A session cached
    there stays anyway (the policy's margin: moving would recompute more than the excess);
    new work sharing that cached prefix needs the floor to stay with it."""
    from kvhint.router.hashing import PromptHashes

    class Hasher:
        def hash_chat(self, body, config):  # noqa: ANN001
            return PromptHashes(tuple(range(484)), tuple(range(1, 16)), 32)

    _registry, _m, _l, _h, _s, _lc, index, routing = build(["w0", "w1"])
    routing.hasher = Hasher()  # type: ignore[assignment]
    index.apply(BlocksStored("w0", list(range(1, 16)), None))
    routing.dispatched("w0", uncached_tokens=484, prompt_tokens=484, block_size=32)
    routing.finished("w0", 484, 32, 0)
    inbound = parse_inbound(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user"}]}',
                            TENANT, "s", None)
    routing.config = dataclasses.replace(routing.config, balance_floor_tokens=0.0)
    assert _plan(routing, inbound, "w0", 1).decision.worker_id == "w0"
    # The policy's hot-spot cap alone: 484 tokens are "8% over the mean" -> the idle worker.
    assert _plan(routing, inbound, None, 0).decision.worker_id == "w1"
    routing.config = dataclasses.replace(routing.config, balance_floor_tokens=16384.0)
    assert _plan(routing, inbound, None, 0).decision.worker_id == "w0"
    assert _plan(routing, inbound, "w0", 1).decision.worker_id == "w0"


def test_new_sessions_spread_over_workers_despite_a_shared_prefix_when_configured() -> None:
    from kvhint.router.hashing import PromptHashes

    class Hasher:
        def hash_chat(self, body, config):  # noqa: ANN001
            return PromptHashes(tuple(range(700)), tuple(range(1, 22)), 32)

    _registry, _m, _l, _h, _s, _lc, index, routing = build(["w0", "w1"])
    routing.hasher = Hasher()  # type: ignore[assignment]
    # Off by default (routing.new_session_spread in the router's settings); switched on.
    routing.config = dataclasses.replace(routing.config, new_session_spread=1.0)
    index.apply(BlocksStored("w0", list(range(1, 13)), None))  # the system prompt, on w0

    def first_turn(session: str) -> str:
        inbound = parse_inbound(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user"}]}',
                                TENANT, session, None)
        return _plan(routing, inbound, None, 0).decision.worker_id

    assert [first_turn(f"s{i}") for i in range(4)] == ["w0", "w1", "w0", "w1"]


async def two_turns(lifecycle: SessionLifecycle, session: str, predicted: int,
                    exact: bool) -> None:
    """A session's first turn (400 prompt tokens, 10 out), then its second routed to the
    same worker with ``predicted`` of its 440 tokens cached (408: the whole first turn,
    its response included)."""
    record = lifecycle.begin_turn("default", session)
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", ResponseObservation(
        finish_reason="stop", tool_names=[], prompt_tokens=400, completion_tokens=10,
        cached_tokens=0), session_end=False)
    record = lifecycle.begin_turn("default", session)
    await lifecycle.routed(record, "w0", 440, predicted, (), prediction_exact=exact)


def test_the_live_lifecycle_learns_whether_next_turns_read_the_response() -> None:
    """Block size 4 (the worker's status): a 400-token prompt and a 10-token response
    leave two full blocks of response tokens. The next turn's predicted cached count on
    the same worker teaches the planner, but only when the prediction is exact (the
    router hashed the prompt as vLLM does); the gauge shows what it learnt."""
    _registry, metrics, _link, hints, _sessions, lifecycle, _index, _routing = build(["w0"])
    metrics.bind_state(lambda: StateSample(
        completion_read_probability={
            "default": hints.stats_of("default").completion_read_probability()}))

    async def scenario() -> None:
        await two_turns(lifecycle, "estimated", 400, exact=False)
        assert hints.stats_of("default").completion_reads.finished == 0
        await two_turns(lifecycle, "read", 408, exact=True)
        assert hints.stats_of("default").completion_reads.returned == 1
        for n in range(12):
            await two_turns(lifecycle, f"skipped{n}", 400, exact=True)

    asyncio.run(scenario())
    assert hints.stats_of("default").completion_reads.finished > 12
    assert hints.stats_of("default").completion_read_probability() < 0.5
    assert ('kvhint_router_completion_read_probability{tenant="default"} 0.4'
            in metrics.render().decode())


def test_the_planner_learns_nothing_from_a_prediction_read_off_a_resyncing_index() -> None:
    """The worker's event stream had a gap: until the snapshot comes, routing reads its
    view from before the gap (the best estimate), so the prediction is not exact and the
    planner must not learn from it whether next turns read their responses, however
    exactly the prompt was hashed. Before, a resyncing (or silent) worker's prediction
    was reported exact and taught the planner."""
    registry, metrics, _link, hints, sessions, _lc, _index, _routing = build(["w0"])
    ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=lambda: 1000.0)
    ingestor.on_status(status("w0"))  # nothing published yet: LIVE
    lifecycle = SessionLifecycle(sessions, hints, metrics, hints_enabled=True,
                                 forget_after_s=3600, index_exact=ingestor.view_exact)

    async def scenario() -> None:
        await two_turns(lifecycle, "live", 408, exact=True)
        assert hints.stats_of("default").completion_reads.returned == 1  # a LIVE view: learnt
        learnt = hints.stats_of("default").completion_reads.finished
        ingestor.on_event_batch(EventBatchMeta("w0", "e1", 3), b"")  # seq 1-2 lost
        assert not ingestor.view_exact("w0")
        await two_turns(lifecycle, "resyncing", 408, exact=True)
        assert hints.stats_of("default").completion_reads.finished == learnt

    asyncio.run(scenario())


def test_long_prompts_are_hashed_on_the_hashing_thread_short_ones_inline() -> None:
    """The event loop must not stall on a long prompt's tokenizer work: at
    ``hash_thread_min_tokens`` (estimated) and above, hashing runs on the executor; a
    hashing error there is still counted and the request routed without hashes."""
    import threading

    from kvhint.router.hashing import PromptHashes, PromptRenderError
    from kvhint.router.service.hash_queue import FairHashQueue

    threads: list[str] = []

    class Hasher:
        def hash_chat(self, body, config):  # noqa: ANN001
            threads.append(threading.current_thread().name)
            if body["messages"][0]["content"].startswith("bad"):
                raise PromptRenderError("bad template input")
            return PromptHashes(tuple(range(40)), tuple(range(1, 11)), 4)

    _registry, metrics, _l, _h, _s, _lc, _index, routing = build(["w0", "w1"])
    executor = FairHashQueue(threads=1)
    routing = dataclasses.replace(routing, hasher=Hasher(), hash_executor=executor,
                                  hash_thread_min_tokens=1000)

    def chat(content: str) -> InboundRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        return parse_inbound(Endpoint.CHAT, json.dumps(body).encode(), TENANT, "s", None)

    try:
        assert _plan(routing, chat("x" * 400), None, 0).exact  # ~100 tokens: inline
        assert _plan(routing, chat("x" * 8000), None, 0).exact  # ~2,000 tokens: the thread
        failed = _plan(routing, chat("bad" + "x" * 8000), None, 0)
    finally:
        executor.shutdown()
    assert threads[0] == threading.current_thread().name
    assert [t.startswith("kvhint-hash") for t in threads[1:]] == [True, True]
    assert not failed.exact and failed.block_hashes == ()
    assert ('kvhint_router_drops_total{what="prompt_hashing:PromptRenderError"} 1.0'
            in metrics.render().decode())


def test_a_retry_reuses_the_prompt_hashes_of_the_failed_attempt() -> None:
    """The forwarder re-plans after a failed connect with the worker excluded; the prompt
    was hashed once (tens of ms for a long one), not once per attempt."""
    from kvhint.router.hashing import PromptHashes

    calls: list[str] = []

    class Hasher:
        def hash_chat(self, body, config):  # noqa: ANN001
            calls.append(body["model"])
            return PromptHashes(tuple(range(40)), tuple(range(1, 11)), 4)

    _registry, _m, _l, _h, _s, _lc, index, routing = build(["w0", "w1"])
    routing.hasher = Hasher()  # type: ignore[assignment]
    index.apply(BlocksStored("w0", list(range(1, 11)), None))
    inbound = parse_inbound(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user"}]}',
                            TENANT, None, None)

    async def attempts() -> tuple[RoutePlan, RoutePlan]:
        first = await routing.plan(inbound, None, 0)
        retry = await routing.plan(inbound, None, 0, exclude=frozenset({"w0"}), earlier=first)
        return first, retry

    first, retry = asyncio.run(attempts())
    assert first.decision.worker_id == "w0" and retry.decision.worker_id == "w1"
    assert calls == ["m"]
    assert (retry.block_hashes, retry.prompt_tokens, retry.exact) == (tuple(range(1, 11)), 40,
                                                                     True)


def test_tool_schemas_count_toward_hashing_a_prompt_off_the_event_loop() -> None:
    """Agent frameworks send tens of thousands of tokens of tool schemas with a short
    message; the estimate that decides where a prompt is hashed counts them (and
    earlier tool calls and documents), so such a prompt is hashed on the hashing thread
    (before: estimated at 7 tokens and hashed inline, ~0.5 s on the event loop)."""
    from kvhint.router.service.routing_service import _estimate_tokens

    tools = [{"type": "function", "function": {
        "name": f"tool_{n}", "description": "does a thing " * 40,
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        for n in range(40)]
    body = {"model": "m", "tools": tools,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                          "function": {"name": "tool_1", "arguments": "{}" + " " * 8000}}]}]}
    inbound = parse_inbound(Endpoint.CHAT, json.dumps(body).encode(), TENANT, None, None)
    assert _estimate_tokens(inbound) >= RoutingSettings().hash_thread_min_tokens
    short = parse_inbound(Endpoint.CHAT, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), TENANT, None, None)
    assert _estimate_tokens(short) < 10


def test_only_the_planners_lasting_rejections_turn_an_action_type_off() -> None:
    """Two rejections of one type in a row turn it off for the worker (a worker without
    a host tier rejects Demote). Before, an agent's own actions counted: one tenant's
    agent sending expired Pins turned Pin off on that worker for every tenant, until
    the engine restarted. And so did rejections that say nothing of what the worker
    supports: a burst that filled its inbox, or actions expired in transit."""
    from kvhint.engine_plugin.transport_inbound import FULL_INBOX_REASON

    _registry, _m, _link, hints, _s, _lc, _i, _r = build(["w0"])
    transient = [FULL_INBOX_REASON.format(limit=256), "expired: expires_at 1.000 has passed"]

    async def reject(source: str, reasons: list[str]) -> None:
        for n, reason in enumerate(reasons):
            action = make_action(f"kva-{source}-{n}-{len(hints.pending)}-{time.monotonic_ns()}",
                                 PinPayload(target=Target(session_id="default/s1"), ttl_s=30))
            [sent] = await hints.send([PlannedAction("w0", action, "default/s1", "default", 8,
                                                     time.time() + 30, source)],
                                      {"default/s1": "s1"}, source=source)
            hints.on_outcome(HintOutcome(
                message_id="m", action_id=sent.action_id, action_type="kv.pin",
                worker_id="w0", status=OutcomeStatus.REJECTED, reason=reason,
                at=time.time()))

    def pins_allowed() -> bool:
        return "w0" not in hints.feedback or hints.feedback["w0"].view("default").allows("kv.pin")

    async def scenario() -> None:
        await reject("api", ["no such blocks here", "no such blocks here"])
        assert pins_allowed()
        await reject("planner", transient * 2)
        assert pins_allowed()
        await reject("planner", ["pins not supported", "pins not supported"])
        assert not pins_allowed()

    asyncio.run(scenario())


def test_an_action_restored_after_a_restart_waits_for_its_late_outcome() -> None:
    """An action sent five minutes before the router restarted, its outcome still in the
    outcome stream the router replays after it starts: it waits OUTCOME_DEADLINE_S from
    the restart. Before, it expired at the first tick, and its outcome, a moment later,
    was dropped as unknown (and its hold no longer counted)."""
    from kvhint.router.service.hint_dispatch import OUTCOME_DEADLINE_S, SentAction

    _registry, metrics, _link, hints, _s, _lc, _i, _r = build(["w0"])
    sent_at = time.time() - 300
    row = SentAction(action_id="kvh-1", message_id="m", worker_id="w0", tenant="default",
                     session_id="s1", action_type="kv.pin", source="planner", trigger="gap",
                     payload={"target": {"session_id": "default/s1"}, "ttl_s": 600},
                     status="pending", created_at=sent_at, updated_at=sent_at,
                     requested_blocks=8, scope="default/s1",
                     expires_at=sent_at + 600).row()
    hints.restore([], [row])
    assert hints.expire() == 0
    record = hints.on_outcome(HintOutcome(
        message_id="m", action_id="kvh-1", action_type="kv.pin", worker_id="w0",
        status=OutcomeStatus.ACCEPTED, requested=Amount(8), applied=Amount(8),
        at=time.time()))
    assert record is not None and record.status == "accepted"
    assert 'kvhint_router_foreign_hint_messages_total{kind="outcome"}' not in \
        metrics.render().decode()
    assert hints.expire(time.time() + OUTCOME_DEADLINE_S + 1) == 0  # answered: nothing left
