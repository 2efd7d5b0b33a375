"""The live session lifecycle on an injected clock, with the real planner, dispatcher and
holdings ledger; NATS is replaced by a recording link (as in test_service_planning.py):
ends that race a turn in flight, repeated ends, the idle review schedule, abandonment
before forgetting, and an agent runtime's claims on more than one worker."""

from __future__ import annotations

from kvhint.router.policy import GapObserved, PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import (
    HintOutcome,
    HintOwner,
    OutcomeStatus,
    PinPayload,
    Subjects,
    Target,
    decode_hints,
    make_action,
)
from kvhint.router.policy import PlannedAction, agent_scope
from test_service_planning import RecordingLink, status

START = 1_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def build(workers: list[str], forget_after_s: float = 3600.0,
          config: PlannerConfig | None = None, budget: TenantBudget | None = None):
    clock = Clock()
    registry = WorkerRegistry([(w, f"http://{w}") for w in workers])
    for worker in workers:
        registry.on_heartbeat(status(worker))
    metrics = RouterMetrics()
    link = RecordingLink()
    hints = HintDispatcher(link, Subjects("t"), registry, None, metrics,
                           config or PlannerConfig(), seed=1, clock=clock,
                           budget_of=lambda tenant: budget if tenant == "acme" else None,
                           tenants=("default", "acme", "other"))
    sessions = SessionRegistry(None, max_sessions=100)
    ended: list[tuple[str, str]] = []
    lifecycle = SessionLifecycle(sessions, hints, metrics, hints_enabled=True,
                                 forget_after_s=forget_after_s, clock=clock,
                                 on_end=lambda tenant, sid: ended.append((tenant, sid)))
    return clock, link, hints, sessions, lifecycle, ended


def sent_actions(link: RecordingLink) -> list:
    return [(subject.rsplit(".", 1)[-1], action) for subject, payload in link.sent
            for action in decode_hints(payload).actions]


def answer(reason: str = "stop", tools: tuple[str, ...] = ()) -> ResponseObservation:
    return ResponseObservation(finish_reason=reason, tool_names=list(tools), prompt_tokens=400,
                               completion_tokens=8, cached_tokens=0)


async def test_an_end_while_a_turn_is_in_flight_leaves_nothing_protected() -> None:
    """A DELETE that comes while the worker answers (or before the turn is routed): the
    turn's answer plans nothing for the ended session. Before, its finish sent a Retain
    that no idle review ever released, and the session showed as in a tool gap."""
    for end_before_routing in (False, True):
        clock, link, hints, sessions, lifecycle, _ended = build(["w0"])
        record = lifecycle.begin_turn("default", "s1")
        if not end_before_routing:
            await lifecycle.routed(record, "w0", 400, 0, ())
        await lifecycle.end(record)
        sent_at_end = len(link.sent)
        if end_before_routing:
            await lifecycle.routed(record, "w0", 400, 0, ())
        clock.now += 2.0
        await lifecycle.finished(record, "w0", answer("tool_calls", ("search",)), False)
        assert record.state == "ended" and record.plan.ended
        assert record.prompt_tokens == 400  # counted all the same
        assert len(link.sent) == sent_at_end, sent_actions(link)[sent_at_end:]
        assert hints.holdings.worker("w0").retained_blocks == 0
        assert hints.holdings.worker("w0").pinned_blocks == 0
        for _ in range(5):
            clock.now += 30.0
            await lifecycle.tick()
        assert len(link.sent) == sent_at_end


async def test_a_repeated_end_sends_nothing_again() -> None:
    clock, link, hints, sessions, lifecycle, ended = build(["w0"])
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    first = await lifecycle.end(record)
    assert first and ended == [("default", "s1")]
    sent = len(link.sent)
    assert await lifecycle.end(record) == [] and await lifecycle.end(record) == []
    assert len(link.sent) == sent and ended == [("default", "s1")]
    # A new turn reopens the session; its end is an end again.
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 420, 400, ())
    await lifecycle.finished(record, "w0", answer(), False)
    assert await lifecycle.end(record)
    assert len(ended) == 2


async def test_a_client_end_after_an_abandonment_is_told_once() -> None:
    """The planner abandons an idle session (no end is told: the trace recorder holds the
    client's events); its client's end then is told once, however often repeated, and
    sends nothing of the planner's. Before, it was never told."""
    config = PlannerConfig()
    clock, link, hints, sessions, lifecycle, ended = build(["w0"], 7200.0, config)
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    while record.state != "ended":
        clock.now += 60.0
        await lifecycle.tick()
    assert record.plan.ended and not record.plan.ended_explicitly and ended == []
    sent = len(link.sent)
    clock.now += 5.0
    for _repeat in range(3):
        assert await lifecycle.end(record) == []
        assert ended == [("default", "s1")] and record.plan.ended_explicitly
    assert record.ended_at == clock.now and len(link.sent) == sent


