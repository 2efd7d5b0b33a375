"""The holdings ledger's rules, as pure functions and constants (no state, no I/O).

Split from :mod:`.holdings` along this seam: :class:`~.holdings.HoldingsLedger` keeps the
live holdings and their counts; this says what one outcome or action means for them, and
each is re-exported from :mod:`.holdings`, where callers import them. Its contract:

- what a worker's answer leaves held (:func:`held_blocks`, :func:`waits_for_blocks`) and
  until when a Prefetch holds (:func:`prefetch_held_until`);
- which blocks a holding names (:func:`target_keys`; for a session Prefetch that names
  none, :func:`named_keys` / :func:`session_block_names`) and how much of two holdings'
  named blocks is common (:func:`common_prefix`);
- the scopes a holding is kept under: an agent runtime's (:func:`agent_scope`), an API
  ``block_hashes`` target's (:func:`block_hash_scope`), one Prefetch's own
  (:func:`prefetch_scope`); which action types hold blocks (``HOLDING_TYPES``);
- a budget's room left (:func:`room_left`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from msgspec import UNSET

from kvhint.schemas.hints import ActionType
from kvhint.schemas.outcomes import HintOutcome, OutcomeStatus


def held_blocks(outcome: HintOutcome) -> int | None:
    """The blocks a Pin/Retain/Prefetch holds on its worker after this answer: ``applied``
    when accepted or clipped, none when rejected or missing; None for a ``deferred`` (not
    an answer yet). A Prefetch retains what it applied until its deadline, clipped too:
    one the prefetch budget left no room to wait retains what was already in G1, and one
    the budget clipped retains the blocks it waited for once they came (before, a clipped
    Prefetch counted as holding nothing, and the budgets believed room free that the
    worker held until the deadline). A clipped Prefetch answered at its deadline retains
    nothing: its holding is past its TTL then
    (:meth:`~kvhint.router.policy.holdings.HoldingsLedger.settle`'s ``now``)."""
    if not outcome.status.is_terminal:
        return None
    if outcome.status in (OutcomeStatus.ACCEPTED, OutcomeStatus.CLIPPED):
        return outcome.applied.blocks
    return 0


def waits_for_blocks(outcome: HintOutcome) -> int | None:
    """The most a Prefetch answered ``deferred`` can hold when it settles: the first
    blocks its worker's prefetch budget clipped its wait to (``waits_for``, outcome 1.1);
    None when the answer does not say (not clipped, another status, a 1.0 plugin's)."""
    if outcome.status is not OutcomeStatus.DEFERRED or outcome.waits_for is UNSET:
        return None
    return outcome.waits_for.blocks


def target_keys(action_type: str, payload: Mapping[str, Any], block_size: int,
                chain: Sequence[int] = ()) -> tuple[int, ...]:
    """The block hashes a Pin/Retain's target names, root first, as far as the caller
    knows them: its ``block_hashes``; for a session target, the first blocks of ``chain``
    (the hashes of the session's last prompt on that worker), up to ``prefix_tokens``.
    Empty for other actions or an unknown chain."""
    target = payload.get("target") if action_type in HOLDING_TYPES else None
    if not isinstance(target, Mapping):
        return ()
    if hashes := target.get("block_hashes"):
        return tuple(hashes)
    if target.get("session_id") is None or not chain:
        return ()
    prefix_tokens = target.get("prefix_tokens")
    if prefix_tokens is None:
        return tuple(chain)
    return tuple(chain[:prefix_tokens // max(block_size, 1)])


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


AGENT_SCOPE = "agent:"


def agent_scope(session_scope: str) -> str:
    """The scope of what an agent runtime holds for a session through the router's API:
    apart from the planner's own holding of that session, as workers that take ``owner``
    keep the two owners' claims apart."""
    return AGENT_SCOPE + session_scope


# The API actions whose ``block_hashes`` target gets a scope of its own (block_hash_scope;
# a Prefetch is each its own already: prefetch_scope).
BLOCK_HASH_SCOPE_TYPES = frozenset({ActionType.PIN.value, ActionType.RETAIN.value,
                                    ActionType.DEMOTE.value})


def block_hash_scope(scope: str, action_id: str) -> str:
    """The scope of an API Pin/Retain/Demote whose target is ``block_hashes`` (sent for
    the session ``scope`` names): one of its own, as the worker keeps a block-hash claim
    apart from the session's (no newer claim of the session supersedes it, and it
    supersedes none of them; hint_api_actions.holding_scope). Before, it shared the
    session's scope, and the ledger let go the session's holding the worker kept."""
    return f"{scope}#{action_id}"


def room_left(held: int, limit: int | None) -> int:
    """Blocks a budget of ``limit`` has left with ``held`` in use (None: no limit)."""
    if limit is None:
        return 1 << 62
    return max(limit - held, 0)



# Prefetch: the worker retains what it brought into G1 until the Prefetch's deadline.
HOLDING_TYPES = frozenset({ActionType.PIN.value, ActionType.RETAIN.value,
                            ActionType.PREFETCH.value})
PREFETCH_SCOPE = "prefetch:"


def prefetch_scope(scope: str, action_id: str) -> str:
    """The ledger's scope of one Prefetch's own retain: the plugin keeps each as a claim
    of its own, of no session, until its own deadline (engine_plugin/prefetch.py). Before,
    a session's Prefetches on a worker shared one: a second replaced the first."""
    return f"{PREFETCH_SCOPE}{scope}@{action_id}"


def prefetch_held_until(deadline_at: float, answered_at: float,
                        retain_max_s: float | None) -> float:
    """When a Prefetch answered at ``answered_at`` stops holding: its retain starts at the
    answer and lasts to the deadline, clipped to the worker's ``max_retain_ttl_s``
    (``retain_max_s``; executor._retain). Before its answer, the deadline bounds it."""
    return deadline_at if retain_max_s is None else min(deadline_at,
                                                        answered_at + retain_max_s)


def session_block_names(scope: str, blocks: int) -> tuple[Hashable, ...]:
    """Names for the blocks of a session Prefetch the caller could not name: the
    session's root-most blocks on the worker (whoever owns the claim), the same for each
    of its Prefetches, so they count their common blocks once, as the worker does (past
    ``1 << 16``, more than any GPU cache's, a stored count is not a real one: the rest
    count as its own). A Pin/Retain's unnamed blocks stay its own."""
    session = scope.removeprefix(AGENT_SCOPE)
    return tuple((PREFETCH_SCOPE, session, i) for i in range(min(blocks, 1 << 16)))


def named_keys(action_type: str, scope: str, blocks: int,
               keys: Sequence[Hashable]) -> Sequence[Hashable]:
    """The names a holding's blocks are counted by: ``keys`` as the caller named them,
    or for a session Prefetch that names none, its session's (:func:`session_block_names`;
    :meth:`.holdings.HoldingsLedger.record` and :meth:`.holdings.HoldingsLedger.added`
    alike)."""
    if action_type == ActionType.PREFETCH.value and not keys and scope:
        return session_block_names(scope, blocks)
    return keys
