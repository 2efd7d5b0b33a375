"""Would a better *online* return predictor buy hits? Measured in the value-order block model.

``value_order_bound.py`` shows that knowing which sessions return (hindsight) lifts one
value-ordered pool from ~17% to ~33% of prompt tokens at 5,000 blocks, while the planner's
own predictor (gap kind with tempo and long messages, depth) reaches AUC ~0.65. This script
asks what a predictor a live router could run buys, and how much AUC it would take.

Predictors of "the session's next turn comes within the 600 s return window", all learnt
online in trace order: a label is learnt when a live router would learn it (at the next
turn's arrival for a return, when the window closes for a non-return), and a turn is scored
before its own label is known.

- ``planner``: ``LearnedStats.return_probability(depth, kind)`` (the planner's own figure).
- ``beta_size``: per-bucket return counts, (kind, depth) refined by the log2 prompt size,
  each level shrunk toward the coarser one (10 pseudo-turns).
- ``lr_planner`` / ``lr_size`` / ``lr_all``: online logistic regression (AdaGrad, one-hot
  buckets and their crosses) on the planner's features, plus the prompt size, plus
  everything else a router knows when the response ends (output length, how much the user
  added, the session's previous gaps, its age and turns, the number of sessions live).
- ``noisy<S>``: a calibrated *noisy oracle*: the planner's odds times the likelihood ratio
  of ``label + N(0, S)`` (one seeded draw per turn); S sets its AUC (2.0, 1.4, 1.0, 0.7,
  0.5 ...). It looks at the label: a ruler for how much AUC it takes, not a predictor.
- ``knows``: the hindsight label itself (0 or 1).

Orders (``MODE:PREDICTOR``; the lowest-valued resident session loses its deepest block):

- ``density``: the planner's hit density, its return probability replaced by the
  predictor's (gap distributions stay the planner's learnt ones). ``density:planner`` is
  ``value_order_bound.py``'s ``value`` (17.08% against 17.04% at 5,000 blocks: here the
  probability is re-read at the planner's idle-review ages, not at every eviction).
- ``within``: P(next turn within the 100 s horizon | idle so far), no division by occupancy.
- ``alive``: P(the session still returns at all | idle so far), no time at all.
- ``p``: the predictor's static probability (ties: older first).

    .venv/bin/python tests/benchmarks/sim/return_predictor_bound.py \\
        ../shared/traces/mooncake_conversation_trace.jsonl --blocks 5000 \\
        --orders density:planner,density:lr_all

``--warm same`` teaches each predictor every label of the trace first (optimistic: each
turn's own label included); ``--warm cross`` scores the first half's turns with a predictor
taught the second half's labels (a router warm from other traffic like it).

Prints the predictors' online AUC (per turn and per prompt block, over the trace and after
its first 1,200 s), then one line per order: prompt-token hit rate and its ratio to LRU.
Progress on stderr. Each order over the Mooncake trace takes 1-3 minutes.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvhint.router.policy.plan_types import PlannerConfig
from kvhint.router.policy.stats import LearnedStats, ReturnObserved
from kvhint.router.sim.trace import Trace, load_trace

try:
    from value_order_bound import ENDED, Turn, _ValueModel, run_lru, turns_of
except ImportError:  # imported as tests.benchmarks.sim.return_predictor_bound
    from tests.benchmarks.sim.value_order_bound import (
        ENDED,
        Turn,
        _ValueModel,
        run_lru,
        turns_of,
    )

MODES = ("density", "within", "alive", "p")


def _log2_bucket(x: float) -> int:
    return int(math.log2(max(x, 1.0)))


@dataclass(frozen=True, slots=True)
class Context:
    """What a live router knows about a turn when its response ends."""

    turn: Turn
    output_tokens: int
    added_tokens: int  # prompt growth past the previous prompt + output (0: first turn)
    gaps: tuple[float, ...]  # the session's earlier gaps, oldest first
    age_s: float  # since the session's first turn
    live_sessions: int  # sessions with a turn in the last 600 s


def contexts_of(trace: Trace, turns: Sequence[Turn], window_s: float) -> list[Context]:
    last: dict[str, tuple[float, int, int, float, tuple[float, ...]]] = {}
    recent: collections.deque[tuple[float, str]] = collections.deque()
    live: collections.Counter[str] = collections.Counter()
    out = []
    for request, turn in zip(trace.requests, turns, strict=True):
        while recent and recent[0][0] < request.arrival_s - window_s:
            _, name = recent.popleft()
            live[name] -= 1
            if not live[name]:
                del live[name]
        recent.append((request.arrival_s, request.session_id))
        live[request.session_id] += 1
        previous = last.get(request.session_id)
        if previous is None:
            added, gaps, started = 0, (), request.arrival_s
        else:
            at, prompt, output, started, gaps = previous
            added = max(request.input_length - prompt - output, 0)
            gaps = gaps + (request.arrival_s - at,)
        last[request.session_id] = (request.arrival_s, request.input_length,
                                    request.output_length, started, gaps)
        out.append(Context(turn, request.output_length, added, gaps,
                           request.arrival_s - started, len(live)))
    return out


# -- online learners ------------------------------------------------------------------------


class Learner:
    def predict(self, c: Context) -> float:
        raise NotImplementedError

    def learn(self, c: Context, returned: bool) -> None:
        raise NotImplementedError


@dataclass
class PlannerLearner(Learner):
    stats: LearnedStats = field(default_factory=LearnedStats)

    def predict(self, c: Context) -> float:
        return self.stats.return_probability(c.turn.depth, c.turn.kind)

    def learn(self, c: Context, returned: bool) -> None:
        self.stats.apply(ReturnObserved(c.turn.depth, returned, c.turn.kind))


@dataclass
class BetaLearner(Learner):
    """Return counts per bucket at each level of ``keys`` (coarse to fine), each level's
    rate shrunk toward the coarser level's with ``strength`` pseudo-turns."""

    keys: tuple[Callable[[Context], object], ...]
    strength: float = 10.0
    prior: float = 0.33
    counts: dict[tuple[int, object], list[float]] = field(default_factory=dict)

    def predict(self, c: Context) -> float:
        p = self.prior
        for level, key in enumerate(self.keys):
            returned, seen = self.counts.get((level, key(c)), (0.0, 0.0))
            p = (returned + self.strength * p) / (seen + self.strength)
        return p

    def learn(self, c: Context, returned: bool) -> None:
        for level, key in enumerate(self.keys):
            count = self.counts.setdefault((level, key(c)), [0.0, 0.0])
            count[0] += returned
            count[1] += 1.0


