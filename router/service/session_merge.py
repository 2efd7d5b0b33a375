"""Two replicas' records of one session made one, when a save finds the stored row
changed by another replica since this one last read or wrote it.

Replicas share the store and each keeps its own record of a session in memory; a
session's turns may alternate between them (a load balancer without affinity). A save is
written only over the row's revision its record was made from (store.writer,
``upsert_versioned``); when another replica saved in between, the save is not written
and the record is merged with the row as it is now, then saved again. Nothing either
replica saw is dropped:

- what each replica counts (answered turns, prompt, cached and predicted tokens) adds
  up: the stored row's, plus what this replica added since the row it was made from
  (its *base*: :class:`SessionBase`);
- closed tool gaps: the stored row's, plus those this replica closed since its base,
  except one at a depth the row already has a gap at (a gap follows each turn once: a
  replica behind the other closes the gap the other already closed, measured from an
  older response), kept in depth order, the newest ``MAX_GAPS_KEPT``;
- what says where the session is now (its worker, state, open tool gap, end, last
  activity, and the planner's state) is the record with the later latest event's (its
  last activity, or an end its client asked for: not an abandonment, which a replica
  behind would decide from its older record), whichever replica saw it (this one's on a
  tie); the planner's depth then shifted by the turns the other record did not count;
- its creation is the earlier of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhint.router.service.sessions import SessionRecord

MAX_GAPS_KEPT = 32  # closed tool gaps a session keeps (in memory and stored)


@dataclass(frozen=True, slots=True)
class SessionBase:
    """What a record's counters and closed gaps were in the stored row it was last read
    from or written as (memory only): what this replica added since is the difference."""

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    gaps: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, row: dict[str, Any]) -> SessionBase:
        """The base a stored row (or the values written as one) gives."""
        stats = row.get("tool_gap_stats") or {}
        return cls(row.get("turns") or 0, row.get("prompt_tokens") or 0,
                   row.get("cached_tokens") or 0, row.get("predicted_cached_tokens") or 0,
                   tuple(stats.get("gaps") or ()))


NO_BASE = SessionBase()  # a record never stored: all it holds is its own


def merge_into(record: SessionRecord, theirs: SessionRecord) -> None:
    """``record`` (this replica's, made from ``record.base``) with what ``theirs`` (the
    stored row now, another replica's save) holds beyond that base (module docstring).
    Changes only the stored fields; the memory-only ones (turns in flight, block
    hashes, idle review) stay this replica's. The caller sets the new base."""
    base = record.base or NO_BASE
    mine_turns = record.turns
    record.turns = theirs.turns + max(record.turns - base.turns, 0)
    record.prompt_tokens = theirs.prompt_tokens + max(
        record.prompt_tokens - base.prompt_tokens, 0)
    record.cached_tokens = theirs.cached_tokens + max(
        record.cached_tokens - base.cached_tokens, 0)
    record.predicted_cached_tokens = theirs.predicted_cached_tokens + max(
        record.predicted_cached_tokens - base.predicted_cached_tokens, 0)
    known = set(map(_gap_key, base.gaps))
    depths = {gap.get("depth") for gap in theirs.gaps}
    added = [gap for gap in record.gaps
             if _gap_key(gap) not in known and gap.get("depth") not in depths]
    gaps = sorted([*theirs.gaps, *added], key=lambda gap: gap.get("depth") or 0)
    record.gaps = gaps[-MAX_GAPS_KEPT:]
    record.created_at = min(record.created_at, theirs.created_at)
    if _latest_event(theirs) > _latest_event(record):
        record.worker_id = theirs.worker_id
        record.state = theirs.state
        record.ended_at = theirs.ended_at
        record.open_gap = theirs.open_gap
        record.last_activity = theirs.last_activity
        plan, shift = theirs.plan, record.turns - theirs.turns
    else:
        plan, shift = record.plan, record.turns - mine_turns
    record.plan = replace(plan, turns=plan.turns + shift) if shift else plan


def _latest_event(record: SessionRecord) -> float:
    """When ``record`` saw its session's latest event: its last activity, or its end
    when its client asked for it (``SessionLifecycle.end`` stamps ``ended_at`` alone)."""
    ended = record.ended_at if record.plan.ended_explicitly else None
    return record.last_activity if ended is None else max(record.last_activity, ended)


def _gap_key(gap: dict[str, Any]) -> str:
    return repr(sorted(gap.items()))
