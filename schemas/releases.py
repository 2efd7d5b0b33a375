"""Hold releases: engine plugin -> router on ``<prefix>.v1.releases.<worker>``.

A Pin or Retain a worker accepted (its terminal outcome already sent) can lose blocks
later without the router asking. The worker reports each such loss so the router's view
of what a session holds, and of what a worker's and a tenant's budgets have left, stays
true:

- ``displaced``: a Retain of higher priority needed the retain budget;
- ``pressure``: the engine needed the memory for a running request;
- ``reset``: vLLM reset its prefix cache and every hold was given back;
- ``gone`` (1.1): vLLM dropped held blocks from its prefix cache by another path
  (``evict_blocks`` after a failed KV load): the hold protected nothing any more and was
  given back. Before 1.1 a plugin sent these as ``reset``.

Not reported, because the router already knows: TTL expiry, and holds that a newer
action of the router ended (a newer protection of the same session, a Demote).

One message per scheduler step with at least one release. ``held`` is what the action
still holds on this worker after the release (0: nothing; the action is over). Releases
travel on their own subject, so they may reach the router before the outcome of the
action they release; a receiver applies ``held`` as an upper bound on that outcome.

Rolling upgrades: a receiver decodes each release on its own (:func:`decode_releases`),
so one release it cannot read never costs it the others (the router marks its stream
cursor before decoding: a release lost here is never replayed, and the budgets it frees
stay overcounted until their TTLs). A ``reason`` this version does not know (a newer
plugin's) is read as ``other`` with the release's figures kept; a release that is
unreadable otherwise is dropped and reported in :attr:`DecodedReleases.unreadable` for
the receiver to count.

Versions: the message is 1.0 with ``displaced``, ``pressure`` and ``reset``; 1.1 adds the
reason ``gone``. A new reason changes neither the subject nor the fields, so the message
carries no version of its own: what a receiver acts on, the figures, means the same in
every version, and a receiver of an earlier version reads the new reason as ``other``
(above), losing only why. The sender, which cannot know its receivers' versions, just
sends it. A reason a receiver must not apply without understanding it would need a new
subject version instead (:mod:`kvhint.schemas.subjects`). Each version has its golden
JSON (``tests/golden/holds_released.json`` 1.0, ``holds_released_v1_1.json`` 1.1); an
earlier version's stays as it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec

from kvhint.schemas._codec import (
    MAX_SESSION_ID_CHARS,
    WireDecodeError,
    convert,
    decode_json,
    encode_json,
    too_long,
)
from kvhint.schemas.outcomes import Amount


class ReleaseReason(str, enum.Enum):
    DISPLACED = "displaced"
    PRESSURE = "pressure"
    RESET = "reset"
    GONE = "gone"  # 1.1
    # What a receiver reads for a reason it does not know (a newer plugin's): the
    # release still counts; only why is unknown. A plugin of this version never sends it.
    # Values stay within 16 characters (the router stores them in a String(16) column).
    OTHER = "other"


class HoldRelease(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks one accepted Pin/Retain action lost. ``session_id``: the session its target
    named (None for a block-hash target), at most schemas._codec.MAX_SESSION_ID_CHARS
    long: a receiver drops a release with a longer one as unreadable."""

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


class _LooseReleases(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    releases: list[Any]
    at: float


_KNOWN_REASONS = frozenset(r.value for r in ReleaseReason)


@dataclass(frozen=True, slots=True)
class DecodedReleases:
    """What a receiver made of one hold-releases message: ``releases`` holds every
    release it could read (an unknown reason read as ``other``); ``unreadable`` says, per
    release it had to drop, why (the receiver counts them)."""

    worker_id: str
    releases: list[HoldRelease]
    at: float
    unreadable: tuple[str, ...] = ()


def decode_releases(data: bytes | str) -> DecodedReleases:
    """Decode one hold-releases message leniently, release by release. Raises
    :class:`WireDecodeError` only when the message as a whole is unusable (not JSON, no
    worker_id, at or releases list)."""
    message = decode_json(data, _LooseReleases, "hold releases")
    releases: list[HoldRelease] = []
    unreadable: list[str] = []
    for index, raw in enumerate(message.releases):
        # An unknown (or missing, or unreadable) reason costs only the reason: the
        # figures are what keeps the receiver's budgets true.
        if isinstance(raw, dict) and not (isinstance(raw.get("reason"), str)
                                          and raw["reason"] in _KNOWN_REASONS):
            raw = {**raw, "reason": ReleaseReason.OTHER.value}
        try:
            release = convert(raw, HoldRelease, f"releases[{index}]")
        except WireDecodeError as exc:
            unreadable.append(str(exc))
            continue
        # No session the router made has a longer id (schemas._codec.
        # MAX_SESSION_ID_CHARS), and a plugin refuses such targets: a sender's bug.
        if (long := too_long("session_id", release.session_id, MAX_SESSION_ID_CHARS,
                             "dropped")) is not None:
            unreadable.append(f"invalid releases[{index}]: {long}")
            continue
        releases.append(release)
    return DecodedReleases(message.worker_id, releases, message.at, tuple(unreadable))
