"""An API Pin/Retain naming ``block_hashes`` (a fleet admin's, through a session's hints
call) has a holding scope of its own in the router's ledger, as the worker keeps a
block-hash claim apart from the session's: on vLLM's real KVCacheManager, it supersedes
none of the session's claims, and none of them supersedes it.

Before, it took its session's scope (hint_api_actions.holding_scope): the ledger let the
agent's session Pin go while the worker still pinned its blocks (the worker's and the
tenant's budgets saw that room free), and the agent's next session Retain dropped the
block-hash claim from the ledger while the worker kept it."""

from __future__ import annotations

from core_fixtures import cached_blocks
from ledger_fixtures import LedgerWorker

from kvhint.router.service.hint_api_actions import holding_scope
from kvhint.schemas import OWNER_VERSION, KvHintAction, OutcomeStatus

SID = "t/s"


def _api(w: LedgerWorker, action_id: str, action_type: str, payload: dict, blocks: int,
         chain: tuple[int, ...] = ()) -> None:
    """As the sessions API sends it: the agent as owner, its scope from holding_scope."""
    payload = payload | {"owner": "agent"}
    scope = holding_scope(KvHintAction(action_id, action_type, OWNER_VERSION, payload), SID)
    outcome = w.send(action_id, action_type, payload, scope, blocks, 60, chain,
                     version=OWNER_VERSION)
    assert outcome.status is OutcomeStatus.ACCEPTED, outcome


def test_a_block_hash_claim_neither_supersedes_nor_is_superseded_by_the_sessions() -> None:
    w = LedgerWorker(retain_blocks=32)
    chain = cached_blocks(w.cache, w.core, SID, 500)
    _api(w, "kva-pin", "kv.pin", {"target": {"session_id": SID}, "ttl_s": 60}, 4,
         tuple(chain))
    _api(w, "kva-hashes", "kv.retain",
         {"target": {"block_hashes": chain[:2]}, "priority": 50, "ttl_s": 60}, 2)
    assert (w.core.executor.pinned_blocks, w.core.executor.retained_blocks) == (4, 0)
    assert "kva-pin" in w.ledger and w.agrees(), w.ledger.worker("w0")
    # The session's next claim (a Retain replacing the Pin) leaves the block-hash one.
    _api(w, "kva-next", "kv.retain",
         {"target": {"session_id": SID}, "priority": 10, "ttl_s": 60}, 4, tuple(chain))
    assert "kva-hashes" in w.ledger and "kva-pin" not in w.ledger
    assert w.core.executor.retained_blocks == 4 and w.agrees(), w.ledger.worker("w0")
    # Released by its own hashes, the block-hash claim goes; the session's Retain stays.
    _api(w, "kva-rel", "kv.retain",
         {"target": {"block_hashes": chain[:2]}, "priority": 0, "ttl_s": 30}, 2)
    assert "kva-hashes" not in w.ledger and "kva-next" in w.ledger
    assert w.core.executor.retained_blocks == 4 and w.agrees(), w.ledger.worker("w0")
