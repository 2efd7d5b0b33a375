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
- the open tool gap of the record behind (the one not saying where the session is now,
  below), when the other began a turn after it opened and holds it no longer: that
  turn closed it, though its replica served it from a record without that gap (its
  read of the row came before the gap's flush, or was busy, timed out, or skipped) and
  so closed its own older one again, at a depth the row already had. Kept closed at
  the depth it followed, measured to the first turn begun after it (each record keeps
  when its latest turns began, :data:`MAX_BEGINS_KEPT`). Before, where neither
  record held it closed, it was lost (its turn's gap missing from the row);
- what says where the session is now (its worker, state, open tool gap, end, last
  activity, and the planner's state) is the record with the later latest event's (its
  last activity, or an end its client asked for: not an abandonment, which a replica
  behind would decide from its older record), whichever replica saw it (this one's on a
  tie); the planner's depth then shifted by the turns the other record did not count.
  Later by what each record saw since the row this one was made from (its base, which
  the stored row descends from: every save is written over the revision it was made
  from), not by the replicas' clocks where that tells: a record whose latest event is
  still its base's saw nothing since, and the other is later (or the same). Only where
  both saw an event since (turns on both replicas since the last save either read) are
  the two clock readings compared, so a replica's clock ahead or behind can order only
  such concurrent events. Before, the readings were compared always: a replica whose
  clock was behind by more than the time between two turns on two replicas made the
  merge keep the earlier turn's state (its open gap, planner state, worker);
  :attr:`SessionRecord.latest_elsewhere` records which one it took;
- its creation is the earlier of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhint.router.service.sessions import SessionRecord

MAX_GAPS_KEPT = 32  # closed tool gaps a session keeps (in memory and stored)
# When its latest turns began, a session keeps as many (in memory and stored, beside
# its gaps): what a merge closes the other record's open gap at (:func:`_closed_by`).
MAX_BEGINS_KEPT = 8


@dataclass(frozen=True, slots=True)
class SessionBase:
    """What a record's counters and closed gaps were in the stored row it was last read
    from or written as (memory only): what this replica added since is the difference."""

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    gaps: tuple[dict[str, Any], ...] = ()
    # The row's latest event (:func:`latest_event`); None: not known (never stored).
    latest: float | None = None

    @classmethod
    def of(cls, row: dict[str, Any]) -> SessionBase:
        """The base a stored row (or the values written as one) gives."""
        stats = row.get("tool_gap_stats") or {}
        return cls(row.get("turns") or 0, row.get("prompt_tokens") or 0,
                   row.get("cached_tokens") or 0, row.get("predicted_cached_tokens") or 0,
                   tuple(stats.get("gaps") or ()), _row_latest(row))


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
    gaps = [*theirs.gaps, *added]
    later = _theirs_later(record, theirs, base.latest)
    # The open gap of the record that does not say where the session is now, closed by
    # a turn the other record began after it opened (module docstring).
    behind, ahead, depth = ((record, theirs, mine_turns) if later
                            else (theirs, record, theirs.turns))
    closed = _closed_by(behind.open_gap, depth, ahead, {gap.get("depth") for gap in gaps})
    if closed is not None:
        gaps.append(closed)
    gaps.sort(key=lambda gap: gap.get("depth") or 0)
    record.gaps = gaps[-MAX_GAPS_KEPT:]
    record.began = sorted({*record.began, *theirs.began})[-MAX_BEGINS_KEPT:]
    record.created_at = min(record.created_at, theirs.created_at)
    if later:
        record.worker_id = theirs.worker_id
        record.state = theirs.state
        record.ended_at = theirs.ended_at
        record.open_gap = theirs.open_gap
        record.last_activity = theirs.last_activity
        record.latest_elsewhere = True
        record.latest_replica = theirs.latest_replica
        plan, shift = theirs.plan, record.turns - theirs.turns
    else:
        plan, shift = record.plan, record.turns - mine_turns
    record.plan = replace(plan, turns=plan.turns + shift) if shift else plan


def _closed_by(gap: dict[str, Any] | None, depth: int, ahead: SessionRecord,
               depths: set[Any]) -> dict[str, Any] | None:
    """The tool gap ``gap`` (opened after the turn at ``depth`` in the record behind)
    closed, where ``ahead`` (the record saying where the session is now) began a turn
    after it opened without closing it: that turn's replica served it from a record
    that did not hold ``gap`` yet (its read of the row came before the other's flush,
    was busy, timed out, or skipped), and closed its own older gap instead, at a depth
    the row already has. None where ``ahead`` holds the same gap still open, began no
    turn since it opened, or a gap at ``depth`` is kept already."""
    if gap is None or depth in depths or depth < 1:
        return None
    opened = gap.get("started_at")
    held = ahead.open_gap
    if opened is None or (held is not None and held.get("started_at") == opened):
        return None
    after = [began for began in ahead.began if began >= opened]
    if not after:
        return None
    return {"tools": gap.get("tools", []), "seconds": round(min(after) - opened, 3),
            "depth": depth}


def _theirs_later(record: SessionRecord, theirs: SessionRecord, base: float | None) -> bool:
    """Whether ``theirs`` (the stored row now, descended from ``record``'s base, whose
    latest event is ``base``) saw the session's latest event (module docstring): the
    one of the two that saw an event since the base, where only one did; else the later
    clock reading (``record`` on a tie)."""
    mine, their = latest_event(record), latest_event(theirs)
    if base is not None:
        mine_moved, theirs_moved = mine != base, their != base
        if mine_moved != theirs_moved:
            return theirs_moved
    return their > mine


def _row_latest(row: dict[str, Any]) -> float | None:
    """:func:`latest_event` of a stored row (or the values written as one)."""
    activity = row.get("last_activity")
    if not isinstance(activity, (int, float)):
        return None
    plan = row.get("plan")
    ended = row.get("ended_at")
    if (isinstance(plan, dict) and plan.get("ended_explicitly")
            and isinstance(ended, (int, float))):
        return max(float(activity), float(ended))
    return float(activity)


def latest_event(record: SessionRecord) -> float:
    """When ``record`` saw its session's latest event: its last activity, or its end
    when its client asked for it (``SessionLifecycle.end`` stamps ``ended_at`` alone)."""
    ended = record.ended_at if record.plan.ended_explicitly else None
    return record.last_activity if ended is None else max(record.last_activity, ended)


def _gap_key(gap: dict[str, Any]) -> str:
    return repr(sorted(gap.items()))