@dataclass
class LogisticLearner(Learner):
    """Online logistic regression over one-hot features, AdaGrad steps, light L2."""

    features: Callable[[Context], list[str]]
    rate: float = 0.1
    l2: float = 1e-5
    weights: dict[str, float] = field(default_factory=dict)
    squares: dict[str, float] = field(default_factory=dict)

    def _logit(self, names: list[str]) -> float:
        return sum(self.weights.get(n, 0.0) for n in names)

    def predict(self, c: Context) -> float:
        z = max(min(self._logit(self.features(c)), 30.0), -30.0)
        return 1.0 / (1.0 + math.exp(-z))

    def learn(self, c: Context, returned: bool) -> None:
        names = self.features(c)
        z = max(min(self._logit(names), 30.0), -30.0)
        error = 1.0 / (1.0 + math.exp(-z)) - float(returned)
        for n in names:
            w = self.weights.get(n, 0.0)
            g = error + self.l2 * w
            s = self.squares.get(n, 1e-6) + g * g
            self.squares[n] = s
            self.weights[n] = w - self.rate * g / math.sqrt(s)


def _planner_features(c: Context) -> list[str]:
    d = min(c.turn.depth, 8)
    return ["bias", f"k={c.turn.kind}", f"d={d}", f"kd={c.turn.kind}|{d}"]


def _size_features(c: Context) -> list[str]:
    d1 = min(c.turn.depth, 2)
    size = _log2_bucket(c.turn.prompt_tokens)
    return _planner_features(c) + [f"s={size}", f"sd={size}|{d1}"]


