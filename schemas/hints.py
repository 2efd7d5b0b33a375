"""Hints: router (or an agent runtime, through the router) -> engine plugin.

The envelope is the shape vLLM merged in ``vllm/v1/kv_hints/protocol.py`` (and Dynamo
emits), so a payload can later ride on a request unchanged::

    KvHintsEnvelope {protocol_version: "1", message_id, actions: [KvHintAction]}
    KvHintAction    {action_id, action_type: "kv.retain"|..., action_version: "1.0", payload}

``payload`` stays an untyped mapping on the envelope (as in vLLM); :func:`parse_action`
turns it into a typed payload or into an :class:`InvalidAction` carrying the reason, so
an unknown type, an unknown version or a malformed payload becomes a ``rejected``
outcome instead of an exception in the receiver's loop.

Encoding: JSON. Block hashes are the unsigned 64-bit ints vLLM publishes in KV events.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvhint.schemas._codec import (
    MAX_ID_CHARS,
    MAX_SESSION_ID_CHARS,
    U64_MAX,
    WORKER_ID_PATTERN,
    WireDecodeError,
    clipped_reason,
    convert,
    decode_json,
    encode_json,
    quoted,
    too_long,
)

PROTOCOL_VERSION = "1"
ACTION_VERSION = "1.0"
# kv.retain and kv.pin 1.1 add ``evict_rest_first``; an action without it is sent as 1.0,
# byte for byte what a 1.0 worker accepts.
EVICT_REST_VERSION = "1.1"
# kv.retain, kv.pin, kv.demote and kv.prefetch 1.2 add ``owner`` (1.2 keeps what 1.1
# added); an action of the default owner is sent as before.
OWNER_VERSION = "1.2"

# The reason's start for an action id named more than once in one envelope
# (one_per_action_id): the sender's bug, not transient.
DUPLICATE_ACTION_ID = "invalid envelope: duplicate action_id"

# The longest message_id a receiver takes (a router's is 20 characters): every outcome of
# the message echoes it.
MAX_MESSAGE_ID_CHARS = 256
# The longest action_id and action_type a receiver echoes (schemas._codec.MAX_ID_CHARS):
# an action with a longer one is answered ``rejected`` under an empty id or type (an
# outcome of no id is remembered by no receiver), the start of it quoted in the reason.
MAX_ACTION_ID_CHARS = MAX_ID_CHARS

# Upper bound on any TTL or deadline a hint may ask for (one day). Workers clip further.
MAX_TTL_S = 86_400.0

Priority = Annotated[int, Meta(ge=0, le=100, description="0 = lowest, 100 = highest")]
Seconds = Annotated[float, Meta(gt=0, le=MAX_TTL_S)]
# Unsigned 64-bit; the upper bound is checked in Target.problem() (msgspec cannot
# express bounds beyond int64).
BlockHash = Annotated[int, Meta(ge=0)]
WorkerId = Annotated[str, Meta(pattern=WORKER_ID_PATTERN)]


class ActionType(str, enum.Enum):
    RETAIN = "kv.retain"
    PIN = "kv.pin"
    DEMOTE = "kv.demote"
    PREFETCH = "kv.prefetch"
    SHARE = "kv.share"


# Every ActionType's wire value: what a label or a counter keyed by a wire string may take
# as is (anything else is a newer or buggy peer's and is bucketed, never a new label value).
ACTION_TYPE_VALUES = frozenset(action.value for action in ActionType)


class HintOwner(str, enum.Enum):
    """Who a Pin, Retain, Demote or Prefetch speaks for. A worker keeps each owner's claims on a
    session apart: the router's planner re-plans a session all the time and must not
    undo a Pin an agent runtime asked for through the router's API."""

    PLANNER = "planner"
    AGENT = "agent"


class KvHintAction(msgspec.Struct, frozen=True):
    """One versioned action; ``payload`` is validated by :func:`parse_action`."""

    action_id: str
    action_type: str
    action_version: str
    payload: dict[str, Any]


class KvHintsEnvelope(msgspec.Struct, frozen=True):
    protocol_version: str
    message_id: str
    actions: list[KvHintAction]


