"""The scheduler -> transport boundary drops only what does not fit, oldest first, and
counts it."""

from __future__ import annotations

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.mailbox import Inbound, Mailbox, SnapshotOut
from kvhint.engine_plugin.transport import NatsTransport
from kvhint.schemas import (
    Amount,
    HintOutcome,
    HoldRelease,
    HoldsReleased,
    KvHintsEnvelope,
    OutcomeStatus,
    PinPayload,
    ReleaseReason,
    Target,
    encode_hints,
    make_action,
)


def _report(action_id: str) -> HoldsReleased:
    return HoldsReleased(worker_id="w0", at=1.0, releases=[HoldRelease(
        action_id=action_id, action_type="kv.retain", reason=ReleaseReason.DISPLACED,
        released=Amount(1, 32), held=Amount())])


def test_release_reports_past_the_buffer_drop_the_oldest_and_are_counted() -> None:
    notified = []
    mailbox = Mailbox(inbound_limit=4, outcome_limit=2, event_batch_limit=4)
    mailbox.notify_transport = lambda: notified.append(1)
    for action_id in ("a", "b", "c"):
        mailbox.put_releases(_report(action_id))
    assert [m.releases[0].action_id for m in mailbox.releases] == ["b", "c"]
    assert mailbox.counters.releases_dropped == 1
    assert len(notified) == 3


# --- early "deferred" answers (the transport thread) ---------------------------------------

def _transport(mailbox: Mailbox) -> NatsTransport:
    """A transport that is never started: its inbound handling runs without NATS."""
    return NatsTransport(PluginConfig(worker_id="w0"), "w0", "e1", mailbox,
                         lambda usage, seq: None, lambda ts, events: b"", 32)  # type: ignore[arg-type, return-value]


def _pin_hints(action_id: str) -> bytes:
    return encode_hints(KvHintsEnvelope(protocol_version="1", message_id=f"m-{action_id}",
                                        actions=[make_action(action_id, PinPayload(
                                            target=Target(session_id="s"), ttl_s=30))]))


def _waiting(action_id: str) -> Inbound:
    return Inbound("hints", _pin_hints(action_id), 0.0, None)


def test_early_deferred_answers_stay_within_the_outcome_buffer_and_drops_are_counted() -> None:
    """More messages wait than the outcome buffer holds: their early ``deferred`` answers
    fill it and the rest are dropped and counted, never queued past the bound. Before, the
    transport extended the outbound queue without any bound or count."""
    mailbox = Mailbox(inbound_limit=10, outcome_limit=2, event_batch_limit=4)
    transport = _transport(mailbox)
    for i in range(5):
        transport._defer_if_waiting(_waiting(f"d{i}"))
    assert [o.action_id for o in mailbox.outcomes] == ["d0", "d1"]
    assert all(o.status is OutcomeStatus.DEFERRED for o in mailbox.outcomes)
    assert mailbox.counters.deferred_dropped == 3
    assert mailbox.counters.outcomes_dropped == 0  # a final outcome follows each: no loss
    assert transport.counters.deferred_at_once == 2
    assert transport.counters.outcomes_seen(mailbox.lock) == {("kv.pin", "deferred"): 2}


def _answer(action_id: str, status: OutcomeStatus = OutcomeStatus.ACCEPTED) -> HintOutcome:
    return HintOutcome(message_id=f"m-{action_id}", action_id=action_id,
                       action_type="kv.pin", worker_id="w0", status=status, reason="",
                       at=1.0)


