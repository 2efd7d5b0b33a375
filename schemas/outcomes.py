"""Outcomes: engine plugin -> router, one terminal outcome per action.

A ``deferred`` may precede the terminal one (accepted, clipped, rejected, missing).
Actions are idempotent by ``action_id``: a duplicate is answered with the first outcome.
Donor advice (see :mod:`kvhint.schemas.advice`) is answered with the same type, its
``action_type`` set to ``kv.donor``.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from kvhint.schemas._codec import decode_json, encode_json

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


def is_transient_rejection(reason: str) -> bool:
    return reason.startswith((REJECTED_EXPIRED, REJECTED_INBOX_FULL))


class Amount(msgspec.Struct, frozen=True):
    blocks: NonNegative = 0
    tokens: NonNegative = 0


class HintOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker did with one action.

    ``requested`` is what the action's target resolved to on this worker; ``applied`` is
    what the worker actually did (``clipped``: applied < requested, with the reason).
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


def encode_outcome(outcome: HintOutcome) -> bytes:
    return encode_json(outcome)


def decode_outcome(data: bytes | str) -> HintOutcome:
    return decode_json(data, HintOutcome, "hint outcome")
