"""Sessions the router tracks, keyed by ``(tenant, client session id)``.

A :class:`SessionRecord` is the service's view (counters, the open tool gap, what to
show an operator) plus the planner's own :class:`SessionPlanState`, which only the
planner functions change. Every change is written through the store writer (batched,
off the request path); :meth:`SessionRegistry.restore` rebuilds the registry from the
store after a restart. A save is written only over the row's revision the record was
made from: one another replica saved since is read again and merged
(session_merge.py), never written over.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, Literal

import msgspec

from kvhint.router.policy.session import SessionPlanState
from kvhint.router.service.session_merge import (
    MAX_BEGINS_KEPT,
    MAX_GAPS_KEPT,
    SessionBase,
    latest_event,
    merge_into,
)
from kvhint.router.store.writer import NOT_STORED, StoreWriter

ACTIVE = "active"
TOOL_GAP = "tool_gap"
ENDED = "ended"
# Every state a session is in (the admin API refuses any other with a 422).
SessionState = Literal["active", "tool_gap", "ended"]
# How far past the least recently opened session eviction looks for an ended one.
_EVICTION_LOOKAHEAD = 64
_STATE_OF = attrgetter("state")
# Two stored copies of one clock reading (a float column, a JSON number) differ by no
# more than this; an abandonment comes PlannerConfig.abandon_after_s (an hour) later.
_SAME_READING_S = 1e-3


@dataclass(slots=True)
class SessionRecord:
    tenant: str
    session_id: str
    created_at: float
    last_activity: float
    plan: SessionPlanState
    worker_id: str | None = None
    # Turns a worker answered (2xx, no error in its stream): not those refused or failed.
    turns: int = 0
    state: str = ACTIVE
    ended_at: float | None = None
    # {"tools": [...], "started_at": t, "worker_id": w} while a tool gap is open.
    open_gap: dict[str, Any] | None = None
    # Closed gaps, newest last: [{"tools": [...], "seconds": s, "depth": d}].
    gaps: list[dict[str, Any]] = field(default_factory=list)
    # When its latest turns began (at most MAX_BEGINS_KEPT, oldest first; stored beside
    # the gaps): where a merge closes the other replica's open gap (session_merge.py).
    began: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    inflight: int = 0
    # Block hashes of the last routed prompt (memory only): what the admin API checks
    # against the index for "resident blocks per tier".
    last_block_hashes: tuple[int, ...] = ()
    # The hashes of the last prompt a worker answered (2xx): what last_block_hashes goes
    # back to when a turn is refused (memory only; usually the same tuple).
    answered_block_hashes: tuple[int, ...] = ()
    # When plan_idle last reviewed the session (memory only): the next review is due at
    # next_idle_review(config, plan, max(this, the gap's opening)).
    idle_reviewed_at: float | None = None
    # The stored row's revision this record was last read from or written as
    # (NOT_STORED: none yet), and its counters and gaps then (memory only): a save is
    # written only over that revision, else merged (session_merge.py).
    revision: int = NOT_STORED
    base: SessionBase | None = None
    # Whether the record's latest event (where the session is now) is one another
    # replica saw, merged in from its save (memory only; this replica's next turn or
    # end of it makes it this one's again): the session's idle review is that
    # replica's (``SessionLifecycle.tick``), not this one's; read so from a row naming
    # another replica as ``latest_replica`` (``routing.replica_id``; None: not known).
    latest_elsewhere: bool = False
    latest_replica: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session_id)

    @property
    def worker_session_id(self) -> str:
        return f"{self.tenant}/{self.session_id}"

    def row(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "session_id": self.session_id,
            "worker_id": self.worker_id,
            "turns": self.turns,
            "created_at": self.created_at,
            "last_activity": self.last_activity,
            "ended_at": self.ended_at,
            "state": self.state,
            "open_gap": self.open_gap,
            "tool_gap_stats": {"gaps": self.gaps[-MAX_GAPS_KEPT:],
                               "began": self.began[-MAX_BEGINS_KEPT:]},
            "plan": self.plan.to_dict(),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "latest_replica": self.latest_replica,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SessionRecord:
        """The record of a stored ``row`` as :func:`readable_row` gives it (the registry
        reads every row so, and counts what it leaves out)."""
        plan_data = row.get("plan")
        worker_sid = f"{row['tenant']}/{row['session_id']}"
        try:
            plan = (SessionPlanState.from_dict(plan_data) if plan_data
                    else SessionPlanState(worker_sid, row["tenant"]))
        except (TypeError, ValueError):
            plan = SessionPlanState(worker_sid, row["tenant"])
        if _ended_explicitly_before_the_flag(row, plan_data, plan):
            plan = replace(plan, ended_explicitly=True)
        stats = row.get("tool_gap_stats") or {}
        record = cls(
            tenant=row["tenant"],
            session_id=row["session_id"],
            created_at=row["created_at"],
            last_activity=row["last_activity"],
            plan=plan,
            worker_id=row.get("worker_id"),
            turns=row.get("turns") or 0,
            state=row.get("state") or ACTIVE,
            ended_at=row.get("ended_at"),
            open_gap=row.get("open_gap"),
            gaps=list(stats.get("gaps", [])),
            began=_began(stats.get("began")),
            prompt_tokens=row.get("prompt_tokens") or 0,
            cached_tokens=row.get("cached_tokens") or 0,
            predicted_cached_tokens=row.get("predicted_cached_tokens") or 0,
            revision=row.get("revision") or 0,
            base=SessionBase.of(row),
            latest_replica=row.get("latest_replica"),
        )
        # Its latest event as this router reads it (an end by a router from before the
        # flag included), which a merge compares the record's with (session_merge.py).
        record.base = replace(record.base, latest=latest_event(record))
        return record


def readable_row(row: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``row`` with each JSON column this router cannot read as its own form set to None
    (as a row that never had it), and the names of those columns. A row is whatever the
    store gives back: hand-edited, restored from elsewhere, or on SQLite (a TEXT column)
    not JSON at all (``database._stored_json`` gives such text back as a string). Before,
    one such row failed the router's start (its recovery read every recent row) or made
    each turn of its session a 500. Read so, the session keeps its counters and starts
    its planner state, open gap or gap history afresh; the caller counts it
    (``session_row_unreadable``). A plan must also name this row's own session and tenant:
    one naming another's would have the planner hint that session."""
    bad: list[str] = []
    fixed = dict(row)
    plan = row.get("plan")
    if plan is not None and not _readable_plan(plan, row):
        bad.append("plan")
    open_gap = row.get("open_gap")
    if open_gap is not None and not _readable_open_gap(open_gap):
        bad.append("open_gap")
    stats = row.get("tool_gap_stats")
    if stats is not None and not _readable_gap_stats(stats):
        bad.append("tool_gap_stats")
    for column in bad:
        fixed[column] = None
    return fixed, tuple(bad)


