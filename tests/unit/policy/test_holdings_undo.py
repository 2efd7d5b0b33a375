"""An action recorded before its publish (``tentative``) and then never published: the
ledger goes back to what the worker still holds (router/service/hint_send.py records
first, so that whatever comes while a publish awaits finds the action)."""

from __future__ import annotations

from kvhint.router.policy import Holdings, HoldingsLedger

NOW = 10.0


def _record(ledger: HoldingsLedger, action_id: str, keys: tuple[int, ...],
            action_type: str = "kv.retain", scope: str = "t/s", tentative: bool = True,
            expires_at: float = 100.0, worker: str = "w0") -> None:
    ledger.record(action_id=action_id, worker_id=worker, tenant="t", scope=scope,
                  action_type=action_type, blocks=len(keys), expires_at=expires_at,
                  keys=keys, tentative=tentative)


def _holder(ledger: HoldingsLedger) -> list[str]:
    return [a for a in ("old", "new", "newer") if a in ledger]


def test_an_undone_action_gives_the_scope_back_to_what_it_superseded() -> None:
    ledger = HoldingsLedger()
    _record(ledger, "old", (1, 2, 3), tentative=False)
    _record(ledger, "new", (1, 2, 3, 4, 5), action_type="kv.pin")  # the chain grew
    assert _holder(ledger) == ["new"] and ledger.tenant("t") == Holdings(5, 0)
    ledger.undo("new", NOW)
    assert _holder(ledger) == ["old"]
    assert ledger.tenant("t") == ledger.worker("w0") == Holdings(0, 3)
    ledger.undo("new", NOW)  # once only
    assert ledger.worker("w0") == Holdings(0, 3)


def test_a_confirmed_action_stands_and_cannot_be_undone() -> None:
    ledger = HoldingsLedger()
    _record(ledger, "old", (1, 2), tentative=False)
    _record(ledger, "new", (1, 2, 3))
    ledger.confirm("new")
    ledger.undo("new", NOW)
    assert _holder(ledger) == ["new"] and ledger.worker("w0") == Holdings(0, 3)


def test_an_undone_demote_gives_the_holding_back() -> None:
    ledger = HoldingsLedger()
    _record(ledger, "old", (1, 2), tentative=False)
    ledger.record(action_id="demote", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.demote", blocks=0, expires_at=NOW, tentative=True)
    assert _holder(ledger) == [] and ledger.worker("w0") == Holdings()
    ledger.undo("demote", NOW)
    assert _holder(ledger) == ["old"] and ledger.worker("w0") == Holdings(0, 2)


def test_a_newer_action_in_flight_inherits_what_the_undone_one_replaced() -> None:
    # old (held by the worker) <- new (in flight) <- newer (in flight): new fails, then
    # newer fails too: the worker still holds old.
    ledger = HoldingsLedger()
    _record(ledger, "old", (1, 2), tentative=False)
    _record(ledger, "new", (1, 2, 3))
    _record(ledger, "newer", (1, 2, 3, 4))
    ledger.undo("new", NOW)
    assert _holder(ledger) == ["newer"] and ledger.worker("w0") == Holdings(0, 4)
    ledger.undo("newer", NOW)
    assert _holder(ledger) == ["old"] and ledger.worker("w0") == Holdings(0, 2)


def test_an_action_recorded_after_an_undone_demote_inherits_the_holding() -> None:
    ledger = HoldingsLedger()
    _record(ledger, "old", (1, 2), tentative=False)
    ledger.record(action_id="demote", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.demote", blocks=0, expires_at=NOW, tentative=True)
    _record(ledger, "new", (1, 2, 3))
    ledger.undo("demote", NOW)
    assert _holder(ledger) == ["new"]  # newer than the demote: it stands
    ledger.undo("new", NOW)
    assert _holder(ledger) == ["old"] and ledger.worker("w0") == Holdings(0, 2)


def test_nothing_comes_back_that_is_over_or_was_superseded_by_a_sent_action() -> None:
    ledger = HoldingsLedger()
    # The superseded holding's TTL ended meanwhile.
    _record(ledger, "old", (1,), tentative=False, expires_at=NOW)
    _record(ledger, "new", (1, 2))
    ledger.undo("new", NOW)
    assert _holder(ledger) == [] and ledger.worker("w0") == Holdings()
    # Its worker restarted meanwhile (the engine holds nothing).
    _record(ledger, "old", (1,), tentative=False)
    _record(ledger, "new", (1, 2))
    ledger.forget_worker("w0")
    ledger.undo("new", NOW)
    assert _holder(ledger) == [] and ledger.worker("w0") == Holdings()
    # A newer action, published, superseded the undone one: it stands.
    _record(ledger, "old", (1,), tentative=False)
    _record(ledger, "new", (1, 2))
    _record(ledger, "newer", (1, 2, 3))
    ledger.confirm("newer")
    ledger.undo("new", NOW)
    assert _holder(ledger) == ["newer"] and ledger.worker("w0") == Holdings(0, 3)


def _demote(ledger: HoldingsLedger, action_id: str) -> None:
    ledger.record(action_id=action_id, worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.demote", blocks=0, expires_at=NOW, tentative=True)


def test_a_demote_published_after_a_failed_one_keeps_the_holding_gone() -> None:
    # old (held) <- demote (in flight, fails) <- again (a second Demote, recorded on the
    # scope the first emptied, published): the worker let old go. Before, the second was
    # not followed (nothing to supersede) and the first's undo brought old back.
    ledger = HoldingsLedger()
    _record(ledger, "old", (1, 2), tentative=False)
    _demote(ledger, "demote")
    _demote(ledger, "again")
    ledger.undo("demote", NOW)
    ledger.confirm("again")
    assert _holder(ledger) == [] and ledger.worker("w0") == Holdings()
    # The same, the second confirmed first.
    _record(ledger, "old", (1, 2), tentative=False)
    _demote(ledger, "demote2")
    _demote(ledger, "again2")
    ledger.confirm("again2")
    ledger.undo("demote2", NOW)
    assert _holder(ledger) == [] and ledger.worker("w0") == Holdings()


def test_two_demotes_that_both_fail_give_the_holding_back_in_either_order() -> None:
    for first, second in (("demote", "again"), ("again", "demote")):
        ledger = HoldingsLedger()
        _record(ledger, "old", (1, 2), tentative=False)
        _demote(ledger, "demote")
        _demote(ledger, "again")
        ledger.undo(first, NOW)
        assert _holder(ledger) == []  # the other may still be published
        ledger.undo(second, NOW)
        assert _holder(ledger) == ["old"] and ledger.worker("w0") == Holdings(0, 2)
