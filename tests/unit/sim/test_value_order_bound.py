"""The value-ordering bound (tests/benchmarks/sim/value_order_bound.py) on a hand-computed
trace: LRU order, hindsight, and that the online value does not see the future."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvhint.router.sim.trace import load_trace

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "sim" / "value_order_bound.py"


@pytest.fixture(scope="module")
def bound():
    spec = importlib.util.spec_from_file_location("value_order_bound", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture
def turns(bound, tmp_path):
    # 4-block pool. A and B are 2-block first turns; C's arrival overflows the pool by
    # two blocks; only A comes back (2 s later: within the 600 s return window).
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 1024, "output_length": 1, "hash_ids": [3, 4]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 1, "hash_ids": [5, 6]},
        {"timestamp": 3000, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 7]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return bound.turns_of(load_trace(path), window_s=600.0, long_message_tokens=2048)


def test_turns_carry_sessions_depth_and_hindsight(turns):
    assert [t.session for t in turns] == ["m000000", "m000001", "m000002", "m000000"]
    assert [t.depth for t in turns] == [1, 1, 1, 2]
    assert [t.returns for t in turns] == [True, False, False, False]
    assert turns[3].blocks == (1, 2, 7)


def test_lru_evicts_the_oldest_session(bound, turns):
    # C evicts A's blocks (the least recently used), so A's return hits nothing.
    assert bound.run_lru(turns, 4, 512) == 0


def test_belady_and_hindsight_keep_the_session_that_returns(bound, turns):
    # Both evict B (never used again) and keep A: A's return hits its 2 blocks.
    assert bound.run_belady(turns, 4, 512) == 1024
    assert bound.run_value(turns, 4, 512, "value_knows_returns", lambda _: None) == 1024


def test_online_value_cannot_tell_a_from_b(bound, turns):
    # A and B look alike (depth 1, same gap kind, nothing learnt yet): the older, A,
    # goes first, as in LRU. The online policies do not see the future.
    for policy in ("value", "value_reviewed"):
        assert bound.run_value(turns, 4, 512, policy, lambda _: None) == 0


def test_prompt_size_classes_name_user_kinds_and_returns_only_learns_them_apart(
        bound, tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 9000, "output_length": 1,
         "hash_ids": list(range(10, 28))},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    turns = bound.turns_of(load_trace(path), 600.0, 2048, prompt_size=True)
    assert [t.kind.rsplit(":", 1)[-1] for t in turns] == ["size-s", "size-l"]
    plain = bound.turns_of(load_trace(path), 600.0, 2048)
    assert [t.kind for t in plain] == [t.kind.split(":size-")[0] for t in turns]
    # "returns": gaps are learnt and read under the kind without its size class.
    stats = bound.ReturnsBySizeStats()
    for _ in range(10):
        stats.apply(bound.GapObserved(turns[0].kind, 1, 30.0))
    assert set(stats.gaps) >= {f"{plain[0].kind}|1"}
    assert not any("size-" in key for key in stats.gaps)
    assert stats.gap_quantile(turns[1].kind, 1, 0.5) == stats.gap_quantile(plain[0].kind, 1, 0.5)


def test_return_features_auc_by_hand(bound):
    spec = importlib.util.spec_from_file_location("return_features",
                                                  SCRIPT.with_name("return_features.py"))
    assert spec is not None and spec.loader is not None
    features = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(features)  # finds value_order_bound in sys.modules
    assert features.auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75
    assert features.auc([0.5, 0.5], [False, True]) == 0.5  # a tie counts half
