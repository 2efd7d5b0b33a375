"""What a session's end releases of the agent runtimes' claims, whichever replica sent
them (``SessionLifecycle._release_agent_claims``), and how every replica hears it.

Replicas share the store and NATS, and each counts in its holdings ledger only the
claims the hints API sent through it. An end through another replica (a load balancer
without affinity) released only what its own ledger counted: a Pin sent through A, the
session ended through B, stayed on the worker until its TTL, and A's budgets counted it
as long. Now the end also reads the session's live agent claims from the store (their
``hint_actions`` rows: :func:`~kvhint.router.store.reader.live_agent_claims_within`,
``StoredSessions.agent_claims``) and releases each (worker, scope) one names, as it does
its own. A replica's unflushed rows (``store_flush_interval_s``) are not read yet: a
claim sent through A in the last flush interval before the end through B stays to its
TTL, as before.

A release for another replica's claim goes out under an id that names the claim
(:func:`end_release_id`: ``kve-<nonce>-`` and the claim's id past its ``kva-``; a
second end sends a release of its own, never the first's id again): every replica hears every
outcome, and the one whose ledger holds the claim lets it go when the worker answers
the release applied (``HintDispatcher.on_outcome``, :func:`released_claim`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

from kvhint.router.policy import HoldingsLedger, PlannedAction, agent_scope
from kvhint.schemas import (
    HintOutcome,
    HintOwner,
    OutcomeStatus,
    RetainPayload,
    Target,
    make_action,
)

# An end's release of another replica's claim: this, a nonce of 8 hex digits, "-", and
# the claim's id past its prefix (an API claim's id is ``kva-<tenant>:<id>``, at most
# 117 characters: the release's, at most 126, fits the store's 128).
END_RELEASE_PREFIX = "kve-"
_CLAIM_PREFIX = "kva-"
_APPLIED = (OutcomeStatus.ACCEPTED, OutcomeStatus.CLIPPED)

# (worker, scope, owner the release goes as, the claim of another replica it names)
ReleaseTarget = tuple[str, str, HintOwner, str | None]


def end_release_id(claim_id: str, nonce: str) -> str:
    """The id of a release of the claim ``claim_id`` (an API claim's, ``kva-...``)."""
    return f"{END_RELEASE_PREFIX}{nonce[:8]}-{claim_id.removeprefix(_CLAIM_PREFIX)}"


def released_claim(outcome: HintOutcome) -> str | None:
    """The claim an end's release of another replica's claim let go (the worker applied
    it), or None: not such a release, or not applied."""
    if not outcome.action_id.startswith(END_RELEASE_PREFIX) or outcome.status not in _APPLIED:
        return None
    _nonce, dash, claim = outcome.action_id[len(END_RELEASE_PREFIX):].partition("-")
    return _CLAIM_PREFIX + claim if dash and claim else None


def release_targets(holdings: HoldingsLedger, session_scope: str,
                    planner_ends_on: str | None, stored: Sequence[dict[str, Any]],
                    pending: Container[str]) -> list[ReleaseTarget]:
    """Where an end releases the agent's claims: each worker holding the session's agent
    scope (the agent's own claims, ``owner: agent``) or its session scope through the
    API (old form, no owner; not on ``planner_ends_on``, whose end supersedes it), as
    this replica's ledger counts them, and as ``stored`` (live claim rows, oldest first)
    names them where they are not this replica's (neither in its ledger nor
    ``pending``): then the latest of them on that worker and scope is the claim its
    release names."""
    scope = agent_scope(session_scope)
    targets: dict[tuple[str, str], tuple[HintOwner, str | None]] = {
        (worker_id, scope): (HintOwner.AGENT, None)
        for worker_id in holdings.workers_holding(scope)}
    targets.update({(worker_id, session_scope): (HintOwner.PLANNER, None)
                    for worker_id in holdings.api_holders(session_scope)
                    if worker_id != planner_ends_on})
    for row in stored:
        worker_id, held_scope, claim_id = row["worker_id"], row["scope"], row["action_id"]
        if claim_id in holdings or claim_id in pending or not claim_id.startswith(
                _CLAIM_PREFIX):
            continue
        if held_scope == scope:
            targets[(worker_id, scope)] = (HintOwner.AGENT, claim_id)
        elif held_scope == session_scope and worker_id != planner_ends_on:
            targets[(worker_id, session_scope)] = (HintOwner.PLANNER, claim_id)
    return [(worker_id, held_scope, owner, claim_id)
            for (worker_id, held_scope), (owner, claim_id) in targets.items()]


def release_actions(targets: Sequence[ReleaseTarget], session_scope: str, tenant: str,
                    ttl_s: float, now: float, new_id: Callable[[], str]
                    ) -> list[PlannedAction]:
    """The end's release of each of ``targets`` (:func:`release_targets`): a Retain of
    priority 0 of the session, as the claim's owner, under an id of its own or, for
    another replica's claim, one naming it (:func:`end_release_id`)."""
    actions = []
    for worker_id, held_scope, owner, claim_id in targets:
        payload = RetainPayload(target=Target(session_id=session_scope), priority=0,
                                ttl_s=ttl_s, owner=owner)
        action_id = (f"kvh-{new_id()}" if claim_id is None
                     else end_release_id(claim_id, new_id()))
        actions.append(PlannedAction(worker_id, make_action(action_id, payload), held_scope,
                                     tenant, 0, now + ttl_s, "end:agent_release"))
    return actions