async def test_idle_sessions_are_reviewed_on_the_planners_schedule_then_abandoned() -> None:
    """The live tick (every second) reviews an idle session when next_idle_review says
    so, the schedule the simulator keeps, not at every tick: an idle hour costs about as
    many hint messages as that schedule has reviews (before: 27 where the schedule
    makes 8). With forget_after_s equal to abandon_after_s (the defaults), the session is
    abandoned (released, its non-return learnt), never silently forgotten first."""
    config = PlannerConfig()
    clock, link, hints, sessions, lifecycle, _ended = build(["w0"], 3600.0, config)
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    after_finish = len(link.sent)
    reviews = 0
    at = config.idle_review_first_s
    while at < config.abandon_after_s:
        reviews += 1
        at *= config.idle_review_growth
    for _second in range(int(config.abandon_after_s) + 5):
        clock.now += 1.0
        await lifecycle.tick()
    idle_messages = len(link.sent) - after_finish
    assert 1 <= idle_messages <= reviews + 2, idle_messages
    assert record.state == "ended" and record.plan.ended
    assert sessions.get("default", "s1") is record  # ended now, forgotten an hour later
    assert hints.holdings.worker("w0").retained_blocks == 0
    # Its non-return was learnt (a return observation the planner folds in).
    assert hints.stats_of("default").returns, hints.stats_of("default").returns


async def test_a_session_awaiting_its_return_outlives_a_short_forget_time() -> None:
    """session_forget_s below the return window: an idle session is kept until the
    planner has learnt its non-return and abandoned it; before, it was dropped from
    memory first and the router never learnt that sessions fail to return."""
    config = PlannerConfig(return_window_s=600.0, abandon_after_s=900.0)
    clock, link, hints, sessions, lifecycle, _ended = build(["w0"], 300.0, config)
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    for _ in range(100):
        clock.now += 7.0  # 700 s: past the forget time and the return window
        await lifecycle.tick()
    assert sessions.get("default", "s1") is record and not record.plan.ended
    assert hints.stats_of("default").returns
    for _ in range(100):
        clock.now += 7.0
        await lifecycle.tick()
    assert record.state == "ended"
    for _ in range(60):
        clock.now += 7.0
        await lifecycle.tick()
    assert sessions.get("default", "s1") is None  # ended 300 s ago: forgotten now


async def test_an_end_releases_the_agents_claims_on_every_worker_that_holds_some() -> None:
    """An agent runtime pinned the session on w0, then the session moved to w1 (or the
    agent named a worker): the end releases the agent's claims on both, not only on the
    session's current worker. Before, w0's pin counted against the tenant's budget until
    its TTL."""
    clock, link, hints, sessions, lifecycle, _ended = build(["w0", "w1"])
    hints.observe([GapObserved("search", 1, 2.0)] * 20, "default")
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w1", 400, 0, ())
    scope = agent_scope(record.worker_session_id)
    for worker in ("w0", "w1"):
        pin = PinPayload(target=Target(session_id=record.worker_session_id), ttl_s=300.0,
                         owner=HintOwner.AGENT)
        await hints.send([PlannedAction(worker, make_action(f"kva-{worker}", pin), scope,
                                        "default", 4, clock.now + 300.0, "api")],
                         {scope: "s1"}, source="api")
    assert hints.holdings.workers_holding(scope) == ["w0", "w1"]
    before = len(link.sent)
    await lifecycle.finished(record, "w1", answer(), True)  # X-Session-End
    released = [(worker, a.payload.owner) for worker, a in sent_actions(link)[before:]
                if a.action_type.value == "kv.retain" and a.payload.priority == 0
                and a.payload.owner is HintOwner.AGENT]
    assert sorted(released) == [("w0", HintOwner.AGENT), ("w1", HintOwner.AGENT)]
    assert hints.holdings.tenant("default").pinned_blocks == 0


