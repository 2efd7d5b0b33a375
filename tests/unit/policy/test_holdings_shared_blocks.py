"""The holdings ledger counts a block under several holdings once, as the worker does."""

from __future__ import annotations

import random

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


def test_the_running_counts_equal_a_recount_of_the_live_holdings() -> None:
    """Random records (re-protections that extend or cut a chain, other types, other
    tenants), clips, releases and restarts: the ledger's running totals always equal a
    count from scratch of the blocks its live holdings cover."""
    rng = random.Random(7)
    chains = [tuple(range(1000 * c, 1000 * c + 30)) for c in range(3)]  # 3 prompts
    ledger = HoldingsLedger()
    live: dict[str, tuple[str, str, str, str, int, tuple[int, ...]]] = {}  # the oracle

    def recount(owner_of: int, owner: str) -> Holdings:
        states: dict[tuple[str, int], int] = {}
        own = [0, 0]
        for held in live.values():
            if held[owner_of] != owner:
                continue
            worker, slot, blocks, keys = held[0], int(held[3] == "kv.retain"), held[4], held[5]
            named = keys[:blocks]
            own[slot] += blocks - len(named)
            for key in named:
                states[(worker, key)] = min(states.get((worker, key), 1), slot)
        pinned = sum(1 for s in states.values() if s == 0)
        return Holdings(pinned + own[0], len(states) - pinned + own[1])

    for step in range(3000):
        op = rng.random()
        worker, tenant = rng.choice(("w0", "w1")), rng.choice(("a", "b"))
        if op < 0.6 or not live:
            action_id, scope = f"x{step}", f"{tenant}/s{rng.randrange(6)}"
            kind = rng.choice(("kv.retain", "kv.retain", "kv.pin", "kv.demote"))
            keys = rng.choice(chains)[:rng.randrange(1, 31)]
            blocks = len(keys) + rng.choice((0, 0, 2))  # sometimes blocks past the prompt
            ledger.record(action_id=action_id, worker_id=worker, tenant=tenant, scope=scope,
                          action_type=kind, blocks=blocks, expires_at=1e12, keys=keys)
            for other, held in list(live.items()):
                if (held[0], held[2]) == (worker, scope):
                    del live[other]
            if kind != "kv.demote":
                live[action_id] = (worker, tenant, scope, kind, blocks, keys)
        elif op < 0.9:
            action_id = rng.choice(sorted(live))
            left = rng.randrange(0, live[action_id][4] + 1)
            ledger.released(action_id, left)
            if left == 0:
                del live[action_id]
            elif left < live[action_id][4]:
                live[action_id] = (*live[action_id][:4], left, live[action_id][5])
        else:
            ledger.forget_worker(worker)
            live = {k: v for k, v in live.items() if v[0] != worker}
        for w in ("w0", "w1"):
            assert ledger.worker(w) == recount(0, w), step
        for t in ("a", "b"):
            assert ledger.tenant(t) == recount(1, t), step
