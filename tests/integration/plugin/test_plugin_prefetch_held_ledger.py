"""What the router's holdings ledger counts for a Prefetch against what the plugin then
holds, on vLLM's real KVCacheManager and block pool.

- A Prefetch's ``applied`` is what its worker retains for it until its deadline (the
  ledger reads it so: holdings.held_blocks), not what it found in G1: when the retain
  budget has no room for all of them (higher-ranked claims fill it), it is ``clipped`` to
  the blocks the retain took. Before, it answered ``accepted`` with every block in G1 as
  ``applied`` while the worker retained fewer (none, with the budget full), and the
  worker's and tenant's budgets counted the rest as held until the deadline.
- A ``Retain{priority: 0}`` by block hashes releases the owner's session-less retain
  claims on those blocks, a Prefetch's among them (a Prefetch's retain is of no session):
  the claims it cuts are reported (``displaced``, as a Demote naming blocks reports the
  claims it cuts), so the ledger lets their holdings go. Before, nothing said so, and the
  ledger counted the Prefetch's blocks as held until its deadline.
"""

from __future__ import annotations

from core_fixtures import cached_blocks
from ledger_fixtures import LedgerWorker

from kvhint.schemas import OutcomeStatus

DEADLINE_S = 60.0


def _retain(w: LedgerWorker, action_id: str, session: str, chain: list[int]) -> None:
    outcome = w.send(action_id, "kv.retain",
                     {"target": {"session_id": session}, "priority": 100, "ttl_s": 600},
                     session, len(chain), 600, tuple(chain))
    assert outcome.status is OutcomeStatus.ACCEPTED


def test_a_prefetch_answered_at_once_applies_what_its_retain_took() -> None:
    w = LedgerWorker(retain_blocks=6)
    top = cached_blocks(w.cache, w.core, "top", 1)
    chain = cached_blocks(w.cache, w.core, "s", 500)
    _retain(w, "r-top", "top", top)  # the planner's Retain at 100: 4 of the 6
    payload = {"target": {"session_id": "s"}, "deadline_s": DEADLINE_S}
    outcome = w.send("pf", "kv.prefetch", payload, "s", 4, DEADLINE_S, tuple(chain))
    # Its retain (80) displaces nothing of the 100: 2 of its 4 blocks in G1 fit.
    assert (outcome.status, outcome.applied.blocks) == (OutcomeStatus.CLIPPED, 2), outcome
    assert "2 of 4 blocks retained" in outcome.reason, outcome.reason
    assert w.core.executor.retained_blocks == 6 and w.agrees(), w.ledger.worker("w0")
    # The budget full: one more retains nothing and the ledger counts nothing for it.
    other = cached_blocks(w.cache, w.core, "o", 900)
    full = w.send("pf-full", "kv.prefetch", {**payload, "target": {"session_id": "o"}},
                  "o", 4, DEADLINE_S, tuple(other))
    assert (full.status, full.applied.blocks) == (OutcomeStatus.CLIPPED, 0), full
    assert "pf-full" not in w.ledger and w.agrees(), w.ledger.worker("w0")
    # With room for all of them it is accepted, every block applied.
    roomy = LedgerWorker(retain_blocks=32)
    chain = cached_blocks(roomy.cache, roomy.core, "s", 500)
    outcome = roomy.send("pf", "kv.prefetch", payload, "s", 4, DEADLINE_S, tuple(chain))
    assert (outcome.status, outcome.applied.blocks) == (OutcomeStatus.ACCEPTED, 4), outcome
    assert roomy.agrees()


def test_a_waiting_prefetch_applies_what_its_retain_took_when_its_blocks_come() -> None:
    w = LedgerWorker(retain_blocks=6)
    # The hashes of a prompt not cached yet (the same hasher: another pool computes them).
    elsewhere = LedgerWorker(retain_blocks=6)
    coming = cached_blocks(elsewhere.cache, elsewhere.core, "n", 700)
    top = cached_blocks(w.cache, w.core, "top", 1)
    _retain(w, "r-top", "top", top)
    payload = {"target": {"block_hashes": coming}, "deadline_s": DEADLINE_S}
    deferred = w.send("pf", "kv.prefetch", payload, "n", 4, DEADLINE_S)
    assert deferred.status is OutcomeStatus.DEFERRED
    cached_blocks(w.cache, w.core, "n", 700)  # a request brings them into G1
    w.now[0] += 1.0
    (outcome,) = w.advance()
    assert (outcome.status, outcome.applied.blocks) == (OutcomeStatus.CLIPPED, 2), outcome
    assert w.core.executor.retained_blocks == 6 and w.agrees(), w.ledger.worker("w0")


def test_a_release_by_block_hashes_lets_the_ledger_drop_the_prefetch_it_cut() -> None:
    w = LedgerWorker(retain_blocks=32)
    chain = cached_blocks(w.cache, w.core, "s", 500)
    payload = {"target": {"session_id": "s"}, "deadline_s": DEADLINE_S}
    outcome = w.send("pf", "kv.prefetch", payload, "s", 4, DEADLINE_S, tuple(chain))
    assert (outcome.status, outcome.applied.blocks) == (OutcomeStatus.ACCEPTED, 4)
    # The same owner (the planner's, a 1.0 action) releases two of its blocks by hash.
    release = {"target": {"block_hashes": chain[2:]}, "priority": 0, "ttl_s": 30}
    answer = w.send("rel", "kv.retain", release, "prefix:x", 2, 30)
    assert (answer.status, answer.applied.blocks) == (OutcomeStatus.ACCEPTED, 0), answer
    assert w.core.executor.retained_blocks == 2
    assert w.agrees(), w.ledger.worker("w0")
    # All four: the Prefetch holds nothing, and the ledger no holding of it.
    w.send("rel2", "kv.retain", {**release, "target": {"block_hashes": chain}},
           "prefix:x", 4, 30)
    assert w.core.executor.retained_blocks == 0 and "pf" not in w.ledger
    assert w.agrees(), w.ledger.worker("w0")
