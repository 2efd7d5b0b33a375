"""The return-predictor bound (tests/benchmarks/sim/return_predictor_bound.py) on
hand-computed traces: what a turn's context holds, that labels are learnt only when a live
router would know them, that the planner's predictor reproduces the planner's value, and
that hindsight keeps the session that returns."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvhint.router.policy.stats import GapObserved, LearnedStats, ReturnObserved
from kvhint.router.sim.trace import load_trace

SIM = Path(__file__).parents[2] / "benchmarks" / "sim"


@pytest.fixture(scope="module")
def bound():
    loaded = []
    for name in ("value_order_bound", "return_predictor_bound"):
        spec = importlib.util.spec_from_file_location(name, SIM / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
        loaded.append(name)
    yield module
    for name in loaded:
        del sys.modules[name]


def _trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_trace(path)


@pytest.fixture
def trace(tmp_path):
    # value_order_bound's hand trace: a 4-block pool, A and B 2-block first turns, C's
    # arrival overflows it by two blocks; only A comes back (at 3 s, adding 512 tokens
    # beyond its 1,024-token prompt and 100-token answer: 412 added).
    return _trace(tmp_path, [
        {"timestamp": 0, "input_length": 1024, "output_length": 100, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 1024, "output_length": 1, "hash_ids": [3, 4]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 1, "hash_ids": [5, 6]},
        {"timestamp": 3000, "input_length": 1536, "output_length": 1,
         "hash_ids": [1, 2, 7]},
    ])


def test_a_context_holds_only_what_a_router_knows_at_that_turn(bound, trace):
    turns = bound.turns_of(trace, 600.0, 2048)
    contexts = bound.contexts_of(trace, turns, 600.0)
    first, again = contexts[0], contexts[3]
    assert (first.added_tokens, first.gaps, first.age_s) == (0, (), 0.0)
    assert (again.added_tokens, again.gaps, again.age_s) == (412, (3.0,), 3.0)
    assert again.output_tokens == 1 and again.live_sessions == 3


def test_labels_are_learnt_when_a_live_router_learns_them(bound, trace):
    turns = bound.turns_of(trace, 600.0, 2048)
    contexts = bound.contexts_of(trace, turns, 600.0)
    due = sorted(bound.label_times(contexts, 600.0))
    # A's return is learnt at its next arrival (3 s); the others when their window closes.
    assert due == [(3.0, 0), (601.0, 1), (602.0, 2), (603.0, 3)]
    seen = []

    class Recorder(bound.Learner):
        def predict(self, c):
            return float(len(seen))

        def learn(self, c, returned):
            seen.append((c.turn.at, returned))

    # No turn's score sees its own label: A's return is learnt just before A's second turn.
    assert bound.online_scores(contexts, Recorder(), 600.0) == [0.0, 0.0, 0.0, 1.0]
    assert seen == [(0.0, True)]


def test_weighted_auc_by_hand(bound):
    scores, labels = [0.1, 0.4, 0.35, 0.8], [False, False, True, True]
    assert bound.weighted_auc(scores, labels, [1.0] * 4) == 0.75
    # The 0.35 positive counts twice: it beats one of two negatives (2 of 4 pair weights).
    assert bound.weighted_auc(scores, labels, [1.0, 1.0, 2.0, 1.0]) == pytest.approx(4 / 6)
    assert bound.weighted_auc([0.5, 0.5], [False, True], [1.0, 1.0]) == 0.5


def test_density_with_the_planners_p_is_the_planners_hit_density(bound):
    stats = LearnedStats()
    for seconds in (20.0, 40.0, 90.0, 300.0) * 5:
        stats.apply(GapObserved("@user", 1, seconds))
        stats.apply(ReturnObserved(1, seconds < 100.0, "@user"))
    p = stats.return_probability(1, "@user")
    for idle in (0.0, 30.0, 200.0):
        assert bound.density_with_p(stats, "@user", 1, idle, 100.0, p, "density") == (
            pytest.approx(stats.hit_density("@user", 1, idle, 100.0)))
        assert bound.density_with_p(stats, "@user", 1, idle, 100.0, p, "within") == (
            pytest.approx(stats.return_within("@user", 1, idle, 100.0)))


def test_hindsight_keeps_the_session_that_returns_and_the_planner_cannot(bound, trace):
    turns = bound.turns_of(trace, 600.0, 2048)
    contexts = bound.contexts_of(trace, turns, 600.0)
    for mode in bound.MODES:
        assert bound.run_order(contexts, bound.Hindsight(), 4, 512, mode, 600.0,
                               lambda _: None) == 1024
        # A and B look alike to the planner: the older, A, goes first, as in LRU.
        assert bound.run_order(contexts, bound.PlannerLearner(), 4, 512, mode, 600.0,
                               lambda _: None) == 0


def test_cross_warm_scores_each_half_with_what_the_other_half_taught(bound, trace):
    turns = bound.turns_of(trace, 600.0, 2048)
    contexts = bound.contexts_of(trace, turns, 600.0)
    learner = bound.make_learner("planner", contexts, "cross")
    # The first half (A, B) is scored by a learner taught the second half's labels (C and
    # A's second turn: neither returns), never its own; the second half by the cold one.
    assert learner.half_at == 2.0
    cold = bound.PlannerLearner().predict(contexts[0])
    assert learner.predict(contexts[0]) < cold
    assert learner.predict(contexts[2]) == cold
    same = bound.make_learner("planner", contexts, "same")
    # "same" was taught every label, A's own return included: it rates A higher.
    assert same.predict(contexts[0]) > learner.predict(contexts[0])
