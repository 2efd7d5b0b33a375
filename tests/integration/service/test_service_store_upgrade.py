"""A store upgraded from the first schema (revision 0001), on SQLite and PostgreSQL: the
Pins and Retains a 0001 router sent, whose rows have no ``scope`` / ``expires_at``, are
held again after the upgraded router's restart, until their TTL really ends.

Before, recovery read only rows with an ``expires_at``: such holdings were not restored
and the worker's and tenant's budgets were believed free of blocks the workers still
held, for up to an hour."""

from __future__ import annotations

import msgspec
import sqlalchemy as sa

from kvhint.router.policy import Holdings, PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.reader import load_recovery
from kvhint.schemas import Budgets, Subjects
from kvhint.schemas.hints import HintOwner, PinPayload, RetainPayload, Target

NOW = 1_700_000_000.0
BUDGETS = Budgets(max_pinned_blocks=100, max_pin_ttl_s=600.0, max_retained_blocks=1000,
                  max_retain_ttl_s=3600.0)


def _payload(payload: PinPayload | RetainPayload) -> dict:
    """As the router stores an action's payload: its wire form (defaults left out)."""
    return msgspec.to_builtins(payload)


def _session(session_id: str) -> Target:
    return Target(session_id=f"acme/{session_id}", prefix_tokens=64)


# (action id, type, source, status, payload, applied/requested blocks, sent before NOW)
ROWS_0001 = [
    ("pin", "kv.pin", "planner", "accepted", _payload(PinPayload(target=_session("s1"),
                                                                 ttl_s=300.0)), 4, 100.0),
    # A 60 s Pin: the wire default, so its payload has no ttl_s.
    ("pin-60", "kv.pin", "planner", "clipped", _payload(PinPayload(target=_session("s2"))),
     2, 30.0),
    ("retain", "kv.retain", "planner", "accepted",
     _payload(RetainPayload(target=_session("s3"), priority=70, ttl_s=900.0)), 3, 300.0),
    # The planner's Retain of a prefix three sessions share (found at 2 blocks).
    ("prefix", "kv.retain", "planner", "accepted",
     _payload(RetainPayload(target=Target(block_hashes=[11, 12, 13]), priority=80,
                            ttl_s=600.0)), 3, 60.0),
    # An agent's Retain without TTL: held for the worker's maximum (an hour); its Pin of
    # 900 s for the worker's (600 s).
    ("agent", "kv.retain", "api", "accepted",
     _payload(RetainPayload(target=Target(session_id="acme/s1"), owner=HintOwner.AGENT)),
     5, 10.0),
    ("agent-pin", "kv.pin", "api", "accepted",
     _payload(PinPayload(target=Target(session_id="acme/s2"), ttl_s=900.0,
                         owner=HintOwner.AGENT)), 1, 20.0),
    ("over", "kv.pin", "planner", "accepted", _payload(PinPayload(target=_session("s5"))),
     7, 120.0),  # its 60 s ended before NOW
    ("waiting", "kv.retain", "planner", "pending",
     _payload(RetainPayload(target=_session("s4"), priority=60, ttl_s=120.0)), 6, 5.0),
]


def _store_as_0001(engine: sa.Engine) -> None:
    """What a 0001 router left: its worker's last heartbeat, and its actions' rows, in
    the table as revision 0001 made it."""
    table = sa.Table("hint_actions", sa.MetaData(), autoload_with=engine)
    assert "scope" not in table.c and "expires_at" not in table.c
    workers = sa.Table("workers", sa.MetaData(), autoload_with=engine)
    with engine.begin() as conn:
        conn.execute(workers.insert().values(
            worker_id="w0", url="http://w0", from_config=True, epoch="e1", last_seen=NOW - 1,
            status={"worker_id": "w0", "budgets": msgspec.to_builtins(BUDGETS)}))
        for action_id, type_, source, status, payload, blocks, ago in ROWS_0001:
            answered = status != "pending"
            conn.execute(table.insert().values(
                action_id=action_id, message_id="m1", tenant="acme",
                session_id=None if action_id == "prefix" else "s1", worker_id="w0",
                action_type=type_, source=source, trigger="test", payload=payload,
                status=status, reason="", requested_blocks=blocks, requested_tokens=0,
                applied_blocks=blocks if answered else 0, applied_tokens=0,
                created_at=NOW - ago, updated_at=NOW - ago))


