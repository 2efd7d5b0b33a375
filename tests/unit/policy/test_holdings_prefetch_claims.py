"""Each Prefetch's own retain in the router's ledger, as the plugin keeps it: a claim of its
own under the action's id, of no session, until its own deadline (engine_plugin/prefetch.py
``_retain_until``; holds.py). Before, the ledger keyed it ``prefetch:<scope>``, one per
session and worker: a second Prefetch of the session replaced the first, and when the
second ended (its shorter deadline, a rejection) the ledger believed free the blocks the
worker still retained for the first (budgets, ``max_worker_share``)."""

from __future__ import annotations

from kvhint.router.policy import Holdings, HoldingsLedger
from kvhint.router.policy.holdings import prefetch_scope
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus


def _prefetch(ledger: HoldingsLedger, action_id: str, blocks: int, expires_at: float,
              keys: tuple[int, ...] = (), scope: str = "t/s", tentative: bool = False
              ) -> None:
    ledger.record(action_id=action_id, worker_id="w0", tenant="t", scope=scope,
                  action_type="kv.prefetch", blocks=blocks, expires_at=expires_at,
                  keys=keys, tentative=tentative)


def _answer(action_id: str, status: OutcomeStatus, blocks: int) -> HintOutcome:
    return HintOutcome(message_id="m", action_id=action_id, action_type="kv.prefetch",
                       worker_id="w0", status=status, reason="", requested=Amount(blocks),
                       applied=Amount(blocks if status.is_terminal else 0), at=0.0)


def test_two_prefetches_of_a_session_each_hold_until_their_own_deadline() -> None:
    ledger = HoldingsLedger()
    _prefetch(ledger, "p1", 4, 100.0, keys=(1, 2, 3, 4))
    _prefetch(ledger, "p2", 4, 50.0, keys=(1, 2, 3, 4))  # the same blocks, shorter
    assert "p1" in ledger and "p2" in ledger
    # One block under two claims is one block, on the worker and here.
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 4)
    assert ledger.holds("w0", prefetch_scope("t/s", "p1"))
    assert ledger.holds("w0", prefetch_scope("t/s", "p2"))
    # The second's deadline passes: the worker still retains them for the first.
    assert ledger.expire(50.0) == 1
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 4)
    assert ledger.expire(100.0) == 1 and ledger.worker("w0") == Holdings()
    assert len(ledger) == 0


def test_a_rejected_second_prefetch_leaves_the_first_and_different_blocks_add_up() -> None:
    ledger = HoldingsLedger()
    _prefetch(ledger, "p1", 4, 100.0, keys=(1, 2, 3, 4))
    ledger.settle(_answer("p1", OutcomeStatus.ACCEPTED, 4), now=1.0)
    _prefetch(ledger, "p2", 6, 100.0, keys=(1, 2, 3, 4, 5, 6))  # the session grew
    assert ledger.worker("w0") == Holdings(0, 6)
    ledger.settle(_answer("p2", OutcomeStatus.REJECTED, 6), now=2.0)
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 4) and "p1" in ledger
    # Another session's Prefetch on the worker: its own blocks.
    _prefetch(ledger, "q1", 3, 100.0, keys=(7, 8, 9), scope="t/other")
    assert ledger.worker("w0") == Holdings(0, 7)


def test_a_sessions_unnamed_prefetch_blocks_count_once_per_worker() -> None:
    # Blocks the caller could not name (a restart restores a session's Prefetch without
    # its prompt's hashes) are the session's root-most blocks on the worker: the same
    # for each of its Prefetches, as the worker counts them.
    ledger = HoldingsLedger()
    _prefetch(ledger, "p1", 4, 100.0)
    _prefetch(ledger, "p2", 6, 50.0)
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 6)
    assert ledger.expire(50.0) == 1 and ledger.worker("w0") == Holdings(0, 4)
    # Another session's are its own; a Retain's unnamed blocks stay its own too.
    _prefetch(ledger, "q1", 4, 100.0, scope="t/other")
    ledger.record(action_id="r1", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.retain", blocks=2, expires_at=100.0)
    assert ledger.worker("w0") == Holdings(0, 10)
    assert ledger.expire(100.0) == 3 and ledger.worker("w0") == Holdings()


def test_session_protections_leave_a_prefetchs_retain_as_the_worker_does() -> None:
    # The plugin's Prefetch claim is of no session: a later Retain, Pin or Demote of the
    # session supersedes that session's claims, never a Prefetch's.
    ledger = HoldingsLedger()
    _prefetch(ledger, "p1", 4, 100.0, keys=(1, 2, 3, 4))
    ledger.record(action_id="r1", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.retain", blocks=6, expires_at=200.0,
                  keys=(1, 2, 3, 4, 5, 6))
    assert ledger.worker("w0") == Holdings(0, 6)
    ledger.record(action_id="d1", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.demote", blocks=6, expires_at=0.0)
    assert "r1" not in ledger and "p1" in ledger and ledger.worker("w0") == Holdings(0, 4)


def test_an_unpublished_second_prefetch_undone_leaves_the_first() -> None:
    ledger = HoldingsLedger()
    _prefetch(ledger, "p1", 4, 100.0, keys=(1, 2, 3, 4), tentative=True)
    ledger.confirm("p1")
    _prefetch(ledger, "p2", 6, 100.0, keys=(1, 2, 3, 4, 5, 6), tentative=True)
    assert ledger.worker("w0") == Holdings(0, 6)
    ledger.undo("p2", now=10.0)
    assert "p2" not in ledger and "p1" in ledger
    assert ledger.worker("w0") == ledger.tenant("t") == Holdings(0, 4)
    # An id sent again replaces its own holding (the worker replaces a claim under a
    # known id), never another Prefetch's.
    _prefetch(ledger, "p1", 2, 100.0, keys=(1, 2))
    assert len(ledger) == 1 and ledger.worker("w0") == Holdings(0, 2)


def test_the_budget_check_counts_a_sessions_unnamed_prefetch_blocks_as_record_does() -> None:
    """An agent's second Prefetch of a session whose blocks the router cannot name adds
    nothing the first does not hold (record names them as the session's root-most
    blocks); the API's budget check (``added``) agrees. Before, it charged all of them
    again: a tenant at its retained cap got a 429 for room it already held."""
    ledger = HoldingsLedger()
    ledger.record(action_id="p1", worker_id="w0", tenant="t", scope="agent:t/s",
                  action_type="kv.prefetch", blocks=4, expires_at=100.0, api=True)
    assert ledger.added("w0", "t", "kv.prefetch", 4, (), "agent:t/s") == (0, 0, 0)
    assert ledger.added("w0", "t", "kv.prefetch", 6, (), "agent:t/s") == (2, 2, 2)
    assert ledger.added("w0", "t", "kv.prefetch", 4, (), "agent:t/other") == (4, 4, 4)