class Target(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Which blocks an action is about. Exactly one form:

    - ``{session_id}``: every block of the session's chains on that worker;
    - ``{block_hashes}``: those blocks (64-bit hashes from KV events);
    - ``{session_id, prefix_tokens}``: the first ``prefix_tokens`` tokens of the session's
      chain (rounded down to whole blocks).
    """

    session_id: str | None = None
    block_hashes: list[BlockHash] | None = None
    prefix_tokens: Annotated[int, Meta(gt=0)] | None = None

    def problem(self) -> str | None:
        """Why this selector is unusable, or None when it is one of the three forms."""
        if self.block_hashes is not None:
            if self.session_id is not None or self.prefix_tokens is not None:
                return "target: give block_hashes alone, not with session_id or prefix_tokens"
            if not self.block_hashes:
                return "target: block_hashes is empty"
            if any(h > U64_MAX for h in self.block_hashes):
                return "target: block_hashes must be unsigned 64-bit integers"
            return None
        if self.session_id is None:
            if self.prefix_tokens is not None:
                return "target: prefix_tokens needs a session_id"
            return "target: give session_id, block_hashes, or session_id with prefix_tokens"
        if not self.session_id:
            return "target: session_id is empty"
        # schemas._codec.MAX_SESSION_ID_CHARS: a session-scoped hold keeps it in memory.
        if (long := too_long("session_id", self.session_id, MAX_SESSION_ID_CHARS,
                             "not held")) is not None:
            return f"target: {long}"
        return None


class _Payload(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    target: Target
    # Unix time after which the worker must not apply the action any more (answers
    # ``rejected`` with reason "expired"). None: no expiry beyond the action's own TTL.
    expires_at: float | None = None


class _OwnedPayload(_Payload, frozen=True, kw_only=True):
    """A payload that makes or ends claims on a session (action_version 1.2 for a
    non-default ``owner``). A session-targeted action supersedes the earlier claims of
    its own owner on that session only; an agent's Demote also those of the planner
    (the agent knows the session's GPU copy is not needed), and a planner's Demote lets
    go no block an agent's claim holds."""

    owner: HintOwner = HintOwner.PLANNER


class RetainPayload(_OwnedPayload, frozen=True):
    """Bias eviction order; no guarantee. Released under pressure before any preemption.

    ``evict_rest_first`` (action_version 1.1, session targets only): the session's other
    resident blocks that are free and that no other session or claim uses (its blocks
    past the target's prefix: a response its next turn will not read, branches it left)
    move to the head of the eviction order."""

    priority: Priority = 50
    ttl_s: Seconds | None = None
    evict_rest_first: bool = False


class PinPayload(_OwnedPayload, frozen=True):
    """Protect from eviction until ``ttl_s``; clipped to the worker's budget and max TTL.
    ``evict_rest_first``: as for :class:`RetainPayload`."""

    ttl_s: Seconds = 60.0
    evict_rest_first: bool = False


class DemotePayload(_OwnedPayload, frozen=True):
    """Keep a host-tier (G2) copy, then let the GPU (G1) copy go first."""


class PrefetchPayload(_OwnedPayload, frozen=True):
    """Have the blocks in G1 within ``deadline_s``. ``owner`` (action_version 1.2) only
    ranks the retain that keeps them there until the deadline, as a Retain of that owner
    ranks; a Prefetch supersedes no claim."""

    deadline_s: Seconds = 5.0


class SharePayload(_Payload, frozen=True):
    """Make the blocks readable by ``destination_worker`` for ``ttl_s``."""

    destination_worker: WorkerId
    ttl_s: Seconds = 60.0


HintPayload = RetainPayload | PinPayload | DemotePayload | PrefetchPayload | SharePayload

PAYLOAD_TYPES: dict[ActionType, type[_Payload]] = {
    ActionType.RETAIN: RetainPayload,
    ActionType.PIN: PinPayload,
    ActionType.DEMOTE: DemotePayload,
    ActionType.PREFETCH: PrefetchPayload,
    ActionType.SHARE: SharePayload,
}

# action type -> versions this contract defines. A worker advertises the subset it runs.
SUPPORTED_VERSIONS: dict[str, tuple[str, ...]] = {
    ActionType.RETAIN.value: (ACTION_VERSION, EVICT_REST_VERSION, OWNER_VERSION),
    ActionType.PIN.value: (ACTION_VERSION, EVICT_REST_VERSION, OWNER_VERSION),
    ActionType.DEMOTE.value: (ACTION_VERSION, OWNER_VERSION),
    ActionType.PREFETCH.value: (ACTION_VERSION, OWNER_VERSION),
    ActionType.SHARE.value: (ACTION_VERSION,),
}


@dataclass(frozen=True, slots=True)
class ParsedAction:
    action_id: str
    action_type: ActionType
    payload: HintPayload


@dataclass(frozen=True, slots=True)
class InvalidAction:
    """An action the receiver must answer ``rejected`` with ``reason``."""

    action_id: str
    action_type: str
    reason: str


def _too_long(action_id: str, action_type: str) -> InvalidAction | None:
    """The rejection of an action whose id or type is too long to echo, or None."""
    problems = [problem for name, value in (("action_id", action_id),
                                            ("action_type", action_type))
                if (problem := too_long(name, value, MAX_ACTION_ID_CHARS)) is not None]
    if not problems:
        return None
    return InvalidAction("" if len(action_id) > MAX_ACTION_ID_CHARS else action_id,
                         "" if len(action_type) > MAX_ACTION_ID_CHARS else action_type,
                         "; ".join(problems))


def parse_action(action: KvHintAction) -> ParsedAction | InvalidAction:
    """Type an action's payload; never raises for bad input."""
    if (too_long := _too_long(action.action_id, action.action_type)) is not None:
        return too_long
    if not action.action_id:
        return InvalidAction(action.action_id, action.action_type, "action_id is empty")
    try:
        action_type = ActionType(action.action_type)
    except ValueError:
        known = ", ".join(t.value for t in ActionType)
        return InvalidAction(
            action.action_id,
            action.action_type,
            f"unsupported action_type {action.action_type!r} (known: {known})",
        )
    if action.action_version not in SUPPORTED_VERSIONS[action_type.value]:
        return InvalidAction(
            action.action_id,
            action.action_type,
            f"unsupported action_version {quoted(action.action_version)} for "
            f"{action_type.value} (supported: {', '.join(SUPPORTED_VERSIONS[action_type.value])})",
        )
    try:
        payload = convert(action.payload, PAYLOAD_TYPES[action_type], "payload")
    except WireDecodeError as exc:  # a msgspec error quotes the bad value: clipped
        return InvalidAction(action.action_id, action.action_type, clipped_reason(str(exc)))
    problem = payload.target.problem() or _version_problem(action.action_version, payload)
    if problem is not None:
        return InvalidAction(action.action_id, action.action_type, f"invalid payload: {problem}")
    return ParsedAction(action.action_id, action_type, payload)


def _version_problem(version: str, payload: _Payload) -> str | None:
    if getattr(payload, "owner", HintOwner.PLANNER) is not HintOwner.PLANNER \
            and version != OWNER_VERSION:
        return f"owner needs action_version {OWNER_VERSION}"
    if not getattr(payload, "evict_rest_first", False):
        return None
    if version == ACTION_VERSION:
        return f"evict_rest_first needs action_version {EVICT_REST_VERSION} or later"
    if payload.target.session_id is None:
        return "evict_rest_first needs a session target (the rest of which session?)"
    return None


class _LooseEnvelope(msgspec.Struct, frozen=True):
    protocol_version: str
    message_id: str
    actions: list[Any]


@dataclass(frozen=True, slots=True)
class DecodedHints:
    """What a receiver made of one hints message.

    ``error`` is set when the message as a whole is unusable (not JSON, wrong
    protocol_version, no message_id); then ``actions`` holds whatever actions could still
    be identified, all invalid, so each can be answered.
    """

    message_id: str
    actions: list[ParsedAction | InvalidAction]
    error: str | None = None


def decode_hints(data: bytes | str) -> DecodedHints:
    """Decode one hints message leniently: one bad action does not sink the others."""
    try:
        loose = decode_json(data, _LooseEnvelope, "hints envelope")
    except WireDecodeError as exc:
        return DecodedHints(message_id="", actions=[], error=str(exc))
    actions: list[ParsedAction | InvalidAction] = []
    for index, raw in enumerate(loose.actions):
        try:
            action = convert(raw, KvHintAction, f"actions[{index}]")
        except WireDecodeError as exc:
            action_id = raw.get("action_id", "") if isinstance(raw, dict) else ""
            action_type = raw.get("action_type", "") if isinstance(raw, dict) else ""
            action_id, action_type = str(action_id or ""), str(action_type or "")
            actions.append(_too_long(action_id, action_type)
                           or InvalidAction(action_id, action_type, clipped_reason(str(exc))))
            continue
        actions.append(parse_action(action))
    actions = one_per_action_id(actions)
    if loose.protocol_version != PROTOCOL_VERSION:
        reason = (
            f"unsupported protocol_version {quoted(loose.protocol_version)} "
            f"(supported: {PROTOCOL_VERSION!r})"
        )
        rejected = [InvalidAction(a.action_id, _type_name(a), reason) for a in actions]
        return DecodedHints(loose.message_id, rejected, error=reason)
    if not loose.message_id or len(loose.message_id) > MAX_MESSAGE_ID_CHARS:
        # Each action's outcome echoes the message id: before, a 500 KB one on 6k
        # actions of a 1 MB message made 3 GB of outcomes. Not echoed when too long.
        reason = ("message_id is empty" if not loose.message_id else
                  f"message_id is longer than {MAX_MESSAGE_ID_CHARS} characters")
        rejected = [InvalidAction(a.action_id, _type_name(a), reason) for a in actions]
        return DecodedHints("", rejected, error=reason)
    return DecodedHints(loose.message_id, actions)


def one_per_action_id(actions: Sequence[ParsedAction | InvalidAction]
                      ) -> list[ParsedAction | InvalidAction]:
    """``actions`` with each action id at most once. An id an envelope names more than
    once names no one action: none of its actions is applied, and the id is answered
    once, ``rejected`` (an :class:`InvalidAction` in the first one's place). Answering
    each copy (before: the first applied, every later copy answered the first's outcome
    again) gave the receiver's outcomes, keyed by action id, two answers for one id, the
    second of which may describe another action. An empty id is no id: such actions
    stay, each rejected on its own."""
    counts = Counter(a.action_id for a in actions if a.action_id)
    if all(n == 1 for n in counts.values()):
        return list(actions)
    out: list[ParsedAction | InvalidAction] = []
    for action in actions:
        n = counts.get(action.action_id, 1)
        if n == 1:
            out.append(action)
        elif n > 1:
            counts[action.action_id] = 0  # answered once, here
            out.append(InvalidAction(
                action.action_id, _type_name(action),
                f"{DUPLICATE_ACTION_ID} {action.action_id!r}: named {n} times in this "
                "message; none of them applied"))
    return out


def _type_name(action: ParsedAction | InvalidAction) -> str:
    if isinstance(action, ParsedAction):
        return action.action_type.value
    return action.action_type


def evict_rest_supported(supported_actions: Mapping[str, Sequence[str]]) -> bool:
    """Whether a worker advertising ``supported_actions`` (its status) takes
    ``evict_rest_first`` on both kv.retain and kv.pin (their version 1.1)."""
    return all(EVICT_REST_VERSION in supported_actions.get(t.value, ())
               for t in (ActionType.RETAIN, ActionType.PIN))


def owner_supported(supported_actions: Mapping[str, Sequence[str]], action_type: str) -> bool:
    """Whether a worker advertising ``supported_actions`` takes ``owner`` on
    ``action_type`` (its version 1.2)."""
    return OWNER_VERSION in supported_actions.get(action_type, ())


def action_version(payload: HintPayload) -> str:
    """The lowest version that carries ``payload``: a worker that knows only 1.0 still
    takes every action that uses no later field."""
    if getattr(payload, "owner", HintOwner.PLANNER) is not HintOwner.PLANNER:
        return OWNER_VERSION
    if getattr(payload, "evict_rest_first", False):
        return EVICT_REST_VERSION
    return ACTION_VERSION


def make_action(action_id: str, payload: HintPayload) -> KvHintAction:
    """Build a wire action from a typed payload (the planner's and tests' way in)."""
    action_type = next(t for t, cls in PAYLOAD_TYPES.items() if type(payload) is cls)
    version = action_version(payload)
    return KvHintAction(
        action_id=action_id,
        action_type=action_type.value,
        action_version=version,
        payload=msgspec.to_builtins(payload),
    )


def encode_hints(envelope: KvHintsEnvelope) -> bytes:
    return encode_json(envelope)
