"""A Prefetch whose wait the prefetch budget clipped reserves, in the router's holdings
ledger, no more than it waits for, on vLLM's real KVCacheManager and block pool.

The plugin answers such a Prefetch ``deferred`` and waits for its first N (root-most)
target blocks only (engine_plugin/prefetch.py), so it can never hold more than N; its
``deferred`` says N (``waits_for``, outcome 1.1) and the ledger caps the holding there
(HoldingsLedger.settle). Before, the ledger kept every block it requested reserved until
it settled (up to its deadline), and a tenant could be refused room the worker could
never fill. A deferred Prefetch that waits for all of its blocks says nothing more and
stays reserved at what it requested (they may all come).
"""

from __future__ import annotations

import msgspec
from core_fixtures import cached_blocks
from ledger_fixtures import LedgerWorker

from kvhint.router.policy import Holdings
from kvhint.schemas import Amount, OutcomeStatus

DEADLINE_S = 60.0


def _coming(blocks_of: str, first: int) -> list[int]:
    """The hashes of four blocks not cached on the worker under test (the same hasher:
    another pool computes them)."""
    elsewhere = LedgerWorker(retain_blocks=32)
    return cached_blocks(elsewhere.cache, elsewhere.core, blocks_of, first)


def test_a_clipped_wait_reserves_only_the_blocks_it_waits_for() -> None:
    w = LedgerWorker(retain_blocks=32, prefetch_budget_fraction=0.05)
    assert w.core.executor.max_prefetch_blocks == 3
    coming = _coming("n", 700)
    payload = {"target": {"block_hashes": coming}, "deadline_s": DEADLINE_S}
    deferred = w.send("pf", "kv.prefetch", payload, "n", 4, DEADLINE_S)
    assert deferred.status is OutcomeStatus.DEFERRED, deferred
    assert "waiting for the first 3" in deferred.reason, deferred.reason
    assert deferred.waits_for == Amount(blocks=3, tokens=3 * 16), deferred
    # Before: Holdings(0, 4) for the tenant and the worker until the Prefetch settled.
    assert w.ledger.worker("w0") == w.ledger.tenant("t") == Holdings(0, 3)
    # Its blocks come: it retains the three it waited for, as the ledger reserved.
    cached_blocks(w.cache, w.core, "n", 700)
    w.now[0] += 1.0
    (outcome,) = w.advance()
    assert (outcome.status, outcome.applied.blocks) == (OutcomeStatus.CLIPPED, 3), outcome
    assert w.core.executor.retained_blocks == 3 and w.agrees(), w.ledger.worker("w0")


def test_only_the_wait_the_budget_clipped_is_capped() -> None:
    w = LedgerWorker(retain_blocks=32, prefetch_budget_fraction=0.1)
    assert w.core.executor.max_prefetch_blocks == 6
    first = w.send("pf1", "kv.prefetch", {
        "target": {"block_hashes": _coming("n", 700)}, "deadline_s": DEADLINE_S},
        "n", 4, DEADLINE_S)
    # Room for all four: it waits for every block and says nothing more (the 1.0 form).
    assert first.status is OutcomeStatus.DEFERRED and first.waits_for is msgspec.UNSET
    assert w.ledger.worker("w0") == Holdings(0, 4)
    # Two blocks of room left: the next waits for its first two, reserved as such.
    second = w.send("pf2", "kv.prefetch", {
        "target": {"block_hashes": _coming("m", 900)}, "deadline_s": DEADLINE_S},
        "m", 4, DEADLINE_S)
    assert second.status is OutcomeStatus.DEFERRED, second
    assert second.waits_for == Amount(blocks=2, tokens=2 * 16), second
    # Before: Holdings(0, 8).
    assert w.ledger.worker("w0") == w.ledger.tenant("t") == Holdings(0, 4 + 2)