def _readable_plan(plan: Any, row: dict[str, Any]) -> bool:
    """Whether ``plan`` reads as :meth:`SessionPlanState.from_dict` reads it, each field
    of its type (msgspec: keys it does not know are left out, as from_dict leaves them),
    naming this row's session. A protection alone unreadable is no problem: from_dict
    leaves it out (the planner asks again)."""
    if not isinstance(plan, dict):
        return False
    if not plan:
        return True  # read as no plan (from_row), as before
    try:
        state = msgspec.convert(plan, SessionPlanState)
    except msgspec.ValidationError:
        try:
            state = msgspec.convert({k: v for k, v in plan.items() if k != "protection"},
                                    SessionPlanState)
        except msgspec.ValidationError:
            return False
    return (state.tenant == row.get("tenant")
            and state.session_id == f"{row.get('tenant')}/{row.get('session_id')}")


def _readable_gap_stats(stats: Any) -> bool:
    """The form ``SessionRecord.row`` writes: ``{"gaps": [{..., "depth": n}...], ...}``,
    each closed gap an object whose ``depth`` (where it has one) is a number: a merge
    with another replica's save (session_merge.py) keys gaps by depth and sorts them by
    it, which raised TypeError on another (a 500, or the store writer's flush broken)."""
    if not isinstance(stats, dict):
        return False
    gaps = stats.get("gaps", [])
    return isinstance(gaps, list) and all(
        isinstance(gap, dict) and (gap.get("depth") is None or (
            isinstance(gap["depth"], (int, float)) and not isinstance(gap["depth"], bool)))
        for gap in gaps)


