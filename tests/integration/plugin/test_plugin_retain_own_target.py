"""A Retain that needs room in the retain budget never displaces its own target's blocks,
on vLLM's real Scheduler and block pool (no model). Those blocks, held by a lower-ranked
claim (here the planner's on the same session), need no room; displaced, they needed room
again, and the Retain was clipped anyway while a claim it outranks kept its blocks."""

from __future__ import annotations

from scheduler_fixtures import owned_retain, retained_of, sched, turn

from kvhint.schemas import HintOwner

AGENT, PLANNER = HintOwner.AGENT, HintOwner.PLANNER


def test_a_retain_displaces_other_claims_not_its_own_targets_lower_claim() -> None:
    h = sched(retain_budget_fraction=0.1)  # 6 blocks
    turn(h, "s", [1, 2, 3, 4])
    turn(h, "t", [5, 6])
    assert owned_retain(h, "s", 60, PLANNER, "p-s").applied.blocks == 4
    assert owned_retain(h, "t", 70, PLANNER, "p-t").applied.blocks == 2
    turn(h, "s", [1, 2, 3, 4, 7, 8])  # the session's next turn: 2 blocks more
    assert len(h.connector.core.index.session_blocks("s")) == 6
    outcome = owned_retain(h, "s", 50, AGENT, "a-s")
    # Before: the planner's claim on s (the lowest rank) was displaced first, 2 of s's own
    # blocks, which then needed room too: clipped to 4 of 6, and t kept its 2 blocks.
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 6), outcome
    assert [retained_of(h, s) for s in ("s", "t")] == [6, 0]
    releases = {(r.action_id, r.reason.value): r.released.blocks
                for r in h.connector.core.executor.take_releases()}
    assert releases == {("p-t", "displaced"): 2}
    holds = h.connector.core.executor.holds
    assert holds.counters.kept_in_use_under_pressure == 0  # displacement is no relief
    assert h.connector.core.executor.retained_blocks == 6