def test_holds_a_0001_router_sent_count_until_their_ttl_ends(database_url: str) -> None:
    engine = create_store_engine(database_url)
    try:
        migrate(engine, "0001")
        _store_as_0001(engine)
        migrate(engine)
        state = load_recovery(engine, active_since=0.0, max_sessions=10, now=NOW)
        held = {row["action_id"]: (row["scope"], row["expires_at"])
                for row in state.held_actions}
        assert held == {
            "pin": ("acme/s1", NOW + 200.0),
            "pin-60": ("acme/s2", NOW + 30.0),
            "retain": ("acme/s3", NOW + 600.0),
            "prefix": (f"prefix:acme:{12:016x}", NOW + 540.0),
            "agent": ("agent:acme/s1", NOW + 3590.0),
            "agent-pin": ("agent:acme/s2", NOW + 580.0),
        }
        assert [row["action_id"] for row in state.held_actions] == [
            "retain", "pin", "prefix", "pin-60", "agent-pin", "agent"]  # oldest first
        (waiting,) = state.pending_actions
        assert (waiting["scope"], waiting["expires_at"]) == ("acme/s4", NOW + 115.0)

        hints = HintDispatcher(None, Subjects("t"), WorkerRegistry([("w0", "http://w0")]),
                               None, RouterMetrics(), PlannerConfig(), seed=1,
                               tenants=("acme",), clock=lambda: NOW)
        hints.restore(state.learned, state.pending_actions, state.held_actions)
        holdings = hints.holdings
        expected = [  # (at, pinned, retained): what is still held then
            (NOW, 4 + 2 + 1, 3 + 3 + 5 + 6),
            (NOW + 30.0, 4 + 1, 3 + 3 + 5 + 6),  # the 60 s Pin's TTL ended
            (NOW + 115.0, 4 + 1, 3 + 3 + 5),  # the pending Retain, held at what it asked
            (NOW + 199.0, 4 + 1, 3 + 3 + 5),
            (NOW + 200.0, 1, 3 + 3 + 5),  # the 300 s Pin
            (NOW + 540.0, 1, 3 + 5),  # the prefix's Retain
            (NOW + 580.0, 0, 3 + 5),  # the agent's Pin
            (NOW + 600.0, 0, 5),  # the 900 s Retain
            (NOW + 3589.0, 0, 5),
            (NOW + 3590.0, 0, 0),  # the agent's Retain
        ]
        for at, pinned, retained in expected:
            holdings.expire(at)
            assert holdings.worker("w0") == Holdings(pinned, retained), at - NOW
            assert holdings.tenant("acme") == Holdings(pinned, retained), at - NOW
        assert len(holdings) == 0
    finally:
        engine.dispose()


def test_stored_values_win_and_an_unreadable_payload_derives_nothing(
        database_url: str) -> None:
    """A row that has ``scope`` / ``expires_at`` keeps them (derivation only fills what
    is missing); a payload that does not parse derives nothing, and its row is not
    restored as a holding (as before)."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        table = sa.Table("hint_actions", sa.MetaData(), autoload_with=engine)
        workers = sa.Table("workers", sa.MetaData(), autoload_with=engine)
        with engine.begin() as conn:  # an action's row needs its worker's (0003)
            conn.execute(workers.insert().values(worker_id="w0", from_config=True))
        pin = _payload(PinPayload(target=_session("s1"), ttl_s=300.0))
        base = {"message_id": "m1", "tenant": "acme", "session_id": "s1", "worker_id": "w0",
                "action_type": "kv.pin", "source": "planner", "trigger": "test",
                "status": "accepted", "reason": "", "requested_blocks": 4,
                "requested_tokens": 0, "applied_blocks": 4, "applied_tokens": 0}
        with engine.begin() as conn:
            for row in (
                    {"action_id": "stored", "payload": pin, "scope": "kept",
                     "expires_at": NOW + 5.0, "created_at": NOW - 10, "updated_at": NOW},
                    {"action_id": "unreadable", "payload": {"ttl_s": 300.0},
                     "created_at": NOW - 10, "updated_at": NOW - 10}):
                conn.execute(table.insert().values(base | row))
        state = load_recovery(engine, active_since=0.0, max_sessions=10, now=NOW)
        assert [(r["action_id"], r["scope"], r["expires_at"]) for r in state.held_actions] \
            == [("stored", "kept", NOW + 5.0)]
    finally:
        engine.dispose()
