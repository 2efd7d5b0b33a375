"""Hold releases: engine plugin -> router on ``<prefix>.v1.releases.<worker>``.

A Pin or Retain a worker accepted (its terminal outcome already sent) can lose blocks
later without the router asking. The worker reports each such loss so the router's view
of what a session holds, and of what a worker's and a tenant's budgets have left, stays
true:

- ``displaced``: a Retain of higher priority needed the retain budget;
- ``pressure``: the engine needed the memory for a running request;
- ``reset``: vLLM reset its prefix cache and every hold was given back.

Not reported, because the router already knows: TTL expiry, and holds that a newer
action of the router ended (a newer protection of the same session, a Demote).

One message per scheduler step with at least one release. ``held`` is what the action
still holds on this worker after the release (0: nothing; the action is over). Releases
travel on their own subject, so they may reach the router before the outcome of the
action they release; a receiver applies ``held`` as an upper bound on that outcome.
"""

from __future__ import annotations

import enum

import msgspec

from kvhint.schemas._codec import decode_json, encode_json
from kvhint.schemas.outcomes import Amount


class ReleaseReason(str, enum.Enum):
    DISPLACED = "displaced"
    PRESSURE = "pressure"
    RESET = "reset"


class HoldRelease(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks one accepted Pin/Retain action lost. ``session_id``: the session its target
    named (None for a block-hash target)."""

    action_id: str
    action_type: str
    session_id: str | None = None
    reason: ReleaseReason
    released: Amount
    held: Amount


class HoldsReleased(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    releases: list[HoldRelease]
    at: float


def encode_releases(message: HoldsReleased) -> bytes:
    return encode_json(message)


def decode_releases(data: bytes | str) -> HoldsReleased:
    return decode_json(data, HoldsReleased, "hold releases")
