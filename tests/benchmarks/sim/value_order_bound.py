"""What value-ordered eviction could reach on a trace: a bound for the planner's own value.

A block-level model of ONE pool of ``--blocks`` blocks (no workers, no running requests,
no decode blocks, every request served at its arrival): it separates what the planner's
*value function* can buy from what the hint *mechanism* (holds, budgets, reviews) loses.
Each resident session has a value; when the pool is full the lowest-valued session loses
its deepest block first. Policies, all in one run:

- ``lru``: plain LRU (vLLM's order: a request's blocks freed leaf first).
- ``belady``: furthest next use, with hindsight (the simulator's oracle line).
- ``value``: the planner's own LHD value, :meth:`LearnedStats.hit_density` at the
  session's *current* idle time, learnt online exactly as the router learns it (gap kinds
  with session tempo and long user messages, depth buckets, the 600 s return window),
  re-evaluated at every eviction. A perfect mechanism for the planner's value: what
  kvhint could reach if the worker ordered its whole pool by that value.
- ``value_reviewed``: the same value, but re-evaluated only at the planner's idle-review
  schedule (15 s, then x1.5), as the planner's integer priority, changed only when it
  moved by the planner's refresh step; ties by the time of the last change: what the
  planner's Retain messages can express.
- ``value_knows_returns``: ``value`` told, with hindsight, whether each session comes back
  within the return window (never returning: value 0), nothing about when: how much of
  the oracle's lead is knowing *which* sessions return.

``--prompt-size`` tries one more feature a live router has, the prompt's length, in the
value policies: ``kind`` learns user gaps and returns per prompt-size class (under 2,048
tokens, under 8,192, longer), ``returns`` learns only the return probability per class
(gaps stay pooled as now). Not in the planner: measured not to help (BENCHMARKS.md).

    .venv/bin/python tests/benchmarks/sim/value_order_bound.py \\
        ../shared/traces/mooncake_conversation_trace.jsonl --blocks 5000

Prints one line per policy: prompt-token hit rate and its ratio to LRU. Progress on stderr.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import heapq
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvhint.router.policy.plan_types import PlannerConfig
from kvhint.router.policy.priority import retain_priority
from kvhint.router.policy.stats import (
    GapObserved,
    LearnedStats,
    ReturnObserved,
    user_gap_kind,
)
from kvhint.router.sim.trace import Trace, TraceRequest, load_trace

POLICIES = ("lru", "belady", "value", "value_reviewed", "value_knows_returns")
ENDED = "@ended"


@dataclass(frozen=True, slots=True)
class Turn:
    at: float
    session: str
    depth: int  # turns so far, this one included (the planner's ``session.turns``)
    prompt_tokens: int
    blocks: tuple[int, ...]  # full prompt blocks
    kind: str  # the gap kind this turn's response opens (ENDED: explicit end)
    returns: bool  # hindsight: the next turn comes within the return window


PROMPT_SIZE_LIMITS = ((2048, "s"), (8192, "m"))


def prompt_size_class(tokens: int) -> str:
    return ":size-" + next((name for limit, name in PROMPT_SIZE_LIMITS if tokens < limit), "l")


def _without_size(kind: str) -> str:
    return kind.split(":size-", 1)[0]


class ReturnsBySizeStats(LearnedStats):
    """``--prompt-size returns``: gap histograms learnt and read without the size class
    (as the planner's), return probabilities with it."""

    def _gap_histogram(self, kind: str, depth: int):  # noqa: ANN202 (LearnedStats')
        return super()._gap_histogram(_without_size(kind), depth)

    def apply(self, event) -> None:  # noqa: ANN001
        if isinstance(event, GapObserved):
            event = GapObserved(_without_size(event.kind), event.depth, event.seconds)
        super().apply(event)


def turns_of(trace: Trace, window_s: float, long_message_tokens: int,
             prompt_size: bool = False) -> list[Turn]:
    """The trace as turns, with the planner's gap kinds (tool name, or the user's tempo
    and whether the turn added a long message, as ``planner._gap_kind``); with
    ``prompt_size``, a user kind also names the prompt's size class."""
    last: dict[str, TraceRequest] = {}
    next_at: dict[int, float] = {}
    for request in trace.requests:
        previous = last.get(request.session_id)
        if previous is not None:
            next_at[previous.line] = request.arrival_s
        last[request.session_id] = request
    turns = []
    last.clear()
    last_user_gap: dict[str, float] = {}  # the session's latest user gap *so far*
    for request in trace.requests:
        previous = last.get(request.session_id)
        if previous is not None and previous.finish_reason != "tool_calls":
            last_user_gap[request.session_id] = request.arrival_s - previous.arrival_s
        last[request.session_id] = request
        if request.end:
            kind = ENDED
        elif request.finish_reason == "tool_calls":
            kind = sorted(request.tool_names)[-1] if request.tool_names else "@unnamed"
        else:
            added = (request.input_length - previous.input_length - previous.output_length
                     if previous is not None else 0)
            kind = user_gap_kind(last_user_gap.get(request.session_id),
                                 0 < long_message_tokens <= added)
            if prompt_size:
                kind += prompt_size_class(request.input_length)
        gap = next_at.get(request.line, math.inf) - request.arrival_s
        turns.append(Turn(request.arrival_s, request.session_id, request.turn,
                          request.input_length,
                          request.block_ids[:request.full_blocks(trace.block_size)], kind,
                          gap <= window_s))
    return turns


def _hit(pool: Callable[[int], bool], blocks: Sequence[int]) -> int:
    hits = 0
    for block in blocks:
        if not pool(block):
            break
        hits += 1
    return hits


def run_lru(turns: Sequence[Turn], capacity: int, block_size: int) -> int:
    pool: collections.OrderedDict[int, None] = collections.OrderedDict()
    hit_tokens = 0
    for turn in turns:
        hit_tokens += _hit(pool.__contains__, turn.blocks) * block_size
        for block in reversed(turn.blocks):  # root most recent: leaf evicted first
            pool[block] = None
            pool.move_to_end(block)
        while len(pool) > capacity:
            pool.popitem(last=False)
    return hit_tokens


def run_belady(turns: Sequence[Turn], capacity: int, block_size: int) -> int:
    uses: dict[int, list[int]] = collections.defaultdict(list)
    for i, turn in enumerate(turns):
        for block in turn.blocks:
            uses[block].append(i)

    def next_use(block: int, i: int) -> int:
        later = uses[block]
        k = bisect.bisect_right(later, i)
        return later[k] if k < len(later) else 1 << 60

    pool: set[int] = set()
    heap: list[tuple[int, int]] = []
    hit_tokens = 0
    for i, turn in enumerate(turns):
        hit_tokens += _hit(pool.__contains__, turn.blocks) * block_size
        for block in turn.blocks:
            pool.add(block)
            heapq.heappush(heap, (-next_use(block, i), block))
        current, kept = set(turn.blocks), []
        while len(pool) > capacity:
            negative_next, block = heapq.heappop(heap)
            if block not in pool or -negative_next != next_use(block, i):
                continue  # stale entry
            if block in current:
                kept.append((negative_next, block))
            else:
                pool.discard(block)
        for entry in kept:
            heapq.heappush(heap, entry)
    return hit_tokens


@dataclass(slots=True)
class _Session:
    chain: list[int]
    opened_at: float
    kind: str
    depth: int
    returns: bool
    priority: float | None = None  # value_reviewed: the last value sent
    changed_at: float = 0.0
    reviews_done: int = 0
    # return_predictor_bound.py: the turn that opened the gap, its predicted return odds
    turn: Turn | None = None
    p: float = 0.0


@dataclass(slots=True)
class _ValueModel:
    """One pool ordered by session value; the planner's statistics learnt online."""

    policy: str
    capacity: int
    config: PlannerConfig
    stats: LearnedStats = field(default_factory=LearnedStats)
    owners: dict[int, set[str]] = field(default_factory=dict)  # resident block -> sessions
    sessions: dict[str, _Session] = field(default_factory=dict)
    pending: list[tuple[float, str, float]] = field(default_factory=list)  # window closes
    review_ages: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        ages, age = [0.0], self.config.idle_review_first_s
        while age < self.config.abandon_after_s:
            ages.append(age)
            age *= self.config.idle_review_growth
        self.review_ages = tuple(ages)

    def serve(self, turn: Turn) -> int:
        self._close_windows(turn.at)
        hits = _hit(self.owners.__contains__, turn.blocks)
        session = self.sessions.get(turn.session)
        if session is not None:
            for block in session.chain:
                owners = self.owners.get(block)
                if owners is not None:
                    owners.discard(turn.session)
            gap = turn.at - session.opened_at
            if gap <= self.config.return_window_s and session.kind != ENDED:
                self.stats.apply(GapObserved(session.kind, session.depth, gap))
                self.stats.apply(ReturnObserved(session.depth, True, session.kind))
        for block in turn.blocks:
            self.owners.setdefault(block, set()).add(turn.session)
        self.sessions[turn.session] = self._new_session(turn)
        heapq.heappush(self.pending, (turn.at + self.config.return_window_s, turn.session,
                                      turn.at))
        self._evict(turn)
        return hits

    def _new_session(self, turn: Turn) -> _Session:
        """The state a turn opens (a hook for return_predictor_bound.py's predictors)."""
        return _Session(list(turn.blocks), turn.at, turn.kind, turn.depth, turn.returns,
                        turn=turn)

    def _close_windows(self, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            _, name, opened_at = heapq.heappop(self.pending)
            session = self.sessions.get(name)
            if session is not None and session.opened_at == opened_at and (
                    session.kind != ENDED):
                self.stats.apply(ReturnObserved(session.depth, False, session.kind))

    def _value(self, session: _Session, now: float,
               density: Callable[[str, int, float], float]) -> tuple[float, float]:
        if session.kind == ENDED:
            return (-1.0, session.opened_at)
        idle = now - session.opened_at
        if self.policy == "value_knows_returns" and not session.returns:
            return (-1.0, session.opened_at)
        if self.policy != "value_reviewed":
            return (density(session.kind, session.depth, idle), session.opened_at)
        ages, done = self.review_ages, session.reviews_done
        if session.priority is None or (done < len(ages) and idle >= ages[done]):
            while done < len(ages) and idle >= ages[done]:
                done += 1
            value = density(session.kind, session.depth, ages[max(done - 1, 0)])
            priority = retain_priority(value)
            if session.priority is None or abs(priority - session.priority) >= (
                    self.config.refresh_priority_step):
                session.priority, session.changed_at = priority, now
            session.reviews_done = done
        return (session.priority, session.changed_at)

    def _evict(self, turn: Turn) -> None:
        excess = len(self.owners) - self.capacity
        if excess <= 0:
            return
        current = set(turn.blocks)
        orphans = [b for b, owners in self.owners.items() if not owners and b not in current]
        for block in orphans[:excess]:
            del self.owners[block]
        excess = len(self.owners) - self.capacity
        if excess <= 0:
            return
        cache: dict[tuple[str, int, int], float] = {}
        horizon = self.config.horizon_s

        def density(kind: str, depth: int, idle: float) -> float:
            # Idle times on a 5% log grid: the value is smooth in them, and this model
            # evaluates it for every resident session at every eviction.
            key = (kind, min(depth, 8), round(math.log1p(idle) * 20.0))
            if key not in cache:
                cache[key] = self.stats.hit_density(kind, depth, idle, horizon)
            return cache[key]

        ranked = sorted((self._value(s, turn.at, density), name)
                        for name, s in self.sessions.items() if s.chain and name != turn.session)
        for _, name in ranked:
            chain = self.sessions[name].chain
            while chain and excess > 0:
                block = chain.pop()
                owners = self.owners.get(block)
                if owners is None:
                    continue
                owners.discard(name)
                if not owners and block not in current:
                    del self.owners[block]
                    excess -= 1
            if excess <= 0:
                return


def run_value(turns: Sequence[Turn], capacity: int, block_size: int, policy: str,
              progress: Callable[[int], None], stats: LearnedStats | None = None) -> int:
    model = _ValueModel(policy, capacity, PlannerConfig(), stats or LearnedStats())
    hit_tokens = 0
    for i, turn in enumerate(turns):
        hit_tokens += model.serve(turn) * block_size
        if i % 500 == 0:
            progress(i)
    return hit_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--blocks", type=int, required=True, help="pool size in blocks")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--prompt-size", choices=("off", "kind", "returns"), default="off",
                        help="learn user gaps and returns (kind), or returns only, per "
                             "prompt-size class (module doc)")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    config = PlannerConfig()
    turns = turns_of(trace, config.return_window_s, config.long_message_tokens,
                     prompt_size=args.prompt_size != "off")
    prompt = sum(t.prompt_tokens for t in turns)
    results: dict[str, float] = {}
    for policy in args.policies.split(","):
        started = time.perf_counter()

        def progress(i: int, policy: str = policy) -> None:
            print(f"\r{policy}: {i}/{len(turns)}", end="", file=sys.stderr, flush=True)

        if policy == "lru":
            hits = run_lru(turns, args.blocks, trace.block_size)
        elif policy == "belady":
            hits = run_belady(turns, args.blocks, trace.block_size)
        elif policy in POLICIES:
            hits = run_value(turns, args.blocks, trace.block_size, policy, progress,
                             ReturnsBySizeStats() if args.prompt_size == "returns" else None)
        else:
            parser.error(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
        results[policy] = hits / prompt
        ratio = f"{results[policy] / results['lru']:.2f}x LRU" if "lru" in results else ""
        print(f"\r{policy:20s} {results[policy]:7.2%}  {ratio:10s} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
