"""The simulation loop: a trace replayed in virtual time through simulated workers.

Per policy run: N :class:`~kvhint.router.sim.worker.SimWorker` (vLLM's KVCacheManager +
the plugin's PluginCore each), the router's real cluster KV index
(:class:`kvhint.router.kv_index.InMemoryClusterKvIndex`, fed with the workers' own KV
events through the index's adapter), the router's real :func:`~kvhint.router.policy.route`
and, for ``kvhint``, the real hint planner, ledger and outcome feedback
(:class:`~kvhint.router.sim.hint_loop.HintLoop`). The clock is the
simulation's; the only randomness is a seeded ``random.Random``.

Events, in time order (ties: arrival order of scheduling): a request *arrives* (route,
plan the turn, queue it), a *prefill ends* (first token; the next queued prompt is
admitted), a *response ends* (free, plan the gap), a worker's *hold deadline* (its
plugin's next claim expiry or deferred action's deadline: live, the plugin advances at
every engine step, so a hold ends at its TTL and a prompt it kept out is admitted then),
an idle *review* (plan_idle), a *session end* through the sessions API (a trace's end
line), and a periodic *tick* (the router's ledger expiry, plugin expiry and deferred
outcomes again, and, as the live router's tick does, the shared-prefix scan; the ledger
also expires at each hold deadline). ``route()``
sees the router's own load figures, kept by the live RoutingService's own bookkeeping
(:class:`~kvhint.router.policy.routed_load.RoutedLoads`): dispatched at routing, the
prefill cleared at the first token, ended at the response's end or a refusal.
``active_blocks`` is the prompt blocks of every request routed to the worker and not yet
ended (queued ones included, decode blocks not counted). With the ``scheduler`` engine
(:class:`~kvhint.router.sim.scheduler_worker.SchedulerSimWorker`) a *step ends* instead
of prefills and decodes: first tokens out, responses ended, the next step scheduled.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvhint.engine_plugin.headless import tokens_for_block_ids
from kvhint.router.kv_index import (
    TIER_CPU,
    BlocksRemoved,
    BlocksStored,
    EventBatchAdapter,
    InMemoryClusterKvIndex,
)
from kvhint.router.policy import (
    FinishReason,
    HoldingsLedger,
    Overlap,
    PlannedAction,
    ResponseFinished,
    RouteRequest,
    RoutingContext,
    RoutingPolicy,
    SessionEnded,
    SessionPlacement,
    SessionPlanState,
    SharedPrefixRetains,
    SplitFeedback,
    TenantStats,
    TurnRouted,
    WorkerPlanView,
    plan_response_finished,
    plan_session_end,
    plan_turn_routed,
    route,
)
from kvhint.router.policy.routed_load import RoutedLoads
from kvhint.router.sim.config import ENGINES, SimConfig
from kvhint.router.sim.hint_loop import HintLoop
from kvhint.router.sim.results import PolicyResult, RequestRecord, TimelinePoint
from kvhint.router.sim.scheduler_worker import SchedulerSimWorker, build_scheduler_worker
from kvhint.router.sim.tick_grid import grid_ceil, grid_floor, scan_aligned
from kvhint.router.sim.trace import Trace, TraceRequest, intern_block_ids
from kvhint.router.sim.worker import Job, SimWorker, build_fast_worker
from kvhint.schemas import evict_rest_supported

POLICIES = ("round_robin", "session_affinity", "kv_aware", "kvhint")
__all__ = ["ENGINES", "POLICIES", "SimConfig", "Simulation", "run_policy"]
U64_MASK = (1 << 64) - 1

# Event kinds, ordered for equal times: work that frees capacity first.
(_STEP_END, _DECODE_DONE, _PREFILL_DONE, _HOLD_DEADLINE, _REVIEW, _SESSION_END, _TICK,
 _ARRIVAL) = range(8)


ProgressFn = Callable[[int, int], None]


class Simulation(HintLoop):
    """One policy over one trace. Build, then :meth:`run` once."""

    def __init__(self, trace: Trace, config: SimConfig, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
        if trace.block_size != config.block_size:
            raise ValueError(
                f"trace block size {trace.block_size} != simulated block size {config.block_size}"
            )
        self.trace = trace
        self.config = config
        self._token_ids = intern_block_ids(trace)
        self.policy = policy
        self.hints_on = policy == "kvhint"
        self.now = 0.0
        self.index = InMemoryClusterKvIndex()
        self._adapter = EventBatchAdapter()
        self._routing = replace(config.routing, policy=RoutingPolicy(policy))
        self._route_rng = random.Random(f"{config.seed}:route")
        self._plan_rng = random.Random(f"{config.seed}:plan")
        # Each tenant of the trace learns its own statistics, as in the live router.
        self.learned = TenantStats(frozenset(r.tenant for r in trace.requests))
        self.ledger = HoldingsLedger()
        self.sessions: dict[str, SessionPlanState] = {}
        self.placements: dict[str, tuple[str, int]] = {}  # session -> (worker, turns)
        self.feedback: dict[str, SplitFeedback] = {}
        self._planned: dict[str, PlannedAction] = {}
        # Per session: the block hashes of its last routed prompt (shared-prefix scans).
        self._last_hashes: dict[str, tuple[int, ...]] = {}
        self._prefix_retains = SharedPrefixRetains()
        # Per worker: the router's load figures (recent prefill and sessions, pending
        # prefill, active blocks), the live RoutingService's own bookkeeping.
        self.loads = RoutedLoads(config.recent_half_life_s)
        self._heap: list[tuple[float, int, int, Any]] = []
        # Per worker: the time of the earliest hold-deadline event on the heap.
        self._deadline_at: dict[str, float] = {}
        # Ticks run on a grid: tick k at k * tick_s (k >= 1). The index of the tick being
        # handled, and of one at which the unskipped schedule runs a shared-prefix scan
        # (the first tick does: SharedPrefixRetains starts due); see _next_tick.
        self._tick_index = 0
        self._scan_tick = 1
        self._seq = itertools.count()
        self._message_ids = itertools.count(1)
        self.result = PolicyResult(policy, records=[] if config.keep_records else None,
                                   timeline_width_s=config.timeline_bucket_s)
        self.workers: dict[str, SimWorker | SchedulerSimWorker] = {}
        self._static_views: dict[str, WorkerPlanView] = {}
        self._build_workers()

    # -- construction ---------------------------------------------------------------------------

    def _build_workers(self) -> None:
        config = self.config
        for i in range(config.workers):
            worker_id = f"w{i}"
            build = build_scheduler_worker if config.engine == "scheduler" else build_fast_worker
            worker = build(worker_id, config, self._clock, self._on_worker_events)
            core = worker.core
            self.workers[worker_id] = worker
            self.feedback[worker_id] = SplitFeedback(worker_id)
            # What the worker's status heartbeat would say (fixed for a run).
            self._static_views[worker_id] = WorkerPlanView(
                worker_id=worker_id, block_size=config.block_size, budgets=core.budgets(),
                supported_actions=frozenset(core.supported_actions()),
                host_tier=worker.host is not None,
                evict_rest_first=evict_rest_supported(core.supported_actions()),
                # Status 1.3, as the live router reads it (hint_dispatch): pins planned
                # in pool blocks on a hybrid model; None (one a position) on one group.
                claim_cost=core.claim_cost() or None)
            self.result.computed_by_worker[worker_id] = 0

    def _clock(self) -> float:
        return self.now

    # -- ticks ------------------------------------------------------------------------------------

    def _push_tick(self, index: int) -> None:
        self._push(index * self.config.tick_s, _TICK, index)

    def _next_tick(self, index: int) -> int:
        """The index of the tick to run after tick ``index`` (0: before the first).

        Normally ``index + 1``. While every worker is idle, the ticks before the next event
        can only expire claims and run shared-prefix scans; when none of them can do
        anything, they are skipped, up to the last tick at or before the next event (a
        trace stamped in epoch ms, or with hours of idle time, would otherwise spend its
        run ticking through them). The contract: a run gives the same result as one that
        runs every tick. So a skip stops at the tick that handles the next claim expiry;
        none happens while a Prefetch or Demote waits, nor (kvhint) while some session
        would count in a scan, whose retains would change with time; and it lands where
        the unskipped schedule scans, so later scans keep their times."""
        following = index + 1
        if not self._heap or any(w.active_requests or w.core.executor.pending_actions
                                 for w in self.workers.values()):
            return following
        tick_s = self.config.tick_s
        target = grid_floor(self._heap[0][0], tick_s)
        for worker in self.workers.values():
            expiry = worker.core.executor.next_deadline()
            if expiry is not None and math.isfinite(expiry):
                target = min(target, grid_ceil(expiry, tick_s))
        if target > following and self.hints_on:
            target = following if self._scan_could_act() else scan_aligned(
                index, target, self._scan_tick, tick_s, self.config.planner.shared_prefix_scan_s)
        return max(target, following)

    # -- hold deadlines ---------------------------------------------------------------------------

    def _arm_deadline(self, worker: SimWorker | SchedulerSimWorker) -> None:
        """Wake the worker when its plugin next has work of its own (a hold's TTL, a
        Prefetch's or a waiting Demote's deadline): live, the plugin advances at every
        engine step, so a hold ends at its TTL, not at the simulation's next tick."""
        deadline = worker.core.executor.next_deadline()
        if deadline is None or not math.isfinite(deadline):
            return
        armed = self._deadline_at.get(worker.worker_id)
        if armed is not None and armed <= deadline:
            return
        at = max(deadline, self.now)
        self._deadline_at[worker.worker_id] = at
        self._push(at, _HOLD_DEADLINE, worker.worker_id)

    def _on_hold_deadline(self, worker_id: str) -> None:
        if self._deadline_at.get(worker_id, math.inf) <= self.now:
            del self._deadline_at[worker_id]
        # The router's ledger lets go of the holds that end now, with the plugin: live,
        # it expires them at its tick (hints.tick_s, 1 s); at the simulation's (tick_s,
        # 5 s) the planner saw a worker's budget taken for up to 5 s by holds that ended.
        self.ledger.expire(self.now)
        worker = self.workers[worker_id]
        self._advance_worker(worker)
        self._arm_deadline(worker)

    # -- the loop ---------------------------------------------------------------------------------

    def _push(self, at: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (at, kind, next(self._seq), payload))

    def _push_review(self, at: float, payload: tuple[str, float]) -> None:
        self._push(at, _REVIEW, payload)

    def run(self, progress: ProgressFn | None = None) -> PolicyResult:
        started = time.perf_counter()
        requests = self.trace.requests
        total = len(requests)
        for request in requests:
            self._push(request.arrival_s, _ARRIVAL, request)
        self._push_tick(self._next_tick(0))
        arrivals = 0
        handlers = {
            _STEP_END: self._on_step_end,
            _DECODE_DONE: self._on_decode_done,
            _PREFILL_DONE: self._on_prefill_done,
            _REVIEW: self._on_review,
            _HOLD_DEADLINE: self._on_hold_deadline,
            _SESSION_END: self._on_session_end,
        }
        heap = self._heap
        while heap:
            at, kind, _, payload = heapq.heappop(heap)
            self.now = at
            if kind == _ARRIVAL:
                self._on_arrival(payload)
                arrivals += 1
                if progress is not None and (arrivals % 200 == 0 or arrivals == total):
                    progress(arrivals, total)
            elif kind == _TICK:
                self._tick_index = payload
                self._on_tick()
                if arrivals < total or any(w.active_requests for w in self.workers.values()):
                    self._push_tick(self._next_tick(payload))
            else:
                handlers[kind](payload)
            if arrivals == total and not any(w.active_requests for w in self.workers.values()):
                break  # the trace is served; later idle reviews would change nothing measured
        self._finalize()
        self.result.wall_s = time.perf_counter() - started
        return self.result

    # -- requests ---------------------------------------------------------------------------------

    def _on_arrival(self, request: TraceRequest) -> None:
        session_key = f"{request.tenant}/{request.session_id}"
        tokens = tokens_for_block_ids([self._token_ids[b] for b in request.block_ids],
                                      self.config.block_size)
        del tokens[request.input_length:]
        worker0 = next(iter(self.workers.values()))
        vllm_request = worker0.make_request(tokens, session_key, request.output_length)
        hashes = tuple(int.from_bytes(h, "big") & U64_MASK for h in vllm_request.block_hashes)
        decision = self._route(request, session_key, hashes)
        worker = self.workers[decision.worker_id]
        predicted_computed = request.input_length - decision.predicted_cached_tokens
        self.loads.dispatched(decision.worker_id, self.now, predicted_computed,
                              request.input_length, self.config.block_size)
        placement = self.placements.get(session_key)
        if placement is None:
            self.loads.session_placed(decision.worker_id, self.now)
        elif placement[0] != decision.worker_id:
            self.result.moved_turns += 1
        self.placements[session_key] = (decision.worker_id, placement[1] + 1 if placement else 1)
        if self.hints_on:
            self._last_hashes[session_key] = hashes
            event = TurnRouted(session_key, request.tenant, decision.worker_id,
                               request.input_length, self.now,
                               decision.predicted_cached_tokens)
            self._apply_plan(plan_turn_routed(self._planner_ctx(request.tenant, session_key),
                                              self.sessions.get(session_key), event),
                             request.tenant)
        job = Job(request, session_key, vllm_request, hashes, decision.worker_id,
                  decision.predicted_cached_tokens, predicted_computed, self.now)
        worker.enqueue(job)
        self._take_dropped(worker)
        self._try_start(worker)

    def _take_dropped(self, worker: SimWorker | SchedulerSimWorker) -> None:
        """Requests the worker refused end for the router (RoutingService.finished)."""
        if worker.dropped:
            for job in worker.dropped:
                self.loads.finished(worker.worker_id, job.request.input_length,
                                    self.config.block_size, job.predicted_computed_tokens)
            worker.dropped.clear()

    def _route(self, request: TraceRequest, session_key: str, hashes: tuple[int, ...]):
        overlaps: dict[str, Overlap] = {}
        if self._routing.policy in (RoutingPolicy.KV_AWARE, RoutingPolicy.KVHINT):
            match = self.index.match_prefix(hashes)
            overlaps = {w: Overlap(o.gpu_blocks, o.external_blocks)
                        for w, o in match.workers.items()}
        loads = [self.loads.worker_load(w.worker_id, self.now, healthy=True,
                                        active_requests=w.active_requests)
                 for w in self.workers.values()]
        placement = self.placements.get(session_key)
        ctx = RoutingContext(
            workers=tuple(loads), config=self._routing,
            session=SessionPlacement(placement[0], placement[1]) if placement else None,
            now=self.now,
        )
        features = RouteRequest(request.input_length, self.config.block_size, session_key,
                                self.result.requests, overlaps)
        self.result.requests += 1
        return route(ctx, features, self._route_rng)

    def _try_start(self, worker: SimWorker | SchedulerSimWorker) -> None:
        if isinstance(worker, SchedulerSimWorker):
            self._begin_step(worker)
            return
        started = worker.start_prefill(self.now)
        self._take_releases(worker)  # the allocation may have relieved retained blocks
        self._take_dropped(worker)
        if started is None:
            return
        job, done_at = started
        self._record_admission(job)
        self._push(done_at, _PREFILL_DONE, worker.worker_id)

    def _on_prefill_done(self, worker_id: str) -> None:
        worker = self.workers[worker_id]
        job, done_at = worker.finish_prefill(self.now)
        self.loads.first_token(worker_id, job.predicted_computed_tokens)
        self.result.ttfts_s.append(self.now - job.arrival_s)
        if not job.decode_allocated:
            self.result.decode_alloc_failures += 1
        self._push(done_at, _DECODE_DONE, job)
        self._try_start(worker)

    def _on_decode_done(self, job: Job) -> None:
        worker = self.workers[job.worker_id]
        assert isinstance(worker, SimWorker)
        worker.finish(job)
        self._response_ended(job)
        self._try_start(worker)

    def _begin_step(self, worker: SchedulerSimWorker) -> None:
        started = worker.begin_step(self.now)
        self._take_releases(worker)  # the step's allocations may have relieved holds
        if started is None:
            return
        length, admitted = started
        for job in admitted:
            self._record_admission(job)
        self._push(self.now + length, _STEP_END, worker.worker_id)

    def _on_step_end(self, worker_id: str) -> None:
        worker = self.workers[worker_id]
        assert isinstance(worker, SchedulerSimWorker)
        ended = worker.end_step(self.now)
        for job in ended.first_tokens:
            self.loads.first_token(worker_id, job.predicted_computed_tokens)
            self.result.ttfts_s.append(self.now - job.arrival_s)
        for job in ended.finished:
            self._response_ended(job)
        self._begin_step(worker)

    def _response_ended(self, job: Job) -> None:
        """The response is out and its request freed: the planner's turn."""
        request = job.request
        self.loads.finished(job.worker_id, request.input_length, self.config.block_size, 0)
        if request.output_length > 1:
            self.result.itls_s.append((self.now - job.first_token_s) / (request.output_length - 1))
        if self.hints_on:
            state = self.sessions.get(job.session_key)
            if state is not None:
                event = ResponseFinished(job.session_key, FinishReason.parse(request.finish_reason),
                                         request.input_length, request.output_length, self.now,
                                         request.tool_names)
                self._apply_plan(plan_response_finished(
                    self._planner_ctx(state.tenant, job.session_key), state, event),
                    state.tenant)
                if request.end:
                    self._on_session_end(job.session_key)
                elif request.end_at_s is not None:  # ended later, through the sessions API
                    self._push(max(request.end_at_s, self.now), _SESSION_END, job.session_key)

    def _on_session_end(self, session_key: str) -> None:
        state = self.sessions.get(session_key)
        if state is None:
            return
        if state.ended:
            # Abandoned when idle before its client ended it: as the live router
            # (SessionLifecycle._mark_ended), nothing of the planner's is left to end;
            # the end is its client's from here on, at this time.
            self.sessions[session_key] = replace(state, ended_explicitly=True,
                                                 last_activity=self.now)
            return
        self._apply_plan(plan_session_end(self._planner_ctx(state.tenant, session_key), state,
                                          SessionEnded(session_key, self.now)), state.tenant)

    def _record_admission(self, job: Job) -> None:
        result = self.result
        prompt = job.request.input_length
        result.prompt_tokens += prompt
        result.g1_hit_tokens += job.g1_hit_tokens
        result.g2_hit_tokens += job.g2_hit_tokens
        result.computed_by_worker[job.worker_id] += job.computed_tokens
        # Only buckets with admissions get a point: a trace stamped in epoch ms would
        # otherwise list every empty minute since 1970 (admissions come in time order).
        width = self.config.timeline_bucket_s
        start = (self.now // width) * width
        timeline = result.timeline
        if not timeline or timeline[-1].start_s < start:
            timeline.append(TimelinePoint(start))
        point = timeline[-1]
        point.prompt_tokens += prompt
        point.hit_tokens += job.g1_hit_tokens + job.g2_hit_tokens
        if result.records is not None:
            result.records.append(RequestRecord(
                job.request.line, job.request.session_id, job.worker_id, job.arrival_s,
                job.start_s, job.g1_hit_tokens, job.g2_hit_tokens, job.computed_tokens))

    # -- index ----------------------------------------------------------------------------------------

    def _on_worker_events(self, worker_id: str, events: list[Any],
                          host_events: Sequence[tuple[bool, list[int]]]) -> None:
        index = self.index
        if events:
            index.apply_all(self._adapter.convert_events(worker_id, events))
        for removed, hashes in host_events:
            if removed:
                index.apply(BlocksRemoved(worker_id, hashes, TIER_CPU))
            else:
                index.apply(BlocksStored(worker_id, hashes, None, TIER_CPU))

    def _finalize(self) -> None:
        result = self.result
        for worker in self.workers.values():
            result.dropped_requests += worker.counters.dropped_too_large
            result.admission_waits += worker.counters.admission_waits
            result.preemptions += worker.counters.preemptions


def run_policy(trace: Trace, config: SimConfig, policy: str,
               progress: ProgressFn | None = None) -> PolicyResult:
    return Simulation(trace, config, policy).run(progress)
