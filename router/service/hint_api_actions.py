"""The actions of an agent runtime's hints call (``POST /v1/sessions/{id}/hints``,
:mod:`.sessions_api`), checked one by one before anything is sent: the ids they go out
under (:func:`call_action_ids`); each bound to the session and parsed as its worker will
parse it, within the tenant's and the worker's bounds (:func:`checked_action`); and what
the router's holdings count for it until the worker answers (:func:`holding_scope`,
:func:`held_for_s`, :func:`target_blocks`).
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec

from kvhint.router.policy import agent_scope
from kvhint.router.policy.holdings import BLOCK_HASH_SCOPE_TYPES, block_hash_scope
from kvhint.router.service.runtime import RouterRuntime
from kvhint.router.service.tenancy import Principal
from kvhint.schemas import (
    ACTION_VERSION,
    EVICT_REST_VERSION,
    OWNER_VERSION,
    ActionType,
    Budgets,
    HintOwner,
    HintPayload,
    InvalidAction,
    KvHintAction,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
    owner_supported,
    parse_action,
)
from kvhint.schemas.hints import PAYLOAD_TYPES

# Versions an agent's action may be sent as 1.2 instead of (1.2 carries what they do).
_OWNER_UPGRADES = frozenset({ACTION_VERSION, EVICT_REST_VERSION, OWNER_VERSION})

# A caller's own action id (see call_action_ids); with the tenant name (64) it fits the
# store's 128-character column.
MAX_CALLER_ACTION_ID_LEN = 48
_CALLER_ACTION_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CALLER_ACTION_ID_LEN}}}")
STILL_PENDING = "is still pending: wait for its outcome, or send another action_id"


class HintRequestAction(msgspec.Struct, forbid_unknown_fields=True):
    action_type: str
    payload: dict[str, Any] = {}
    action_version: str = ACTION_VERSION
    action_id: str | None = None


def call_action_ids(actions: list[HintRequestAction], tenant_name: str,
                    runtime: RouterRuntime) -> tuple[list[str], list[dict[str, str]]]:
    """The ids the actions go out under, and what is wrong with the ones given.

    A caller's ``action_id`` is its tenant's: it goes out as ``kva-<tenant>:<id>``, so two
    tenants choosing the same id never meet in the worker's duplicate memory, the router's
    pending table or the store, and the same id again from the same tenant is the same
    action (idempotent, as the worker answers a repeat). Without one, the router picks
    ``kva-<random>``."""
    ids: list[str] = []
    problems: list[dict[str, str]] = []
    for index, item in enumerate(actions):
        given = item.action_id
        if given is None:
            ids.append(f"kva-{runtime.hints.new_id()}")
            continue
        action_id = f"kva-{tenant_name}:{given}"
        if not _CALLER_ACTION_ID.fullmatch(given):
            reason = (f"action_id must be 1-{MAX_CALLER_ACTION_ID_LEN} letters, digits, "
                      f"'.', '_', ':' or '-'")
        elif action_id in ids:
            reason = "action_id is given twice in this call"
        elif action_id in runtime.hints.pending:
            reason = f"action {action_id} {STILL_PENDING}"
        else:
            reason = ""
        if reason:
            problems.append({"index": str(index), "action_id": given, "reason": reason})
        ids.append(action_id)
    return ids, problems


def holding_scope(action: KvHintAction, worker_sid: str) -> str:
    """The router's holding scope of an API action: the agent's own, apart from the
    planner's, where the worker keeps owners apart (the action says ``owner``); else the
    session's, which the planner's next protection replaces, as the worker does. A
    Pin/Retain/Demote naming ``block_hashes`` has one of its own within that
    (:func:`~kvhint.router.policy.holdings.block_hash_scope`): the worker supersedes no
    session claim with it, nor it with a session's (a Prefetch is each its own already)."""
    scope = (agent_scope(worker_sid) if action.payload.get("owner") == HintOwner.AGENT.value
             else worker_sid)
    target = action.payload.get("target")
    if (isinstance(target, dict) and target.get("block_hashes")
            and action.action_type in BLOCK_HASH_SCOPE_TYPES):
        return block_hash_scope(scope, action.action_id)
    return scope


def held_for_s(payload: HintPayload, budgets: Budgets) -> float:
    """How long the worker holds what an action asks for, as it reads and clips it (the
    payload as parsed, so with the wire defaults a caller left out: a Pin's 60 s): a Pin's
    TTL to ``max_pin_ttl_s``; a Retain's to ``max_retain_ttl_s``, which is also what one
    without a TTL gets; a Prefetch its ``deadline_s``: its retain starts at its answer,
    which may come at any time up to then, and is clipped to ``max_retain_ttl_s`` from
    there (the ledger and the row end it so at the answer:
    :func:`~kvhint.router.policy.holdings.prefetch_held_until`; before, it was clipped
    from the send, and a Prefetch answered past that was dropped while the worker held
    its blocks); other actions their ``ttl_s`` (0 for one-shots)."""
    asked = getattr(payload, "ttl_s", None)
    if isinstance(payload, PinPayload):
        return min(float(asked), budgets.max_pin_ttl_s)
    if isinstance(payload, RetainPayload):
        return min(float(asked or budgets.max_retain_ttl_s), budgets.max_retain_ttl_s)
    if isinstance(payload, PrefetchPayload):
        return float(payload.deadline_s)
    return float(asked or 0.0)