def _all_features(c: Context) -> list[str]:
    d1 = min(c.turn.depth, 2)
    last_gap = _log2_bucket(c.gaps[-1]) if c.gaps else -1
    min_gap = _log2_bucket(min(c.gaps)) if c.gaps else -1
    return _size_features(c) + [
        f"o={_log2_bucket(c.output_tokens)}",
        f"od={_log2_bucket(c.output_tokens)}|{d1}",
        f"a={_log2_bucket(c.added_tokens) if c.added_tokens else -1}",
        f"g={last_gap}", f"gm={min_gap}",
        f"age={_log2_bucket(c.age_s)}",
        f"n={_log2_bucket(len(c.gaps) + 1)}",
        f"live={_log2_bucket(c.live_sessions)}",
        f"so={_log2_bucket(c.turn.prompt_tokens)}|{_log2_bucket(c.output_tokens)}",
    ]


LEARNERS: dict[str, Callable[[], Learner]] = {
    "planner": PlannerLearner,
    "beta_size": lambda: BetaLearner((
        lambda c: (c.turn.kind, min(c.turn.depth, 8)),
        lambda c: (c.turn.kind, min(c.turn.depth, 8), _log2_bucket(c.turn.prompt_tokens)))),
    "lr_planner": lambda: LogisticLearner(_planner_features),
    "lr_size": lambda: LogisticLearner(_size_features),
    "lr_all": lambda: LogisticLearner(_all_features),
}


def label_times(contexts: Sequence[Context], window_s: float) -> list[tuple[float, int]]:
    """When a live router learns each turn's label: a return at the next turn's arrival, a
    non-return when the window closes (ended turns teach nothing). A heap."""
    next_at: dict[int, float] = {}
    last: dict[str, int] = {}
    for i, c in enumerate(contexts):
        j = last.get(c.turn.session)
        if j is not None:
            next_at[j] = c.turn.at
        last[c.turn.session] = i
    due = [(next_at[i] if c.turn.returns else c.turn.at + window_s, i)
           for i, c in enumerate(contexts) if c.turn.kind != ENDED]
    heapq.heapify(due)
    return due


def online_scores(contexts: Sequence[Context], learner: Learner, window_s: float
                  ) -> list[float]:
    """Each turn's score at its arrival, before its own label is known."""
    due = label_times(contexts, window_s)
    scores = []
    for c in contexts:
        while due and due[0][0] <= c.turn.at:
            _, j = heapq.heappop(due)
            learner.learn(contexts[j], contexts[j].turn.returns)
        scores.append(learner.predict(c))
    return scores


@dataclass
class NoisyOracle(Learner):
    """The planner's odds times the likelihood ratio of a noisy look at the label,
    ``label + N(0, sigma)`` (one draw per turn): a calibrated predictor of chosen AUC."""

    sigma: float
    seed: int = 1
    planner: PlannerLearner = field(default_factory=PlannerLearner)
    looks: dict[int, float] = field(default_factory=dict)

    def predict(self, c: Context) -> float:
        look = self.looks.get(id(c))
        if look is None:
            rng = random.Random(f"{self.seed}|{c.turn.session}|{c.turn.at}")
            look = self.looks[id(c)] = float(c.turn.returns) + rng.gauss(0.0, self.sigma)
        p = min(max(self.planner.predict(c), 1e-6), 1 - 1e-6)
        z = math.log(p / (1 - p)) + (look - 0.5) / (self.sigma * self.sigma)
        return 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))

    def learn(self, c: Context, returned: bool) -> None:
        self.planner.learn(c, returned)


class Hindsight(Learner):
    def predict(self, c: Context) -> float:
        return float(c.turn.returns)

    def learn(self, c: Context, returned: bool) -> None:
        pass


def weighted_auc(scores: Sequence[float], labels: Sequence[bool],
                 weights: Sequence[float]) -> float:
    """ROC AUC with each item weighted (ties count half)."""
    items = sorted(zip(scores, labels, weights))
    pos = sum(w for _, y, w in items if y)
    neg = sum(w for _, y, w in items if not y)
    below_neg, total, i = 0.0, 0.0, 0
    while i < len(items):
        j = i
        tie_pos = tie_neg = 0.0
        while j < len(items) and items[j][0] == items[i][0]:
            tie_pos += items[j][2] if items[j][1] else 0.0
            tie_neg += 0.0 if items[j][1] else items[j][2]
            j += 1
        total += tie_pos * (below_neg + tie_neg / 2)
        below_neg += tie_neg
        i = j
    return total / (pos * neg)