def _readable_open_gap(gap: Any) -> bool:
    """The form ``SessionLifecycle`` writes: ``{"tools": [str...], "started_at": t,
    "worker_id": w}`` (``begin_turn`` reads the first two)."""
    if not isinstance(gap, dict):
        return False
    tools, started = gap.get("tools", []), gap.get("started_at", 0.0)
    return (isinstance(tools, list) and all(isinstance(t, str) for t in tools)
            and isinstance(started, (int, float)) and not isinstance(started, bool))


def _began(stored: Any) -> list[float]:
    """A row's turn beginnings (none in a row of a router from before them)."""
    if not isinstance(stored, list):
        return []
    return sorted(float(t) for t in stored if isinstance(t, (int, float)))[-MAX_BEGINS_KEPT:]


def _ended_explicitly_before_the_flag(row: dict[str, Any], plan_data: Any,
                                      plan: SessionPlanState) -> bool:
    """Whether a stored session written without ``ended_explicitly`` (by a router from
    before the flag: a rolling upgrade's older one still writes such rows, so this is
    read, not migrated) was ended by its client. Such a session takes no agent hints
    until its next turn; read as abandoned, it would take them again after a restart.
    Every router stamps an explicit end with one clock reading, the row's ``ended_at``
    and the plan's ``last_activity`` (``SessionLifecycle.end``, ``plan_session_end``);
    the planner abandons a session ``abandon_after_s`` after its last activity, which
    the plan keeps, at a tick that stamps ``ended_at`` alone. A session abandoned then
    ended again by a DELETE on such a router left no trace of the second end, and stays
    abandoned; one this router reads as abandoned and its client then ends is stored
    with the flag set (``SessionLifecycle.end``), so it is read as ended by its client,
    and with that end's one clock reading in ``ended_at`` and the plan's
    ``last_activity``, so a row of it an older router saves again without the flag is
    read so too. Rows this router writes always carry the flag: none is inferred."""
    if (not isinstance(plan_data, dict) or "ended_explicitly" in plan_data
            or row.get("state") != ENDED or not plan.ended):
        return False
    ended_at = row.get("ended_at")
    return ended_at is not None and abs(float(ended_at) - plan.last_activity) < _SAME_READING_S


