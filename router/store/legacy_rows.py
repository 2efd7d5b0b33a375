"""Hint action rows without ``scope`` / ``expires_at``, read as the router writes them now.

Revision 0002 added ``scope`` (what a Pin/Retain protects) and ``expires_at`` (when its
TTL ends) to ``hint_actions``; restart recovery rebuilds what each worker and tenant
holds from them (:func:`kvhint.router.store.reader.load_recovery`). A row a router of
the first schema (0001) wrote has NULL in both: without them its holding was not
restored, and the worker's and the tenant's budgets were believed free of blocks the
worker still held, until the action's TTL ended (up to the plugin's retain maximum, an
hour by default).

The two values are not lost: they are functions of the stored payload (the action as
sent), the row's other columns and the time it was sent (``created_at``). This module
derives them by the rules the router applies when it sends an action now:

- ``scope``: a session target's ``session_id`` (the worker-side ``<tenant>/<session>``);
  an API action naming ``block_hashes``, its session's (``<tenant>/<session_id>`` of the
  row), with ``#<action_id>`` after it for a Pin/Retain/Demote (a scope of its own:
  :func:`kvhint.router.policy.holdings.block_hash_scope`); the planner's shared-prefix
  Retain, ``prefix:<tenant>:<hash>``
  (:func:`shared_prefix_scope`); ``agent:`` before it when the payload says
  ``owner: agent`` (:func:`kvhint.router.policy.agent_scope`). See
  ``router/service/hint_api_actions.py`` ``holding_scope`` and
  ``router/policy/shared_prefixes.py``.
- ``expires_at``: ``created_at`` plus how long the worker holds it, as the worker reads
  and clips the payload (``held_for_s`` in ``hint_api_actions.py``): a Pin its ``ttl_s``
  (the wire default, 60 s, when the payload leaves it out) up to the worker's
  ``max_pin_ttl_s``; a Retain its ``ttl_s`` up to ``max_retain_ttl_s``, or that maximum
  when it has none; a Prefetch its ``deadline_s``, and once answered (accepted or
  clipped) at most ``max_retain_ttl_s`` past its answer (``updated_at``: its retain
  starts then and is clipped as a Retain's), a Share its ``ttl_s``, a Demote 0.
  The planner's TTLs are within the maxima already (it clips them when it plans).

Derived on read rather than by a data migration: during a rolling upgrade (and after a
rollback) a router of the older release keeps writing rows without these columns into
the migrated store (migrations/README.md), which a one-time UPDATE would miss; and a
migration should not import the planner's rules, which may change after it is frozen.
Only rows sent within :data:`LEGACY_LOOKBACK_S` can still hold anything, so the
derivation costs nothing once no older router has written for a day.

A value that cannot be derived (a payload that no longer parses, a Retain without TTL on
a worker whose budgets the store does not know) stays NULL, and the row is restored as
it was before: without a holding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from kvhint.router.policy.holdings import (
    BLOCK_HASH_SCOPE_TYPES,
    agent_scope,
    block_hash_scope,
    prefetch_held_until,
)
from kvhint.router.policy.shared_prefixes import PREFIX_SCOPE
from kvhint.schemas import Budgets
from kvhint.schemas.hints import (
    MAX_TTL_S,
    PAYLOAD_TYPES,
    ActionType,
    HintOwner,
    HintPayload,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
)

# The ``source`` of an action an agent runtime sent through the sessions API (and of the
# release of its claims): kvhint.router.service.hint_records.API_SOURCE, as stored.
_API_SOURCE = "api"
# No action holds anything longer than the contract's longest TTL: a row sent longer ago
# than this is over, whatever it asked.
LEGACY_LOOKBACK_S = MAX_TTL_S


def worker_budgets(workers: Iterable[Mapping[str, Any]]) -> dict[str, Budgets]:
    """Each stored worker's budgets, from its last heartbeat (``workers.status``); a
    worker whose heartbeat does not carry readable budgets is left out."""
    budgets: dict[str, Budgets] = {}
    for row in workers:
        status = row.get("status")
        if not isinstance(status, Mapping):
            continue
        try:
            budgets[row["worker_id"]] = msgspec.convert(status.get("budgets"), Budgets)
        except msgspec.ValidationError:
            continue
    return budgets


def with_derived_columns(row: dict[str, Any], budgets: Budgets | None) -> dict[str, Any]:
    """``row`` with a NULL ``scope`` and ``expires_at`` derived from its payload and its
    ``created_at`` (module docstring); ``budgets``: its worker's, as last heard (None:
    not known). Values already stored are never replaced. Returns ``row`` itself when
    there is nothing to derive, else a copy."""
    if row.get("scope") is not None and row.get("expires_at") is not None:
        return row
    payload = _typed_payload(row)
    if payload is None:
        return row
    filled = dict(row)
    if filled.get("scope") is None:
        filled["scope"] = derived_scope(row, payload)
    if filled.get("expires_at") is None:
        filled["expires_at"] = derived_expires_at(row, payload, budgets)
    return filled


def derived_scope(row: Mapping[str, Any], payload: HintPayload) -> str | None:
    """What the router's holding of the action protects, as the sender named it (None
    when the row does not say)."""
    target = payload.target
    if target.session_id is not None:
        scope = target.session_id
    elif row.get("source") == _API_SOURCE:
        if row.get("tenant") is None or row.get("session_id") is None:
            return None
        scope = f"{row['tenant']}/{row['session_id']}"
    elif target.block_hashes and row.get("tenant") is not None:
        return shared_prefix_scope(row["tenant"], target.block_hashes)
    else:
        return None
    if getattr(payload, "owner", HintOwner.PLANNER) is HintOwner.AGENT:
        scope = agent_scope(scope)
    if (target.block_hashes and row.get("action_type") in BLOCK_HASH_SCOPE_TYPES
            and row.get("action_id") is not None):
        return block_hash_scope(scope, row["action_id"])
    return scope


def shared_prefix_scope(tenant: str, block_hashes: list[int]) -> str:
    """The scope of the planner's Retain of a shared prefix of ``tenant`` whose target is
    ``block_hashes``: ``prefix:<tenant>:<key hash>``. The prefix's key is the hash of its
    last block at the power-of-two length it was counted at, and the Retain's target
    extends that length to where its sessions part, never to the next power of two
    (``find_shared_prefixes``: a prefix all of them shared that far would have been found
    there): so the key's block is the one at the largest power of two within the
    target."""
    counted = 1 << (len(block_hashes).bit_length() - 1)
    return f"{PREFIX_SCOPE}{tenant}:{block_hashes[counted - 1]:016x}"


def derived_expires_at(row: Mapping[str, Any], payload: HintPayload,
                       budgets: Budgets | None) -> float | None:
    """When the worker's hold of the action ends: sent (``created_at``) plus its TTL as
    the worker reads and clips it (None: a Retain without TTL whose worker's maximum is
    not known)."""
    sent = float(row["created_at"])
    asked = getattr(payload, "ttl_s", None)
    if isinstance(payload, PinPayload):
        held = asked if budgets is None else min(asked, budgets.max_pin_ttl_s)
    elif isinstance(payload, RetainPayload):
        if budgets is not None:
            held = min(asked or budgets.max_retain_ttl_s, budgets.max_retain_ttl_s)
        elif asked is None:
            return None
        else:
            held = asked
    elif isinstance(payload, PrefetchPayload):
        end = sent + payload.deadline_s
        if row.get("status") not in ("accepted", "clipped") or row.get("updated_at") is None:
            return end
        return prefetch_held_until(end, float(row["updated_at"]),
                                   None if budgets is None else budgets.max_retain_ttl_s)
    else:
        held = asked or 0.0
    return sent + float(held)


def _typed_payload(row: Mapping[str, Any]) -> HintPayload | None:
    """The row's payload as the worker parsed it (with the wire defaults it leaves out);
    None for an unknown action type or a payload that does not parse."""
    try:
        payload_type = PAYLOAD_TYPES[ActionType(row.get("action_type"))]
    except ValueError:
        return None
    try:
        return msgspec.convert(row.get("payload"), payload_type)
    except msgspec.ValidationError:
        return None