# -- the block model with a predictor ---------------------------------------------------------


def density_with_p(stats: LearnedStats, kind: str, depth: int, idle_s: float,
                   horizon_s: float, p: float, mode: str) -> float:
    """``LearnedStats._hit_density`` with the return probability ``p`` given (``density``),
    or only its numerator (``within``), or P(returns at all | idle) (``alive``)."""
    survival = stats._survival_curve(kind, depth)  # noqa: SLF001 (a bound, not the planner)
    s_now = survival(idle_s)
    alive = p * s_now + (1.0 - p)
    if alive <= 0 or horizon_s <= 0:
        return 0.0
    if mode == "alive":
        return p * s_now / alive
    hit = p * max(s_now - survival(idle_s + horizon_s), 0.0) / alive
    if mode == "within":
        return hit
    points = [horizon_s * 2.0 ** (-k) for k in range(10, -1, -1)]
    occupancy, previous_t, previous_v = 0.0, 0.0, 1.0
    for t in points:
        value = (p * survival(idle_s + t) + (1.0 - p)) / alive
        occupancy += 0.5 * (value + previous_v) * (t - previous_t)
        previous_t, previous_v = t, value
    return hit / max(occupancy, 1e-9)


@dataclass(slots=True)
class _PredictedModel(_ValueModel):
    """``value_order_bound``'s pool (policy ``value``: re-valued at every eviction), each
    session's return probability read from the predictor when its gap opens and again at
    the planner's idle-review ages (15 s, then x1.5), as the planner would."""

    mode: str = "density"
    predict: Callable[[Turn], float] = lambda turn: 0.0
    memo: dict[tuple[str, int, int, int], float] = field(default_factory=dict)

    def _new_session(self, turn: Turn):  # noqa: ANN202 (value_order_bound's _Session)
        session = _ValueModel._new_session(self, turn)
        session.p = self.predict(turn)
        self.memo.clear()  # the statistics may have changed since the last turn
        return session

    def _value(self, session, now, density):  # noqa: ANN001, ANN202 (_ValueModel's)
        if session.kind == ENDED:
            return (-1.0, session.opened_at)
        idle = now - session.opened_at
        ages, done = self.review_ages, session.reviews_done
        if done < len(ages) and idle >= ages[done]:
            while done < len(ages) and idle >= ages[done]:
                done += 1
            session.reviews_done = done
            session.p = self.predict(session.turn)
        if self.mode == "p":
            return (session.p, session.opened_at)
        grid = round(session.p * 200)
        key = (session.kind, min(session.depth, 8), round(math.log1p(idle) * 20.0), grid)
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = density_with_p(
                self.stats, session.kind, session.depth, idle, self.config.horizon_s,
                grid / 200, self.mode)
        return (value, session.opened_at)


def run_order(contexts: Sequence[Context], learner: Learner, capacity: int,
              block_size: int, mode: str, window_s: float,
              progress: Callable[[int], None]) -> int:
    """Prompt tokens hit by one pool ordered by ``mode`` over ``learner``'s online
    predictions (labels fed to it as a live router learns them)."""
    context_of = {id(c.turn): c for c in contexts}
    model = _PredictedModel("value", capacity, PlannerConfig(), LearnedStats(), mode=mode,
                            predict=lambda turn: learner.predict(context_of[id(turn)]))
    due = label_times(contexts, window_s)
    hit_tokens = 0
    for i, c in enumerate(contexts):
        while due and due[0][0] <= c.turn.at:
            _, j = heapq.heappop(due)
            learner.learn(contexts[j], contexts[j].turn.returns)
        hit_tokens += model.serve(c.turn) * block_size
        if i % 500 == 0:
            progress(i)
    return hit_tokens


