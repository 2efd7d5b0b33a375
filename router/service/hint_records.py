"""The record of one hint action the router sent, as memory and the store keep it.

A :class:`SentAction` is created when an action is sent, before its envelope is published
(:mod:`.hint_send`; ``failed`` when NATS refuses it), updated by
its worker's outcome and by the worker's later reports of letting its blocks go unasked,
and saved as one ``hint_actions`` row (:meth:`SentAction.row`, :meth:`SentAction.from_row`
after a restart).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import UNSET

from kvhint.router.policy.holdings import waits_for_blocks
from kvhint.schemas import (
    ActionType,
    Amount,
    HintOutcome,
    OutcomeStatus,
    PrefetchPayload,
    ReleaseReason,
)
from kvhint.schemas.hints import MAX_TTL_S

PENDING = "pending"
EXPIRED = "expired"
FAILED = "failed"
# Every status a stored action can have: the router's own three and the workers' answers.
HintStatus = Literal["pending", "expired", "failed", "accepted", "clipped", "deferred",
                     "rejected", "missing"]
# The most a stored amount may be: the store's requested_/applied_ columns are 32-bit
# integers (migrations 0001), and so is waits_for_blocks (0008). A worker's answer past
# it (an older plugin echoed a target's unbounded prefix_tokens) is kept at this bound,
# counted, rather than losing the whole row to the store (store_row_rejected).
MAX_STORED_AMOUNT = 2**31 - 1
# An action with no terminal outcome this long past the time its worker must give one
# (at once; a Prefetch at its deadline_s: worker_wait_s) is marked expired.
OUTCOME_DEADLINE_S = 120.0
# Who an action is for (``SentAction.source``, the metrics' ``source`` label). Only the
# planner's own actions teach the planner (their outcomes feed its feedback: the worker's
# capabilities, and the tenant's own, policy.tenant_feedback);
# "api" marks an agent runtime's: what it sent through the sessions API, and the release
# of those claims when its session ends.
PLANNER_SOURCE = "planner"
API_SOURCE = "api"
# The action types a worker reports a hint action's lost blocks under (HoldRelease): a
# Pin's, a Retain's and a Prefetch's (it retains what it brought in until its deadline;
# this plugin reports those as kv.retain). Only a release of one of these is a hint
# action's: the plugin keys a donor advice's retain apart and reports its release as
# kv.donor under the advice's id, which may equal a hint action's.
HINT_RELEASE_TYPES = frozenset({ActionType.PIN.value, ActionType.RETAIN.value,
                                ActionType.PREFETCH.value})
# What a Prefetch that leaves out ``deadline_s`` waits for on the worker (the wire default).
_PREFETCH_DEFAULT_DEADLINE_S = next(field.default for field in
                                    msgspec.structs.fields(PrefetchPayload)
                                    if field.name == "deadline_s")


def worker_wait_s(action_type: str, payload: Mapping[str, Any]) -> float:
    """How long after it gets an action its worker may legitimately take to give the final
    answer: a Prefetch's ``deadline_s`` (the wire default where the payload leaves it
    out), answered ``deferred`` meanwhile and finally once its blocks are in G1 or at the
    deadline; 0 for every other action, answered at once (a Demote waits for host copies
    within the plugin's ``demote_copy_wait_s``, at most 60 s). A deadline outside the
    wire's bounds is 0: the worker rejects that action at once."""
    if action_type != ActionType.PREFETCH.value:
        return 0.0
    deadline = payload.get("deadline_s", _PREFETCH_DEFAULT_DEADLINE_S)
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        return 0.0
    return float(deadline) if 0 < deadline <= MAX_TTL_S else 0.0


@dataclass(slots=True)
class SentAction:
    action_id: str
    message_id: str
    worker_id: str
    tenant: str | None
    session_id: str | None  # the client's id (without tenant)
    action_type: str
    source: str  # PLANNER_SOURCE | API_SOURCE
    trigger: str
    payload: dict[str, Any]
    status: str
    created_at: float
    updated_at: float
    reason: str = ""
    requested_blocks: int = 0
    requested_tokens: int = 0
    applied_blocks: int = 0
    applied_tokens: int = 0
    # What a Pin/Retain protects and when its TTL ends (None: older rows, other types).
    scope: str | None = None
    expires_at: float | None = None
    # The worker's latest report of letting blocks of it go unasked (HoldRelease): why,
    # when, and what it still holds.
    release_reason: str | None = None
    released_at: float | None = None
    held_after_release_blocks: int | None = None
    # A deferred Prefetch whose wait its worker's prefetch budget clipped: the most it can
    # hold when it settles (outcome 1.1 ``waits_for``; None: not clipped, not said).
    waits_for_blocks: int | None = None
    # The worker's clock (``at``) of its latest answer: which engine gave it
    # (HintDispatcher.reset_worker).
    answered_at: float | None = None
    # When the engine whose new epoch let this action go unanswered started, by the
    # worker's clock (None: no such reset, or an epoch without order): an answer at or
    # after it is that engine's, which holds the action after all.
    reset_by_engine_at: float | None = None
    waiter: asyncio.Future[SentAction] | None = None
    # When this router began waiting for the outcome (not stored): the send, or for an
    # action restored from the store, the restart.
    waiting_since: float | None = None
    # When this router stops waiting for the outcome, where something cut the wait short
    # (not stored; None: :meth:`outcome_due`'s rule): its worker's engine restarted.
    due_at: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status not in (PENDING, OutcomeStatus.DEFERRED.value)

    def answered_by_reset_engine(self, at: float) -> bool:
        """Whether an answer given at ``at`` (the worker's clock) is the engine's whose
        new epoch let this action go while it waited (``reset_by_engine_at``): an
        older engine answered before the newer one started."""
        started = self.reset_by_engine_at
        return started is not None and at >= started

    def outcome_due(self) -> float:
        """When this router stops waiting for the action's final answer (it then ends
        ``expired``): ``OUTCOME_DEADLINE_S`` past the later of when it began waiting (the
        send; for an action restored from the store, the restart) and when its worker
        must answer it (:func:`worker_wait_s` after the send: a Prefetch's deadline).
        Before, a Prefetch whose ``deadline_s`` is over ``OUTCOME_DEADLINE_S``, still
        waiting on its worker, expired here first, and its real outcome came as
        another router's."""
        if self.due_at is not None:
            return self.due_at
        start = self.waiting_since or self.created_at
        answer_by = self.created_at + worker_wait_s(self.action_type, self.payload)
        return max(start, answer_by) + OUTCOME_DEADLINE_S

    def restored_waiting(self, now: float) -> None:
        """Restored at ``now`` by a router restart, still waiting for its outcome, which
        may be on its way in the outcome stream the router replays from its cursor: it
        gets ``OUTCOME_DEADLINE_S`` from now, or past the time its worker must answer if
        later (:meth:`outcome_due`). Before, an action sent more than that before the
        restart expired at the first tick, and its outcome arriving a moment later was
        "unknown". One whose worker's engine restarted after the send (its row says a
        ``reset`` released it: HintDispatcher.reset_worker) keeps the cut that made of
        its wait: ``OUTCOME_DEADLINE_S`` from then or from now, whichever is later
        (before, the restart restored a Prefetch's wait until its own deadline, though
        the new engine never answers it)."""
        self.waiting_since = now
        if self.release_reason == ReleaseReason.RESET.value and self.released_at is not None:
            self.cut_wait(max(now, self.released_at))

    def cut_wait(self, since: float) -> None:
        """Its worker's engine restarted at ``since`` (a new engine answers no action of
        the old): wait no longer than ``OUTCOME_DEADLINE_S`` from then."""
        cut = since + OUTCOME_DEADLINE_S
        if self.outcome_due() > cut:
            self.due_at = cut

    def still_held(self) -> int:
        """The blocks it holds as far as the router was told: what it applied (asked for,
        while it waits for its answer: no more than a clipped Prefetch waits for), less
        what its worker since said it let go."""
        asked = self.requested_blocks if not self.terminal else self.applied_blocks
        if not self.terminal and self.waits_for_blocks is not None:
            asked = min(asked, self.waits_for_blocks)
        released = self.held_after_release_blocks
        return asked if released is None else min(asked, released)

    def overdue_reason(self) -> str:
        """The ``expired`` reason of an action past :meth:`outcome_due`."""
        within = f"no terminal outcome within {OUTCOME_DEADLINE_S:.0f}s"
        if self.due_at is not None:
            return (f"{within} of its worker's engine restart (a new engine answers no "
                    "action of the old)")
        wait = worker_wait_s(self.action_type, self.payload)
        if wait > 0 and self.created_at + wait >= (self.waiting_since or self.created_at):
            return f"{within} past its deadline_s={wait:g}"
        return within

    def row(self) -> dict[str, Any]:
        return {
            "action_id": self.action_id, "message_id": self.message_id,
            "tenant": self.tenant, "session_id": self.session_id,
            "worker_id": self.worker_id, "action_type": self.action_type,
            "source": self.source, "trigger": self.trigger, "payload": self.payload,
            "status": self.status, "reason": self.reason,
            "requested_blocks": self.requested_blocks,
            "requested_tokens": self.requested_tokens,
            "applied_blocks": self.applied_blocks, "applied_tokens": self.applied_tokens,
            "created_at": self.created_at, "updated_at": self.updated_at,
            "scope": self.scope, "expires_at": self.expires_at,
            "release_reason": self.release_reason, "released_at": self.released_at,
            "held_after_release_blocks": self.held_after_release_blocks,
            "waits_for_blocks": self.waits_for_blocks, "answered_at": self.answered_at,
            "reset_by_engine_at": self.reset_by_engine_at,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SentAction:
        fields = {k: row[k] for k in (
            "action_id", "message_id", "worker_id", "tenant", "session_id", "action_type",
            "source", "trigger", "payload", "status", "created_at", "updated_at", "reason",
            "requested_blocks", "requested_tokens", "applied_blocks", "applied_tokens")}
        return cls(**fields, **{k: row.get(k) for k in (
            "scope", "expires_at", "release_reason", "released_at",
            "held_after_release_blocks", "waits_for_blocks", "answered_at",
            "reset_by_engine_at")})


def outcome_columns(outcome: HintOutcome) -> dict[str, Any]:
    """What a worker's answer sets of its action's record (and store row): its amounts,
    what a clipped deferred Prefetch waits for, and when (the worker's clock) it came."""
    return {"status": outcome.status.value, "reason": outcome.reason,
            "requested_blocks": outcome.requested.blocks,
            "requested_tokens": outcome.requested.tokens,
            "applied_blocks": outcome.applied.blocks, "applied_tokens": outcome.applied.tokens,
            "waits_for_blocks": waits_for_blocks(outcome), "answered_at": outcome.at}


def clamped_amounts(outcome: HintOutcome) -> HintOutcome | None:
    """``outcome`` with its amounts (``waits_for`` too) held to :data:`MAX_STORED_AMOUNT`,
    or None when they are within it already."""
    waits = () if outcome.waits_for is UNSET else (outcome.waits_for,)
    amounts = (outcome.requested, outcome.applied, *waits)
    if all(max(a.blocks, a.tokens) <= MAX_STORED_AMOUNT for a in amounts):
        return None
    requested, applied, *waits = (Amount(min(a.blocks, MAX_STORED_AMOUNT),
                                         min(a.tokens, MAX_STORED_AMOUNT)) for a in amounts)
    return msgspec.structs.replace(outcome, requested=requested, applied=applied,
                                   waits_for=waits[0] if waits else UNSET)