def test_only_a_final_outcome_dropped_counts_as_lost_a_deferred_one_apart() -> None:
    """kvhint:outcomes_dropped (KvhintPluginDrops fires on it) counted the early
    ``deferred`` answers dropped too, whose final outcome still follows: the alert fired
    when nothing final was lost. A deferred one dropped, early or the engine's own, now
    counts in deferred_dropped only; a final one in outcomes_dropped."""
    mailbox = Mailbox(inbound_limit=10, outcome_limit=2, event_batch_limit=4)
    transport = _transport(mailbox)
    transport._defer_if_waiting(_waiting("d0"))
    mailbox.put_outcomes([_answer("e0", OutcomeStatus.DEFERRED)])  # the engine's own
    for i in range(2):  # the buffer is full: each pushes the oldest (a deferred) out
        mailbox.put_outcomes([_answer(f"f{i}")])
    assert [o.action_id for o in mailbox.outcomes] == ["f0", "f1"]
    assert (mailbox.counters.deferred_dropped, mailbox.counters.outcomes_dropped) == (2, 0)
    with mailbox.lock:  # the transport's early deferred for a message still waiting
        assert mailbox.put_deferred([_answer("d1", OutcomeStatus.DEFERRED)]) == []
    assert (mailbox.counters.deferred_dropped, mailbox.counters.outcomes_dropped) == (3, 0)
    mailbox.put_outcomes([_answer("f2", OutcomeStatus.REJECTED)])  # f0 goes: lost
    assert [o.action_id for o in mailbox.outcomes] == ["f1", "f2"]
    assert (mailbox.counters.deferred_dropped, mailbox.counters.outcomes_dropped) == (3, 1)


def test_a_repeat_answered_longer_ago_than_the_outcome_buffer_holds_gets_no_deferred() -> None:
    """More actions were answered since a repeat's first copy than the outcome buffer
    holds: the transport still knows it was answered (for as long as the engine remembers
    actions), so no ``deferred`` follows its terminal outcome. Before, it remembered only
    the last ``outcome_limit`` ids."""
    mailbox = Mailbox(inbound_limit=10, outcome_limit=2, event_batch_limit=4)
    mailbox.answered_limit = 100  # the connector passes max_remembered_actions
    transport = _transport(mailbox)
    mailbox.put_outcomes([_answer(f"a{i}") for i in range(5)])
    mailbox.outcomes.clear()  # published
    transport._defer_if_waiting(_waiting("a0"))
    assert not mailbox.outcomes and transport.counters.deferred_at_once == 0


def test_answered_and_in_flight_ids_stay_bounded_and_forgetting_is_counted() -> None:
    mailbox = Mailbox(inbound_limit=10, outcome_limit=2, event_batch_limit=4,
                      answered_limit=3)
    for i in range(5):
        assert mailbox.post(_waiting(f"q{i}"), [f"q{i}"])
    assert list(mailbox.in_flight) == ["q2", "q3", "q4"]
    assert mailbox.counters.in_flight_forgotten == 2
    mailbox.put_outcomes([_answer(f"q{i}") for i in range(5)])
    assert list(mailbox.answered) == ["q2", "q3", "q4"] and not mailbox.in_flight
    assert mailbox.counters.answered_forgotten == 2  # kvhint:answered_ids_forgotten
    answers = mailbox.repeat_answers(["q4", "q0", "new"])
    assert [o.action_id for o in answers.again] == ["q4"] and answers.new == ["q0", "new"]


# --- snapshots kept for their later pages ----------------------------------------------------

def _snapshot(seq: int, blocks: int) -> SnapshotOut:
    raw = [(seq * 1000 + i, None, 1, None) for i in range(blocks)]
    return SnapshotOut(seq, raw, [], None, 0, 10)


def test_kept_snapshots_are_bounded_by_their_blocks_oldest_first_and_counted() -> None:
    """Kept snapshots were bounded only by count (3) and age (120 s): three copies of a
    1M-block index stayed in memory. Now their blocks in all are bounded too; the
    oldest go first (counted) and the latest always stays, or its pages could not be
    served."""
    mailbox = Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=4)
    transport = NatsTransport(PluginConfig(worker_id="w0", snapshot_keep_blocks=5), "w0",
                              "e1", mailbox, lambda usage, seq: None,  # type: ignore[arg-type, return-value]
                              lambda ts, events: b"", 32)
    transport.snapshots.keep(_snapshot(1, 2))
    transport.snapshots.keep(_snapshot(2, 3))
    assert transport.snapshots.seqs == [1, 2]
    transport.snapshots.keep(_snapshot(3, 2))  # 7 blocks: the oldest goes
    assert transport.snapshots.seqs == [2, 3]
    assert transport.counters.snapshots_dropped == 1
    assert len(transport.snapshots.keep(_snapshot(4, 9))) == 9  # alone past the bound
    assert transport.snapshots.seqs == [4]
    assert transport.counters.snapshots_dropped == 3
