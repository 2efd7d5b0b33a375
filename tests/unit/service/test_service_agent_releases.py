"""What a session's end releases of the agent's claims, another replica's included
(router/service/agent_releases.py; end to end:
tests/integration/service/test_service_replica_agent_claims.py)."""

from __future__ import annotations

from kvhint.router.policy import HoldingsLedger, agent_scope
from kvhint.router.service.agent_releases import (
    end_release_id,
    release_targets,
    released_claim,
)
from kvhint.schemas import Amount, HintOutcome, HintOwner, OutcomeStatus

SID = "default/s"


def _outcome(action_id: str, status: OutcomeStatus) -> HintOutcome:
    return HintOutcome(message_id="m", action_id=action_id, action_type="kv.retain",
                       worker_id="w0", status=status, applied=Amount(0, 0), at=0.0)


def test_a_release_id_names_the_claim_and_fits_the_store() -> None:
    claim = "kva-" + "t" * 64 + ":" + "x" * 48  # the longest a caller's id makes
    first, second = end_release_id(claim, "0123456789abcdef"), end_release_id(claim, "ff" * 8)
    assert first != second and len(first) <= 128
    assert released_claim(_outcome(first, OutcomeStatus.ACCEPTED)) == claim
    assert released_claim(_outcome(first, OutcomeStatus.CLIPPED)) == claim
    # Not applied, or not an end's release of another replica's claim: nothing let go.
    assert released_claim(_outcome(first, OutcomeStatus.REJECTED)) is None
    assert released_claim(_outcome(first, OutcomeStatus.MISSING)) is None
    assert released_claim(_outcome("kvh-0123456789abcdef", OutcomeStatus.ACCEPTED)) is None
    assert released_claim(_outcome("kva-t:kve-x", OutcomeStatus.ACCEPTED)) is None


def test_another_replicas_stored_claims_are_released_and_named() -> None:
    ledger = HoldingsLedger()
    ledger.record(action_id="kva-own", worker_id="w0", tenant="default",
                  scope=agent_scope(SID), action_type="kv.pin", blocks=2, expires_at=1e12,
                  api=True)
    stored = [
        {"action_id": "kva-own", "worker_id": "w0", "scope": agent_scope(SID)},
        {"action_id": "kva-a1", "worker_id": "w1", "scope": agent_scope(SID)},
        {"action_id": "kva-a2", "worker_id": "w1", "scope": agent_scope(SID)},  # later
        {"action_id": "kva-old", "worker_id": "w2", "scope": SID},  # old form (no owner)
        {"action_id": "kva-old2", "worker_id": "w0", "scope": SID},  # the planner's end's
        {"action_id": "kva-wait", "worker_id": "w3", "scope": agent_scope(SID)},  # pending
        {"action_id": "kva-bh", "worker_id": "w4", "scope": agent_scope(SID) + "#kva-bh"},
    ]
    targets = release_targets(ledger, SID, "w0", stored, pending={"kva-wait"})
    assert targets == [("w0", agent_scope(SID), HintOwner.AGENT, None),
                       ("w1", agent_scope(SID), HintOwner.AGENT, "kva-a2"),
                       ("w2", SID, HintOwner.PLANNER, "kva-old")]
    # With nothing stored: this replica's own only, as before.
    assert release_targets(ledger, SID, "w0", [], pending=()) == [
        ("w0", agent_scope(SID), HintOwner.AGENT, None)]
