"""What a session keeps in memory is bounded (security review): the block hashes of its
last prompt only when a worker answered it, at most the longest prompt the workers take,
and its last 32 tool gaps, as its stored row does."""

from __future__ import annotations

import asyncio

from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.sessions import MAX_GAPS_KEPT

from tests.unit.service.test_service_planning import build


def _lifecycle(**kwargs) -> SessionLifecycle:
    _r, metrics, _l, hints, sessions, _lc, _i, _rt = build(["w0"])
    return SessionLifecycle(sessions, hints, metrics, hints_enabled=False,
                            forget_after_s=3600, **kwargs)


def test_a_refused_prompts_hashes_are_not_kept_and_kept_ones_are_capped() -> None:
    lifecycle = _lifecycle(max_prompt_blocks=5)

    async def turn(hashes: tuple[int, ...], answered: bool) -> tuple[int, ...]:
        record = lifecycle.begin_turn("default", "s")
        await lifecycle.routed(record, "w0", 4 * len(hashes), 0, hashes)
        await lifecycle.finished(record, "w0", None, False, answered=answered)
        return record.last_block_hashes

    assert asyncio.run(turn(tuple(range(1, 11)), True)) == (1, 2, 3, 4, 5)
    assert asyncio.run(turn(tuple(range(100, 103)), False)) == (1, 2, 3, 4, 5)
    assert asyncio.run(turn(tuple(range(100, 103)), True)) == (100, 101, 102)


def test_a_sessions_tool_gaps_in_memory_are_capped_as_its_stored_row() -> None:
    lifecycle = _lifecycle()
    for n in range(MAX_GAPS_KEPT + 10):
        record = lifecycle.begin_turn("default", "s")
        record.inflight = 0
        record.open_gap = {"tools": [f"t{n}"], "started_at": 0.0}
    record = lifecycle.begin_turn("default", "s")
    assert len(record.gaps) == MAX_GAPS_KEPT
    assert record.gaps[-1]["tools"] == [f"t{MAX_GAPS_KEPT + 9}"]
