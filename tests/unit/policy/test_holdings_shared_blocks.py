"""The holdings ledger counts a block under several holdings once, as the worker does."""

from __future__ import annotations

from kvhint.router.policy import Holdings, HoldingsLedger, target_keys
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus

SYSTEM = (101, 102, 103, 104)  # a system prompt's blocks, shared by every session below


def _retain(ledger: HoldingsLedger, action_id: str, scope: str, keys: tuple[int, ...],
            blocks: int | None = None, tenant: str | None = "t", worker: str = "w0",
            action_type: str = "kv.retain") -> None:
    ledger.record(action_id=action_id, worker_id=worker, tenant=tenant, scope=scope,
                  action_type=action_type, blocks=len(keys) if blocks is None else blocks,
                  expires_at=100.0, keys=keys)


def test_sessions_sharing_a_system_prompt_count_its_blocks_once() -> None:
    # Before: 3 sessions x (4 shared + 2 own) = 18 retained blocks; the worker holds 10.
    ledger = HoldingsLedger()
    for n in range(3):
        _retain(ledger, f"r{n}", f"t/s{n}", SYSTEM + (n * 10, n * 10 + 1))
    assert ledger.worker("w0") == Holdings(0, 10) and ledger.tenant("t") == Holdings(0, 10)
    # One session's retain ends: the shared blocks stay held by the others.
    ledger.released("r0", 0)
    assert ledger.worker("w0") == Holdings(0, 8)
    ledger.released("r1", 0)
    ledger.released("r2", 0)
    assert ledger.worker("w0") == Holdings() and ledger.tenant("t") == Holdings()


def test_a_pinned_block_counts_as_pinned_not_also_as_retained() -> None:
    ledger = HoldingsLedger()
    _retain(ledger, "r1", "t/a", SYSTEM + (1,))
    _retain(ledger, "p1", "t/b", SYSTEM + (2, 3), action_type="kv.pin")
    assert ledger.worker("w0") == Holdings(6, 1)
    ledger.released("p1", 0)  # the retain still holds the system prompt
    assert ledger.worker("w0") == Holdings(0, 5)


def test_blocks_the_ledger_cannot_name_count_as_the_holdings_own() -> None:
    ledger = HoldingsLedger()
    # 6 blocks, of which the router knows the first 5 (the prompt; the 6th is output).
    _retain(ledger, "r1", "t/a", SYSTEM + (1,), blocks=6)
    _retain(ledger, "r2", "t/b", SYSTEM + (2,), blocks=6)
    _retain(ledger, "r3", "t/c", (), blocks=3)  # restored after a restart: nothing named
    assert ledger.worker("w0") == Holdings(0, 4 + 2 * 2 + 3)


def test_a_clipped_or_released_holding_keeps_its_root_most_blocks() -> None:
    ledger = HoldingsLedger()
    _retain(ledger, "r1", "t/a", SYSTEM + (1, 2))
    _retain(ledger, "r2", "t/b", SYSTEM + (3, 4))
    assert ledger.worker("w0") == Holdings(0, 8)
    # Clipped to 5: the system prompt and block 3 (the worker keeps root-most blocks).
    ledger.settle(HintOutcome(message_id="m", action_id="r2", action_type="kv.retain",
                              worker_id="w0",
                              status=OutcomeStatus.CLIPPED, reason="budget",
                              requested=Amount(blocks=6), applied=Amount(blocks=5), at=1.0))
    assert ledger.worker("w0") == Holdings(0, 7)
    ledger.released("r1", 2)  # displaced leaf first: two system blocks left
    assert ledger.worker("w0") == Holdings(0, 5)


def test_tenants_count_their_own_holdings_and_workers_their_own_blocks() -> None:
    ledger = HoldingsLedger()
    _retain(ledger, "r1", "a/s", SYSTEM, tenant="a")
    _retain(ledger, "r2", "b/s", SYSTEM, tenant="b")  # the same blocks, another tenant
    _retain(ledger, "r3", "a/t", SYSTEM, tenant="a", worker="w1")  # same hashes, other pool
    assert ledger.worker("w0") == Holdings(0, 4) and ledger.worker("w1") == Holdings(0, 4)
    assert ledger.tenant("a") == Holdings(0, 8) and ledger.tenant("b") == Holdings(0, 4)
    assert ledger.forget_worker("w0") == 2
    assert ledger.tenant("a") == Holdings(0, 4) and ledger.tenant("b") == Holdings()


def test_target_keys_name_the_blocks_a_target_covers() -> None:
    chain = (1, 2, 3, 4, 5)
    by_hashes = {"target": {"block_hashes": [7, 8]}, "priority": 50, "ttl_s": 10.0}
    assert target_keys("kv.retain", by_hashes, 16, chain) == (7, 8)
    prefix = {"target": {"session_id": "t/s", "prefix_tokens": 3 * 16 + 5}, "ttl_s": 10.0}
    assert target_keys("kv.pin", prefix, 16, chain) == (1, 2, 3)
    whole = {"target": {"session_id": "t/s"}, "priority": 50, "ttl_s": 10.0}
    assert target_keys("kv.retain", whole, 16, chain) == chain
    assert target_keys("kv.retain", whole, 16, ()) == ()  # the chain is not known
    assert target_keys("kv.demote", whole, 16, chain) == ()  # holds nothing