async def test_the_release_of_an_agents_claims_at_the_end_never_teaches_the_planner() -> None:
    """The end's release of what an agent runtime holds is the agent's action (source
    "api", like the claims it ends), not the planner's: a worker that rejects it twice
    (say, it no longer takes agent-owned claims) must not turn Retain off for the
    planner there. Before, the release went out as "planner" and two such rejections
    disabled the planner's Retains on that worker for every tenant."""
    clock, link, hints, sessions, lifecycle, _ended = build(["w0"])
    releases = []
    for number in range(2):
        record = lifecycle.begin_turn("default", f"s{number}")
        await lifecycle.routed(record, "w0", 400, 0, ())
        scope = agent_scope(record.worker_session_id)
        pin = PinPayload(target=Target(session_id=record.worker_session_id), ttl_s=300.0,
                         owner=HintOwner.AGENT)
        await hints.send([PlannedAction("w0", make_action(f"kva-{number}", pin), scope,
                                        "default", 4, clock.now + 300.0, "api")],
                         {scope: record.session_id}, source="api")
        sent = await lifecycle.end(record)
        releases += [a for a in sent if a.trigger == "end:agent_release"]
    assert [(a.worker_id, a.source) for a in releases] == [("w0", "api"), ("w0", "api")]
    for action in releases:
        hints.on_outcome(HintOutcome(
            message_id=action.message_id, action_id=action.action_id,
            action_type="kv.retain", worker_id="w0", status=OutcomeStatus.REJECTED,
            reason="agent-owned claims not supported", at=clock.now))
    feedback = hints.feedback.get("w0")
    assert feedback is None or feedback.view("default").allows("kv.retain"), feedback


async def test_shared_prefix_retains_keep_to_each_tenants_retain_budget() -> None:
    """Four sessions of tenant acme share a 4-block system prompt, as do four of tenant
    other; acme may retain 2 blocks, so only other's prefix is retained. Before, the
    scan planned with no tenant's budget and acme got 4 blocks retained."""
    clock, link, hints, sessions, lifecycle, _ended = build(
        ["w0"], budget=TenantBudget(max_retained_blocks=2))
    for tenant, root in (("acme", 100), ("other", 200)):
        system = tuple(range(root, root + 4))
        for number in range(4):
            record = sessions.open(tenant, f"s{number}", clock.now)
            record.worker_id = "w0"
            record.last_block_hashes = (*system, root * 10 + number)
    await lifecycle.tick()
    retained = [a.payload.target.block_hashes for _w, a in sent_actions(link)
                if a.action_type.value == "kv.retain"]
    assert retained == [[200, 201, 202, 203]]
    assert hints.holdings.tenant("acme").retained_blocks == 0


def test_a_full_registry_forgets_ended_then_idle_sessions_never_one_in_flight() -> None:
    """At its bound the registry forgets the least recently opened ended session, else
    the least recently opened one with no turn in flight, and counts each. Before, a
    session whose turn was in flight could be forgotten (its answer then protected a
    record nobody reviewed), and each new session scanned them all."""
    drops: list[str] = []
    registry = SessionRegistry(None, max_sessions=3, on_drop=lambda what, n: drops.append(what))
    busy = registry.open("t", "busy", 1.0)
    busy.inflight = 1
    idle = registry.open("t", "idle", 2.0)
    done = registry.open("t", "done", 3.0)
    done.state = "ended"
    registry.open("t", "new1", 4.0)  # full: the ended one goes first
    assert registry.get("t", "done") is None and registry.get("t", "busy") is busy
    registry.open("t", "busy", 5.0)  # reopened: most recent now
    registry.open("t", "new2", 6.0)  # no ended one: the oldest with nothing in flight
    assert registry.get("t", "idle") is None
    assert registry.get("t", "busy") is busy and idle is not busy
    assert drops == ["session_evicted_from_memory"] * 2
    assert len(registry) == 3


class RecordingWriter:
    """Stands in for the StoreWriter's upsert (what is asked to be written, not how)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, tuple]] = []

    def upsert(self, table: str, key: tuple, row: dict) -> None:
        self.rows.append((table, key))


def test_learned_feedback_is_saved_when_it_changes_not_at_every_tick() -> None:
    """An idle router with 8 workers rewrote every worker's feedback row at every tick
    (480 upserts a minute); now a worker's row is written when its feedback changes."""
    registry = WorkerRegistry([(f"w{n}", f"http://w{n}") for n in range(8)])
    writer = RecordingWriter()
    hints = HintDispatcher(RecordingLink(), Subjects("t"), registry, writer,  # type: ignore[arg-type]
                           RouterMetrics(), PlannerConfig(), seed=1)
    for n in range(8):
        hints.reset_worker(f"w{n}")
    for tick in range(60):
        hints.save_learned(START + tick)
    assert len([k for t, k in writer.rows if t == "learned_stats"]) == 8
    hints.reset_worker("w3")  # changed: written once more
    for tick in range(60, 70):
        hints.save_learned(START + tick)
    assert [k for _t, k in writer.rows][-1] == ("*", "feedback:w3")
    assert len(writer.rows) == 9