def target_blocks(action: KvHintAction, session_blocks: int, block_size: int) -> int:
    """The blocks an action's target can cover, as far as the router knows before the
    worker answers: its ``block_hashes``, or the session's chain up to ``prefix_tokens``."""
    target = action.payload.get("target") or {}
    if target.get("block_hashes"):
        return len(target["block_hashes"])
    if target.get("prefix_tokens") is not None:
        return min(session_blocks, target["prefix_tokens"] // max(block_size, 1))
    return session_blocks


def _beyond_pool(payload: HintPayload, worker: Any) -> str | None:
    """Why a target's ``prefix_tokens`` is refused: more than the worker's GPU cache can
    hold (as its plugin refuses it; the wire type leaves it unbounded), or None."""
    target = getattr(payload, "target", None)
    tokens = target.prefix_tokens if target is not None else None
    pool = worker.status.usage.gpu_blocks_total * worker.status.block_size
    if tokens is None or pool <= 0 or tokens <= pool:
        return None
    return (f"target.prefix_tokens={tokens} is more than the {pool} tokens of worker "
            f"{worker.worker_id}'s GPU cache")


def checked_action(item: HintRequestAction, action_id: str, worker_sid: str,
                   principal: Principal, budget: Any, worker: Any,
                   runtime: RouterRuntime
                   ) -> tuple[str | None, tuple[KvHintAction, HintPayload] | None]:
    """(problem, None) or (None, (the action with its target bound to this session, its
    payload as the worker will parse it))."""
    payload = dict(item.payload)
    target = payload.get("target")
    if target is None:
        payload["target"] = {"session_id": worker_sid}
    elif isinstance(target, dict):
        target = dict(target)
        if target.get("block_hashes") is not None:
            if principal.tenant is not None:
                return "block_hashes targets need a global admin key (tenancy)", None
        else:
            given = target.get("session_id")
            client_sid = worker_sid.partition("/")[2]
            if given not in (None, client_sid, worker_sid):
                return "target.session_id must be this session", None
            target["session_id"] = worker_sid
        payload["target"] = target
    if item.action_type == ActionType.RETAIN.value and payload.get("ttl_s") is None:
        # The worker holds an untimed Retain for its max_retain_ttl_s (an hour by
        # default): past the tenant's max_hint_ttl_s, which a ttl_s given is held to.
        payload["ttl_s"] = min(budget.max_hint_ttl_s, worker.status.budgets.max_retain_ttl_s)
    version = item.action_version
    # An agent's claims must outlive the planner's re-planning of the session: the worker
    # keeps them apart when it takes ``owner``. The API decides the owner, not the caller.
    payload.pop("owner", None)
    if version in _OWNER_UPGRADES and owner_supported(worker.status.supported_actions,
                                                      item.action_type):
        payload["owner"] = HintOwner.AGENT.value
        version = OWNER_VERSION
    elif version == OWNER_VERSION:
        # The worker does not take owner on this type (a plugin of an earlier release):
        # with owner taken out, nothing of 1.2 is left, and the lowest version that
        # carries the rest goes (1.1 for evict_rest_first). Before, it went as 1.2,
        # which that worker rejects.
        rest_first = payload.get("evict_rest_first") and item.action_type in (
            ActionType.RETAIN.value, ActionType.PIN.value)
        version = EVICT_REST_VERSION if rest_first else ACTION_VERSION
    action = KvHintAction(action_id=action_id, action_type=item.action_type,
                          action_version=version, payload=payload)
    parsed = parse_action(action)
    if isinstance(parsed, InvalidAction):
        return parsed.reason, None
    expires_at = parsed.payload.expires_at
    if expires_at is not None and expires_at <= time.time():
        return f"expires_at={expires_at} has passed (unix seconds)", None
    for field_name in ("ttl_s", "deadline_s"):
        value = getattr(parsed.payload, field_name, None)
        if value is not None and value > budget.max_hint_ttl_s:
            return (f"{field_name}={value} exceeds this tenant's limit of "
                    f"{budget.max_hint_ttl_s}s"), None
    problem = _beyond_pool(parsed.payload, worker)
    if problem is not None:
        return problem, None
    if parsed.action_type.value not in worker.status.supported_actions:
        return f"worker {worker.worker_id} does not support {parsed.action_type.value}", None
    if parsed.action_type is ActionType.SHARE:
        destination = parsed.payload.destination_worker  # type: ignore[union-attr]
        if runtime.workers.get(destination) is None:
            return f"unknown destination_worker {destination!r}", None
    assert parsed.action_type in PAYLOAD_TYPES
    return None, (action, parsed.payload)
