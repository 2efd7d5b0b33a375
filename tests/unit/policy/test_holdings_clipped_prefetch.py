"""A clipped Prefetch's holding in the router's ledger: the plugin retains until the
Prefetch's deadline what it applied when the prefetch budget left no room to wait (what
was in G1 already) and when a budget-clipped one completes (the blocks it waited for);
one clipped at its deadline retains nothing (engine_plugin/prefetch.py). Before, every
clipped Prefetch counted as holding nothing, and the worker's and tenant's budgets (and
max_worker_share) believed that room free until the deadline."""

from __future__ import annotations

import msgspec

from kvhint.router.policy import Holdings, HoldingsLedger
from kvhint.router.policy.holdings import held_blocks
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus

DEADLINE = 100.0


def _prefetch(ledger: HoldingsLedger, action_id: str, keys: tuple[int, ...],
              scope: str = "t/s") -> None:
    ledger.record(action_id=action_id, worker_id="w0", tenant="t", scope=scope,
                  action_type="kv.prefetch", blocks=len(keys), expires_at=DEADLINE,
                  keys=keys)


def _answer(action_id: str, status: OutcomeStatus, requested: int,
            applied: int) -> HintOutcome:
    return HintOutcome(message_id="m", action_id=action_id, action_type="kv.prefetch",
                       worker_id="w0", status=status, reason="prefetch budget",
                       requested=Amount(requested), applied=Amount(applied), at=0.0)


def test_a_clipped_prefetch_holds_what_it_applied_until_its_deadline() -> None:
    ledger = HoldingsLedger()
    # No room to wait: 2 of its 5 blocks were in G1, retained until the deadline.
    _prefetch(ledger, "no-room", (1, 2, 3, 4, 5))
    ledger.settle(_answer("no-room", OutcomeStatus.CLIPPED, 5, 2), now=10.0)
    assert "no-room" in ledger
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 2)
    # Budget-clipped, then complete: the 3 it waited for are retained.
    _prefetch(ledger, "waited", (11, 12, 13, 14), scope="t/x")
    ledger.settle(_answer("waited", OutcomeStatus.CLIPPED, 4, 3), now=20.0)
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 5)
    # Its root-most blocks, as the worker keeps them: another holding of the same
    # blocks adds nothing.
    ledger.record(action_id="r", worker_id="w0", tenant="t", scope="t/y",
                  action_type="kv.retain", blocks=2, expires_at=DEADLINE, keys=(11, 12))
    assert ledger.worker("w0") == Holdings(0, 5)
    ledger.release_scope("w0", "t/y")
    # Held until the deadline, then gone.
    assert ledger.expire(DEADLINE) == 2 and ledger.worker("w0") == Holdings()
    assert ledger.tenant("t") == Holdings() and len(ledger) == 0


def test_a_prefetch_clipped_at_its_deadline_holds_nothing() -> None:
    # Part of its target in G1 when the deadline passed: the worker retains nothing; its
    # answer comes past the holding's TTL, which goes at once.
    ledger = HoldingsLedger()
    _prefetch(ledger, "late", (1, 2, 3))
    ledger.settle(_answer("late", OutcomeStatus.CLIPPED, 3, 1), now=DEADLINE + 0.5)
    assert "late" not in ledger and ledger.worker("w0") == Holdings()
    # Nothing in G1 when clipped for want of room: nothing held either.
    _prefetch(ledger, "none", (1, 2))
    ledger.settle(_answer("none", OutcomeStatus.CLIPPED, 2, 0), now=10.0)
    assert "none" not in ledger and ledger.worker("w0") == Holdings()


def test_held_blocks_of_each_prefetch_answer() -> None:
    assert held_blocks(_answer("a", OutcomeStatus.ACCEPTED, 4, 4)) == 4
    assert held_blocks(_answer("a", OutcomeStatus.CLIPPED, 4, 3)) == 3
    assert held_blocks(_answer("a", OutcomeStatus.MISSING, 4, 0)) == 0
    assert held_blocks(_answer("a", OutcomeStatus.REJECTED, 4, 0)) == 0
    assert held_blocks(_answer("a", OutcomeStatus.DEFERRED, 4, 1)) is None


def test_a_deferred_prefetch_whose_wait_was_clipped_reserves_only_what_it_waits_for() -> None:
    """Outcome 1.1 ``waits_for``: the most a budget-clipped waiting Prefetch can hold
    (its first blocks). Before, it stayed reserved at all it requested until it settled."""
    ledger = HoldingsLedger()
    _prefetch(ledger, "pf", (1, 2, 3, 4, 5))
    plain = _answer("pf", OutcomeStatus.DEFERRED, 5, 0)
    ledger.settle(plain)  # a 1.0 plugin's, or a wait not clipped: all may come
    assert ledger.worker("w0") == Holdings(0, 5)
    capped = msgspec.structs.replace(plain, waits_for=Amount(2))
    ledger.settle(capped)
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 2)
    # Its root-most blocks: a Retain of them adds nothing; of the others, it does.
    ledger.record(action_id="r", worker_id="w0", tenant="t", scope="t/y",
                  action_type="kv.retain", blocks=2, expires_at=DEADLINE, keys=(1, 2))
    assert ledger.worker("w0") == Holdings(0, 2)
    ledger.release_scope("w0", "t/y")
    # A cap never grows a holding (a repeat of a larger one is a no-op) ...
    ledger.settle(msgspec.structs.replace(plain, waits_for=Amount(4)))
    assert ledger.worker("w0") == Holdings(0, 2)
    # ... and the terminal answer settles it as before.
    ledger.settle(_answer("pf", OutcomeStatus.CLIPPED, 5, 2), now=10.0)
    assert ledger.worker("w0") == Holdings(0, 2) and "pf" in ledger
    # Another type's deferred (a Demote waiting for host copies) never carries it; were
    # one to, a Pin's holding would not shrink.
    ledger.record(action_id="pin", worker_id="w0", tenant="t", scope="t/p",
                  action_type="kv.pin", blocks=3, expires_at=DEADLINE, keys=(7, 8, 9))
    ledger.settle(msgspec.structs.replace(plain, action_id="pin", action_type="kv.pin",
                                          waits_for=Amount(1)))
    assert ledger.worker("w0") == Holdings(3, 2)
