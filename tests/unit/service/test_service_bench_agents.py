"""The agent benchmark's summary: per-turn cached share and session moves."""

from __future__ import annotations

import pytest

from kvhint.router.bench.agents import AgentRunResult, TurnResult, pooled_summary

pytestmark = pytest.mark.unit


def turn(session: str, number: int, prompt: int, cached: int, worker: str = "") -> TurnResult:
    return TurnResult(session, number, ok=True, status=200, prompt_tokens=prompt,
                      cached_tokens=cached, worker=worker)


def test_moves_count_follow_up_turns_on_another_worker() -> None:
    result = AgentRunResult([turn("b", 2, 10, 0, "w0"), turn("a", 1, 10, 0, "w0"),
                             turn("a", 2, 10, 0, "w1"), turn("a", 3, 10, 0, "w1"),
                             turn("b", 1, 10, 0, "w0")])
    assert result.moved_turns() == 1
    assert result.summary()["moved_turns"] == 1


def test_moves_unknown_without_worker_header() -> None:
    assert AgentRunResult([turn("a", 1, 10, 0), turn("a", 2, 10, 5)]).moved_turns() is None


def test_cached_share_by_turn() -> None:
    result = AgentRunResult([turn("a", 1, 100, 0), turn("b", 1, 100, 50),
                             turn("a", 2, 200, 150)])
    assert result.cached_share_by_turn() == {1: 0.25, 2: 0.75}


def test_pooled_rounds_count_moves_per_round() -> None:
    """Each round reuses the session names on new workers: a session's first turn in
    round 2 is not a move from where round 1 left it."""
    first = [turn("a", 1, 10, 0, "w0"), turn("a", 2, 10, 5, "w1")]
    second = [turn("a", 1, 10, 0, "w2"), turn("a", 2, 10, 5, "w2")]
    pooled = pooled_summary([first, second], wall_s=3.0)
    assert pooled["moved_turns"] == 1
    assert pooled["requests"] == 4 and pooled["cached_share"] == 0.25
    assert pooled_summary([[turn("a", 1, 10, 0)]], 1.0)["moved_turns"] is None
