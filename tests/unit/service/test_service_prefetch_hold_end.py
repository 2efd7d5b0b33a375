"""When a Prefetch's holding ends in the router: its worker retains what it applied from
its answer (the blocks in G1 then) until its deadline, the retain clipped to the worker's
``max_retain_ttl_s`` from then (engine_plugin/prefetch.py ``_retain_until``,
executor._retain). Before the answer the deadline bounds it; at the answer the ledger's
holding and the row's ``expires_at`` end at ``min(deadline, answer + max_retain_ttl_s)``.

Before, the holding was clipped to ``max_retain_ttl_s`` from the send (held_for_s): a
Prefetch whose blocks came later than that was dropped at its answer (past its
``expires_at``) while the worker retained them for up to ``max_retain_ttl_s`` more, and
the budgets believed that room free; a restart did not read it back either.

The real dispatcher, ledger and rows, the router's clock injected."""

from __future__ import annotations

import time

from kvhint.router.policy import Holdings, HoldingsLedger, PlannerConfig
from kvhint.router.service.hint_api_actions import held_for_s
from kvhint.router.service.hint_dispatch import HintDispatcher, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.legacy_rows import with_derived_columns
from kvhint.schemas import (
    Amount,
    Budgets,
    HintOutcome,
    KvHintAction,
    OutcomeStatus,
    Subjects,
    Usage,
    WorkerStatus,
    parse_action,
)

MAX_RETAIN = 300.0
DEADLINE = 1000.0
BUDGETS = Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                  max_retain_ttl_s=MAX_RETAIN)
PAYLOAD = {"target": {"block_hashes": [1, 2]}, "deadline_s": DEADLINE}


def _dispatcher(now: list[float]) -> HintDispatcher:
    registry = WorkerRegistry([("w0", "http://w0")])
    registry.on_heartbeat(WorkerStatus(
        worker_id="w0", epoch="e1", model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions={"kv.prefetch": ["1.0", "1.2"]}, budgets=BUDGETS,
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time()))
    return HintDispatcher(None, Subjects("t"), registry, None, RouterMetrics(),
                          PlannerConfig(), seed=1, clock=lambda: now[0])


def _answer(status: OutcomeStatus, applied: int) -> HintOutcome:
    return HintOutcome(message_id="m", action_id="kva-p", action_type="kv.prefetch",
                       worker_id="w0", status=status, requested=Amount(2),
                       applied=Amount(applied), at=0.0)


def test_a_prefetch_answered_late_holds_until_its_retain_ends() -> None:
    sent = 1_000_000.0
    now = [sent]
    hints = _dispatcher(now)
    parsed = parse_action(KvHintAction("kva-p", "kv.prefetch", "1.0", PAYLOAD))
    # Sent through the API (its end as sessions_api computes it), waiting on the worker.
    row = SentAction(action_id="kva-p", message_id="m", worker_id="w0", tenant="default",
                     session_id="s1", action_type="kv.prefetch", source="api",
                     trigger="api", payload=PAYLOAD, status="deferred", created_at=sent,
                     updated_at=sent, requested_blocks=2, scope="default/s1",
                     expires_at=sent + held_for_s(parsed.payload, BUDGETS)).row()
    hints.restore([], [row])
    ledger = hints.holdings
    # Its blocks come 400 s on (past max_retain_ttl_s from the send): the worker retains
    # them until 700 s (400 + 300), its deadline being 1000 s.
    now[0] = sent + 400
    hints.expire(now[0])
    record = hints.on_outcome(_answer(OutcomeStatus.ACCEPTED, 2))
    assert record is not None and record.status == "accepted"
    assert "kva-p" in ledger and ledger.worker("w0") == Holdings(0, 2)  # before: dropped
    assert record.expires_at == sent + 400 + MAX_RETAIN
    ledger.expire(sent + 699)
    assert "kva-p" in ledger
    ledger.expire(sent + 701)
    assert "kva-p" not in ledger and ledger.worker("w0") == Holdings()
    # A restart meanwhile reads it back from its row until then, no longer.
    for at, held in ((sent + 650, Holdings(0, 2)), (sent + 701, Holdings())):
        again = _dispatcher([at])
        stored = record.row()
        if stored["expires_at"] > at:  # the store's read of held rows (reader.py)
            again.restore([], [], [stored])
        assert again.holdings.worker("w0") == held


def test_a_prefetch_answered_at_once_holds_no_longer_than_the_retain_maximum() -> None:
    """Already in G1 at the send: retained from then, ``max_retain_ttl_s`` at most (not
    until its 1000 s deadline)."""
    now = [1_000_000.0]
    ledger = HoldingsLedger()
    ledger.record(action_id="kva-p", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.prefetch", blocks=2, expires_at=now[0] + DEADLINE,
                  keys=(1, 2))
    ledger.settle(_answer(OutcomeStatus.ACCEPTED, 2), now[0] + 1, MAX_RETAIN)
    assert ledger.expire(now[0] + MAX_RETAIN) == 0
    assert ledger.expire(now[0] + MAX_RETAIN + 1) == 1


def test_a_legacy_row_of_an_answered_prefetch_ends_as_the_router_ends_it_now() -> None:
    """A row written without ``expires_at``: its deadline while it waits; answered, at most
    ``max_retain_ttl_s`` past its answer (``updated_at``)."""
    sent = 1_000_000.0
    base = SentAction(action_id="kva-p", message_id="m", worker_id="w0", tenant="t",
                      session_id="s", action_type="kv.prefetch", source="api",
                      trigger="api", payload=PAYLOAD, status="deferred", created_at=sent,
                      updated_at=sent).row() | {"scope": None, "expires_at": None}
    assert with_derived_columns(base, BUDGETS)["expires_at"] == sent + DEADLINE
    answered = base | {"status": "accepted", "updated_at": sent + 400}
    assert with_derived_columns(answered, BUDGETS)["expires_at"] == sent + 700
    assert with_derived_columns(answered, None)["expires_at"] == sent + DEADLINE
