"""An agent runtime's Retains (owner ``agent``, the hints API) against the router
planner's, on vLLM's real Scheduler and block pool (no model): every agent claim ranks
above every planner claim, whatever their priorities, for the retain budget and under
memory pressure; among one owner's claims the higher priority still wins. A Retain the
budget clips says what holds the room, in words a tenant may read
(router/service/tenant_reasons.py keeps them, drops the figures)."""

from __future__ import annotations

from scheduler_fixtures import hint, owned_retain, retained_of, sched, turn

from kvhint.engine_plugin.headless import HeadlessScheduler
from kvhint.router.service.tenant_reasons import tenant_reason
from kvhint.schemas import OWNER_VERSION, ActionType, HintOwner, PrefetchPayload, Target

AGENT, PLANNER = HintOwner.AGENT, HintOwner.PLANNER


def _releases(h: HeadlessScheduler) -> dict[tuple[str, str], int]:
    return {(r.action_id, r.reason.value): r.released.blocks
            for r in h.connector.core.executor.take_releases()}


def test_an_agents_retain_displaces_the_planners_top_priority_ones() -> None:
    """The CI case: the planner's Retains (one at top priority, 100) fill the worker's
    retain budget; an agent's Retain at 90, and even one at 5, is applied whole by
    displacing them (reported to the planner as ``displaced``), not clipped to 0."""
    h = sched(retain_budget_fraction=0.1)  # 6 blocks
    turn(h, "p-top", [1, 2, 3, 4])
    turn(h, "p-mid", [5, 6])
    turn(h, "agent", [11, 12, 13, 14])
    assert owned_retain(h, "p-top", 100, PLANNER, "p1").status.value == "accepted"
    assert owned_retain(h, "p-mid", 60, PLANNER, "p2").status.value == "accepted"
    assert h.connector.core.executor.retained_blocks == 6
    outcome = owned_retain(h, "agent", 90, AGENT)
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 4), outcome
    assert [retained_of(h, s) for s in ("agent", "p-top", "p-mid")] == [4, 2, 0]
    assert _releases(h) == {("p2", "displaced"): 2, ("p1", "displaced"): 2}
    # At priority 5 too: the agent's number orders only its own claims.
    turn(h, "agent-low", [21, 22])
    low = owned_retain(h, "agent-low", 5, AGENT)
    assert (low.status.value, low.applied.blocks) == ("accepted", 2), low
    assert [retained_of(h, s) for s in ("agent", "agent-low", "p-top")] == [4, 2, 0]


def test_a_clipped_retain_says_what_holds_the_room_without_figures_for_a_tenant() -> None:
    """Agents' claims of a higher priority hold the whole budget: an agent's lower one is
    clipped, and says so; the planner's, even at 100, says agents' claims (and its own of
    that priority or more) hold it. A tenant's key reads those words, not the figures."""
    h = sched(retain_budget_fraction=0.1)  # 6 blocks
    turn(h, "a-hi", [1, 2, 3, 4, 5, 6])
    turn(h, "a-lo", [11, 12])
    turn(h, "p", [21, 22])
    assert owned_retain(h, "a-hi", 90, AGENT).applied.blocks == 6
    lower = owned_retain(h, "a-lo", 50, AGENT)
    assert (lower.status.value, lower.applied.blocks) == ("clipped", 0), lower
    words = "the room is held by agent runtimes' Retains of priority 50 or more"
    assert words in lower.reason and "max_retained_blocks=6" in lower.reason, lower.reason
    shown = tenant_reason(lower.reason)
    assert words in shown and "max_" not in shown and "0 of 2" not in shown, shown
    planner = owned_retain(h, "p", 100, PLANNER)
    assert (planner.status.value, planner.applied.blocks) == ("clipped", 0), planner
    assert ("the room is held by the planner's (and this plugin's own) Retains of priority "
            "100 or more and by any agent runtime's") in planner.reason, planner.reason
    # Among agents' claims the higher priority still displaces the lower.
    turn(h, "a-top", [31, 32])
    top = owned_retain(h, "a-top", 95, AGENT)
    assert (top.status.value, top.applied.blocks) == ("accepted", 2), top
    assert [retained_of(h, s) for s in ("a-hi", "a-top")] == [4, 2]


def test_pressure_relieves_every_planner_retain_before_an_agents() -> None:
    """vLLM needs memory: the planner's top-priority Retain goes before an agent's at
    priority 1 (before, the agent's went first)."""
    h = sched(retain_budget_fraction=0.3)  # 19 blocks
    turn(h, "p", [1, 2, 3, 4])
    turn(h, "agent", [11, 12, 13, 14])
    owned_retain(h, "p", 100, PLANNER, "p1")
    owned_retain(h, "agent", 1, AGENT, "a1")
    # A prompt needing every free block and 3 more relieves 3 retained blocks.
    turn(h, "big", list(range(600, 600 + h.block_pool.get_num_free_blocks() + 2)))
    assert [retained_of(h, s) for s in ("agent", "p")] == [4, 1]
    assert _releases(h) == {("p1", "pressure"): 3}


def test_an_agents_prefetch_ranks_with_its_retains_above_the_planners() -> None:
    """A Prefetch retains what is in G1 until its deadline: an agent runtime's (owner
    ``agent``, 1.2) ranks with its Retains, above every planner claim, as the docs'
    reasoning for Retains holds for it too (an explicit ask, capped per tenant by the
    router). Before, it ranked at prefetch_retain_priority (80) among the planner's:
    the planner's Retain at 100 kept 2 of its 4 blocks out. The planner's Prefetch still
    ranks among the planner's claims, and a 1.0 Prefetch is the planner's."""
    h = sched(retain_budget_fraction=0.1)  # 6 blocks
    turn(h, "p-top", [1, 2, 3, 4])
    turn(h, "p-mid", [5, 6])
    turn(h, "agent", [11, 12, 13, 14])
    turn(h, "p-pre", [21, 22])
    assert owned_retain(h, "p-top", 100, PLANNER, "p1").status.value == "accepted"
    assert owned_retain(h, "p-mid", 60, PLANNER, "p2").status.value == "accepted"
    prefetch = hint(h, PrefetchPayload(target=Target(session_id="agent"), deadline_s=30,
                                       owner=AGENT), "a-pre")
    assert (prefetch.status.value, prefetch.applied.blocks) == ("accepted", 4), prefetch
    assert "4 of 4 blocks retained" in prefetch.reason, prefetch.reason
    assert [retained_of(h, s) for s in ("agent", "p-top", "p-mid")] == [4, 2, 0]
    assert _releases(h) == {("p2", "displaced"): 2, ("p1", "displaced"): 2}
    # The planner's Prefetch (80) displaces neither the agent's claim nor the 100.
    planner = hint(h, PrefetchPayload(target=Target(session_id="p-pre"), deadline_s=30),
                   "p-pre")
    assert "0 of 2 blocks retained" in planner.reason, planner.reason
    assert [retained_of(h, s) for s in ("agent", "p-top", "p-pre")] == [4, 2, 0]
    # Under pressure (2 blocks short) the planner's Retain at 100 goes, not the agent's.
    turn(h, "big", list(range(600, 600 + h.block_pool.get_num_free_blocks() + 1)))
    assert [retained_of(h, s) for s in ("agent", "p-top")] == [4, 0]
    versions = h.connector.core.supported_actions()[ActionType.PREFETCH.value]
    assert OWNER_VERSION in versions
