"""Outcomes: engine plugin -> router, one terminal outcome per action.

A ``deferred`` may precede the terminal one (accepted, clipped, rejected, missing).
Actions are idempotent by ``action_id``: a duplicate is answered with the first outcome.
Donor advice (see :mod:`kvhint.schemas.advice`) is answered with the same type, its
``action_type`` set to ``kv.donor``.

Rolling upgrades: a ``status`` this version does not know (a newer plugin's) decodes as
a terminal ``rejected`` outcome whose reason opens with ``unknown status '<status>'``
(then the worker's own reason), its figures kept (:func:`decode_outcome`). Terminal,
because a receiver that waits for a status it cannot read waits until the action
expires; ``rejected``, because the router then holds nothing for the action (it may
undercount a worker's budget use, which the worker enforces itself, never overcount
it); and a transient rejection (:func:`is_transient_rejection`), because a status it
cannot read says nothing of what the worker supports. Known statuses decode as before.
A newer plugin may still send ``deferred`` before any terminal status, and only those.

Versions: 1.0 is the message without ``waits_for``; 1.1 adds ``waits_for``, set only on
the ``deferred`` answer of a Prefetch whose wait the worker's prefetch budget clipped to
its first (root-most) ``waits_for.blocks`` target blocks: the most that Prefetch can hold
when it settles, however many blocks it ``requested`` (engine_plugin/prefetch.py). A
router counts a waiting Prefetch at its ``requested`` blocks until it settles; with
``waits_for`` it counts no more than that (router/policy/holdings.py). The field is off
the wire everywhere else, so every other outcome is the 1.0 form byte for byte; a 1.0
router ignores it (unknown fields are ignored) and over-reserves until the Prefetch
settles, as before; a 1.1 router reads a 1.0 plugin's deferred as unclipped. No new
subject or action version: what a receiver does without the field is what it did
before. Each version has its golden JSON (``tests/golden/hint_outcome.json`` 1.0,
``hint_outcome_v1_1.json`` 1.1).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from kvhint.schemas._codec import WireDecodeError, convert, decode_json, encode_json

NonNegative = Annotated[int, Meta(ge=0)]


class OutcomeStatus(str, enum.Enum):
    ACCEPTED = "accepted"
    CLIPPED = "clipped"
    DEFERRED = "deferred"
    REJECTED = "rejected"
    MISSING = "missing"

    @property
    def is_terminal(self) -> bool:
        return self is not OutcomeStatus.DEFERRED


# Stable openings of a ``rejected`` outcome's reason that say nothing of what the worker
# supports: the same action may be accepted later. A router learns no capability from
# them (kvhint.router.policy.feedback).
REJECTED_EXPIRED = "expired:"
REJECTED_INBOX_FULL = "worker inbox full"
# The worker failed on the action itself (a plugin bug, logged and counted there): it
# says nothing of what the worker supports, and a retry may be applied.
REJECTED_INTERNAL_ERROR = "internal error"
# A receiver's reading of a status it does not know (see the module docstring).
REJECTED_UNKNOWN_STATUS = "unknown status"


def is_transient_rejection(reason: str) -> bool:
    return reason.startswith((REJECTED_EXPIRED, REJECTED_INBOX_FULL, REJECTED_INTERNAL_ERROR,
                              REJECTED_UNKNOWN_STATUS))


# Stable openings of a ``rejected`` outcome's reason that say what the worker cannot do at
# all, whatever the action's target or sender: an action type, version or protocol it
# does not know (schemas.hints), no host tier to Demote to, no tier a Share could use,
# vLLM running without prefix caching, or a hybrid model with KV cache groups no hold can
# take, so no Pin or Retain keeps a hit (engine_plugin). They change only with a new engine
# (a new epoch). A router learns them for the worker, for every tenant; any other
# rejection (a target that names too little, a Demote whose host copies did not finish, a
# session's next turn superseding it) is learnt only for the tenant whose action it was
# (kvhint.router.policy.tenant_feedback). A reason none of these opens is a tenant's.
REJECTED_UNSUPPORTED = "unsupported "
REJECTED_NO_HOST_TIER = "demote needs a host tier"
REJECTED_NO_SHARED_TIER = "share needs a tier both workers can read"
REJECTED_NO_PREFIX_CACHE = "prefix caching is off on this worker"
REJECTED_UNHELD_GROUPS = "holds cannot keep this model's prefix hit"


def is_capability_rejection(reason: str) -> bool:
    return reason.startswith((REJECTED_UNSUPPORTED, REJECTED_NO_HOST_TIER,
                              REJECTED_NO_SHARED_TIER, REJECTED_NO_PREFIX_CACHE,
                              REJECTED_UNHELD_GROUPS))


# A ``clipped`` Pin or Retain on a hybrid model whose other KV cache groups let vLLM's
# prefix hit reach only part of its target says how far with this phrase and the hit
# point in target blocks (``... a prefix hit reaches 4, ...``; engine_plugin.group_holds):
# it holds and applies no position past that point. A router reads such a clip as
# residency, not as a budget too small (kvhint.router.policy.feedback): X, the number
# after the phrase, counts target positions held (what ``applied`` counts), the
# denominator of the applied fraction, not a hit length. With EAGLE or MTP vLLM drops
# the last matched block, so a hold reaching X gives a hit of X - 1 blocks (in plain vLLM
# too: a cached chain of N hits N - 1); X is still the positions held.
CLIPPED_HIT_REACH = "a prefix hit reaches "


def clipped_hit_reach(reason: str) -> int | None:
    """The hit point (target blocks) a ``clipped`` outcome's reason says a prefix hit
    reaches (:data:`CLIPPED_HIT_REACH`), or None when it says none."""
    at = reason.find(CLIPPED_HIT_REACH)
    if at < 0:
        return None
    digits = reason[at + len(CLIPPED_HIT_REACH):].split(",", 1)[0].split(" ", 1)[0]
    return int(digits) if digits.isdigit() else None


def is_unknown_status(outcome: HintOutcome) -> bool:
    """Whether ``outcome`` is a receiver's reading of a status it did not know (for
    counting them)."""
    return (outcome.status is OutcomeStatus.REJECTED
            and outcome.reason.startswith(REJECTED_UNKNOWN_STATUS))


class Amount(msgspec.Struct, frozen=True):
    blocks: NonNegative = 0
    tokens: NonNegative = 0


class HintOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker did with one action.

    ``requested`` is what the action's target resolved to on this worker; ``applied`` is
    what the worker actually did (``clipped``: applied < requested, with the reason).
    ``waits_for`` (1.1): what a deferred Prefetch whose wait was clipped waits for.
    ``at`` is the worker's unix time. ``action_type`` is empty when the action could not
    even be identified (a message that was not JSON).
    """

    message_id: str
    action_id: str
    action_type: str = ""
    worker_id: str
    status: OutcomeStatus
    reason: str = ""
    requested: Amount = Amount()
    applied: Amount = Amount()
    at: float
    # 1.1, a clipped Prefetch's ``deferred`` only (module doc): the first blocks it waits
    # for, the most it can hold. UNSET (off the wire): no clipped wait.
    waits_for: Amount | UnsetType = UNSET


def encode_outcome(outcome: HintOutcome) -> bytes:
    return encode_json(outcome)


_KNOWN_STATUSES = frozenset(s.value for s in OutcomeStatus)


def decode_outcome(data: bytes | str) -> HintOutcome:
    """Decode one outcome; an unknown ``status`` becomes a terminal, transient
    ``rejected`` (module docstring). Raises :class:`WireDecodeError` for anything else
    that is malformed."""
    try:
        return decode_json(data, HintOutcome, "hint outcome")
    except WireDecodeError:
        raw = decode_json(data, dict, "hint outcome")
        status = raw.get("status")
        if not isinstance(status, str) or status in _KNOWN_STATUSES:
            raise  # the status was not the problem
    # Read again as what this version makes of it: any other fault is then named.
    raw = {**raw, "status": OutcomeStatus.REJECTED.value}
    reason = f"{REJECTED_UNKNOWN_STATUS} {status!r}"
    given = raw.get("reason", "")
    if isinstance(given, str):  # anything else stays, for convert to name
        raw["reason"] = f"{reason}: {given}" if given else reason
    return convert(raw, HintOutcome, "hint outcome")