class SessionRegistry:
    """Sessions in memory, bounded twice: ``max_sessions`` in all, and per tenant by
    ``tenant_cap(tenant)`` (None: the global bound only). A tenant at its own cap makes
    room among its own sessions only, so one tenant's churn of new session ids never
    evicts another's; the global bound, reachable only when the tenants' caps add up to
    more than it, takes from the tenant holding the most sessions. What is evicted stays
    in the store (:meth:`adopt` brings it back); each eviction is counted, as a drop and
    per tenant (``on_evict``)."""

    def __init__(self, writer: StoreWriter | None, max_sessions: int,
                 on_drop: Callable[[str, int], None] | None = None,
                 tenant_cap: Callable[[str], int | None] | None = None,
                 on_evict: Callable[[str], None] | None = None,
                 on_conflict: Callable[[str], None] | None = None,
                 replica_id: str | None = None) -> None:
        # In opening order (least recently opened first): eviction takes from the front.
        self._sessions: OrderedDict[tuple[str, str], SessionRecord] = OrderedDict()
        # The same records per tenant, in the same order: a tenant's eviction scans only
        # its own sessions.
        self._by_tenant: dict[str, OrderedDict[tuple[str, str], SessionRecord]] = {}
        self._writer = writer
        self._max = max_sessions
        self._on_drop = on_drop
        self._tenant_cap = tenant_cap
        self._on_evict = on_evict
        self._on_conflict = on_conflict
        self._replica_id = replica_id  # routing.replica_id: a save's latest_replica

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(list(self._sessions.values()))

    def of_tenant(self, tenant: str | None) -> list[SessionRecord]:
        """``tenant``'s records (every tenant's for None), in opening order, a copy. A
        tenant's reads (a tenant admin's views) walk its own sessions only: before, they
        walked every tenant's, so their cost grew with the other tenants' sessions."""
        if tenant is None:
            return list(self._sessions.values())
        return list(self._by_tenant.get(tenant, {}).values())

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        return self._sessions.get((tenant, session_id))

    def by_worker_session_id(self, worker_session_id: str) -> SessionRecord | None:
        tenant, sep, session_id = worker_session_id.partition("/")
        return self._sessions.get((tenant, session_id)) if sep else None

    def open(self, tenant: str, session_id: str, now: float) -> SessionRecord:
        """The session's record, created on its first turn (a returning ended session
        becomes active again). Opening makes it the most recently active one."""
        key = (tenant, session_id)
        record = self._sessions.get(key)
        if record is None:
            record = self._add(SessionRecord(tenant, session_id, now, now,
                                             SessionPlanState(f"{tenant}/{session_id}", tenant)))
        else:
            self._sessions.move_to_end(key)
            self._by_tenant[tenant].move_to_end(key)
        return record

    def save(self, record: SessionRecord) -> None:
        """Queue ``record``'s row, written over the revision it was made from only
        (:class:`_VersionedSession`)."""
        if not record.latest_elsewhere:
            record.latest_replica = self._replica_id
        if self._writer is not None:
            self._writer.upsert_versioned("sessions", record.key, record.row(),
                                          _VersionedSession(self, record))

    def _conflicted(self, record: SessionRecord, stored: dict[str, Any] | None) -> None:
        """``record``'s save found the row saved by another replica since (or deleted:
        ``stored`` None): merged with it, then saved again (session_merge.py); counted
        (``on_conflict``, by outcome)."""
        if stored is None:  # retention deleted it meanwhile: this record is all there is
            record.revision, record.base = NOT_STORED, None
            outcome = "row_gone"
        else:
            _merge_stored(record, self._readable(stored))
            outcome = "merged"
        if self._on_conflict is not None:
            self._on_conflict(outcome)
        self.save(record)

    def refresh(self, record: SessionRecord, row: dict[str, Any]) -> bool:
        """``record`` with another replica's save of its session merged in, when
        ``row`` (the stored row, read before a turn) is newer than the revision the
        record was made from; saved then. False when it is not (nothing to merge), or
        when this router's own flush of the row is in progress (the row may be that
        write: its save tells). Read before each turn (``SessionLifecycle.recall``), so
        a turn continues what another replica's turns did since (its turns, open tool
        gap, planner state), not this replica's older record."""
        if self._writer is not None and self._writer.writing("sessions", record.key):
            return False
        if (row.get("revision") or 0) <= record.revision:
            return False
        _merge_stored(record, self._readable(row))
        self.save(record)  # a save queued before the merge must not be written as it was
        return True

    def forget(self, record: SessionRecord) -> None:
        """Out of memory; the store keeps it (:meth:`adopt` brings it back)."""
        self._pop(record.key)

    def count(self, tenant: str) -> int:
        """Sessions of ``tenant`` in memory."""
        return len(self._by_tenant.get(tenant, ()))

    def restore(self, rows: list[dict[str, Any]]) -> int:
        """The stored sessions ``rows`` in memory (at start-up). Any left out, or not in
        the store's recent rows, are read from the store on first sight
        (``SessionLifecycle.recall``), as every session this registry does not hold is;
        one another replica saw last is that replica's to review (:meth:`_record_of`)."""
        records = [self._record_of(row) for row in rows]
        for record in sorted(records, key=lambda r: r.last_activity):
            self._put(record)
        # A tenant's cap may be lower than at the last run: trim to it (least recent first).
        for tenant in list(self._by_tenant):
            self._make_room(tenant, 0)
        return len(rows)

    def _readable(self, row: dict[str, Any]) -> dict[str, Any]:
        """A stored ``row`` as :func:`readable_row` reads it; one with a column it could
        not read is counted (``session_row_unreadable``: what that column held is lost)."""
        fixed, unreadable = readable_row(row)
        if unreadable and self._on_drop is not None:
            self._on_drop("session_row_unreadable", 1)
        return fixed

    def adopt(self, row: dict[str, Any]) -> SessionRecord:
        """The stored session ``row`` in memory again (a session evicted earlier that
        came back); a record already in memory is kept as it is."""
        record = self._record_of(row)
        current = self._sessions.get(record.key)
        return current if current is not None else self._add(record)

    def _record_of(self, row: dict[str, Any]) -> SessionRecord:
        """The record of a stored ``row``, its latest event another replica's where the
        row names one not this (``routing.replica_id``). Before, a restarted replica
        reviewed a session another served last as its own, beside that one."""
        record = SessionRecord.from_row(self._readable(row))
        named = record.latest_replica
        record.latest_elsewhere = (named is not None and self._replica_id is not None
                                   and named != self._replica_id)
        return record

    def _add(self, record: SessionRecord) -> SessionRecord:
        """Put ``record`` in memory as the most recently opened, making room first."""
        self._make_room(record.tenant, 1)
        self._put(record)
        return record

    def _put(self, record: SessionRecord) -> None:
        self._sessions[record.key] = record
        self._by_tenant.setdefault(record.tenant, OrderedDict())[record.key] = record

    def _pop(self, key: tuple[str, str]) -> SessionRecord | None:
        record = self._sessions.pop(key, None)
        if record is not None:
            own = self._by_tenant[key[0]]
            del own[key]
            if not own:
                del self._by_tenant[key[0]]
        return record

    def _make_room(self, tenant: str, adding: int) -> None:
        """Evict until ``adding`` more sessions of ``tenant`` fit its cap and the global
        bound (or nothing more can go: every candidate has a turn in flight)."""
        cap = self._tenant_cap(tenant) if self._tenant_cap is not None else None
        if cap is not None:
            while self.count(tenant) + adding > cap and self._evict_oldest(tenant):
                pass
        while len(self._sessions) + adding > self._max:
            # Over the global bound only: the largest tenant gives one up (it may be
            # this one); a tenant whose sessions all have turns in flight is passed over.
            by_size = sorted(self._by_tenant, key=self.count, reverse=True)
            if not any(self._evict_oldest(name) for name in by_size):
                return

    def counts_by_state(self, tenant: str | None = None) -> dict[str, int]:
        """Sessions in memory per state; only ``tenant``'s when given."""
        records: Iterable[SessionRecord] = (
            self._sessions.values() if tenant is None
            else self._by_tenant.get(tenant, {}).values())
        # Counted in C: every /metrics scrape and dashboard poll walks every session.
        return {ACTIVE: 0, TOOL_GAP: 0, ENDED: 0, **Counter(map(_STATE_OF, records))}

    def _evict_oldest(self, tenant: str) -> bool:
        """Forget an ended session of ``tenant`` among its ``_EVICTION_LOOKAHEAD`` least
        recently opened, else its least recently opened one with no turn in flight (a turn
        in flight would finish into a record nobody reviews); False when it has none to
        give up (every session with a turn in flight: go over the bound for now). The
        store keeps it; only memory is bounded, at a bounded cost per new session (each
        tenant's sessions are kept in opening order, not scanned whole)."""
        victim = None
        for seen, record in enumerate(self._by_tenant.get(tenant, {}).values()):
            if record.state == ENDED:
                victim = record
                break
            if victim is None and not record.inflight:
                victim = record
            if seen >= _EVICTION_LOOKAHEAD and victim is not None:
                break
        if victim is None:
            return False
        self._pop(victim.key)
        if self._on_drop is not None:
            self._on_drop("session_evicted_from_memory", 1)
        if self._on_evict is not None:
            self._on_evict(tenant)
        return True


def _merge_stored(record: SessionRecord, stored: dict[str, Any]) -> None:
    """``stored`` (another replica's save) merged into ``record``, which is now made
    from it (session_merge.py)."""
    theirs = SessionRecord.from_row(stored)
    merge_into(record, theirs)
    record.revision, record.base = theirs.revision, theirs.base


class _VersionedSession:
    """A session's save, as the writer's versioned row owner (store.writer.VersionedSave)."""

    __slots__ = ("_registry", "_record")

    def __init__(self, registry: SessionRegistry, record: SessionRecord) -> None:
        self._registry = registry
        self._record = record

    def expected_revision(self) -> int:
        return self._record.revision

    def written(self, revision: int, values: dict[str, Any]) -> None:
        self._record.revision, self._record.base = revision, SessionBase.of(values)

    def conflicted(self, stored: dict[str, Any] | None) -> None:
        self._registry._conflicted(self._record, stored)