@dataclass
class CrossWarm(Learner):
    """``--warm cross``: turns of the trace's first half are scored by a learner first
    taught every label of the second half (a router warm from other traffic of the same
    kind, never its own turns), the rest by the plain online one; both learn online."""

    first: Learner
    rest: Learner
    half_at: float

    def predict(self, c: Context) -> float:
        return (self.first if c.turn.at < self.half_at else self.rest).predict(c)

    def learn(self, c: Context, returned: bool) -> None:
        self.first.learn(c, returned)
        self.rest.learn(c, returned)


def _learner(name: str) -> Learner:
    if name == "knows":
        return Hindsight()
    if name.startswith("noisy"):
        return NoisyOracle(float(name[len("noisy"):]))
    if name in LEARNERS:
        return LEARNERS[name]()
    raise ValueError(f"unknown predictor {name!r} (known: {', '.join(LEARNERS)}, knows, "
                     "noisy<sigma>)")


def make_learner(name: str, contexts: Sequence[Context], warm: str = "off") -> Learner:
    """``name``'s learner. ``warm`` ``same``: first taught every label of the trace (as if
    a router had learnt from this very traffic before; optimistic: it has seen each
    turn's own label). ``cross``: :class:`CrossWarm`."""
    learner = _learner(name)
    if warm == "off":
        return learner
    half = len(contexts) // 2
    taught = contexts if warm == "same" else contexts[half:]
    for c in taught:
        if c.turn.kind != ENDED:
            learner.learn(c, c.turn.returns)
    if warm == "same":
        return learner
    return CrossWarm(learner, _learner(name), contexts[half].turn.at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--blocks", type=int, default=0, help="pool size (0: AUC only)")
    parser.add_argument("--orders", default="density:planner,density:lr_all",
                        help="comma-separated MODE:PREDICTOR (module doc)")
    parser.add_argument("--auc", default=",".join(LEARNERS),
                        help="predictors whose online AUC to print")
    parser.add_argument("--warm", choices=("off", "same", "cross"), default="off",
                        help="teach each predictor labels first (make_learner): what a "
                             "warm router could reach")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    config = PlannerConfig()
    window = config.return_window_s
    turns = turns_of(trace, window, config.long_message_tokens)
    contexts = contexts_of(trace, turns, window)
    labels = [t.returns for t in turns]
    blocks = [max(len(t.blocks), 1) for t in turns]

    print(f"{len(turns)} turns, {sum(labels) / len(turns):.1%} return within {window:g} s "
          f"({sum(b for b, y in zip(blocks, labels) if y) / sum(blocks):.1%} of blocks)")
    orders = [o.split(":", 1) for o in args.orders.split(",")] if args.blocks else []
    for name in dict.fromkeys([n for n in args.auc.split(",") if n]
                              + [p for _, p in orders]):
        scores = online_scores(contexts, make_learner(name, contexts, args.warm), window)
        late = [i for i, t in enumerate(turns) if t.at >= 2 * window]  # once warmed up
        warmed = weighted_auc([scores[i] for i in late], [labels[i] for i in late],
                              [1.0] * len(late))
        warmed_blocks = weighted_auc([scores[i] for i in late], [labels[i] for i in late],
                                     [blocks[i] for i in late])
        print(f"AUC {name:12s} per turn {weighted_auc(scores, labels, [1.0] * len(turns)):.3f}"
              f"  per block {weighted_auc(scores, labels, blocks):.3f}  after "
              f"{2 * window:g} s: per turn {warmed:.3f}  per block {warmed_blocks:.3f}",
              flush=True)
    if not args.blocks:
        return
    prompt = sum(t.prompt_tokens for t in turns)
    lru = run_lru(turns, args.blocks, trace.block_size) / prompt
    print(f"{'lru':24s} {lru:7.2%}", flush=True)
    for mode, name in orders:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
        started = time.perf_counter()

        def progress(i: int, label: str = f"{mode}:{name}") -> None:
            print(f"\r{label}: {i}/{len(turns)}", end="", file=sys.stderr, flush=True)

        learner = make_learner(name, contexts, args.warm)
        rate = run_order(contexts, learner, args.blocks, trace.block_size, mode, window,
                         progress) / prompt
        print(f"\r{mode + ':' + name:24s} {rate:7.2%}  {rate / lru:.2f}x LRU "
              f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
