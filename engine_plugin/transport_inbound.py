"""The answers the NATS transport gives inbound messages itself, on its own thread:
``rejected`` for advice that cannot be decoded and for hints and advice that find the
engine's inbox full, a refusal (``SnapshotRefused``) for a snapshot request that finds
it full, early ``deferred`` for a message the engine has not taken in time.

Every outcome is queued in the mailbox and counted in the transport's ``outcomes`` (under the
mailbox's lock), which ``kvhint:hints_total`` adds to the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvhint.engine_plugin.inbound_checks import INTERNAL_ERROR_REASON, decode_hints_safely
from kvhint.engine_plugin.mailbox import (
    Inbound,
    Mailbox,
    SnapshotOut,
    answer_key,
    peek_advice_id,
)
from kvhint.engine_plugin.outcome_counts import counted_action_type
from kvhint.engine_plugin.transport_counters import TransportCounters, note_internal_error
from kvhint.schemas import (
    DONOR_ACTION_TYPE,
    REJECTED_INBOX_FULL,
    DecodedHints,
    DonorAdvice,
    HintOutcome,
    OutcomeStatus,
    ParsedAction,
    decode_advice,
)
from kvhint.schemas._codec import WireDecodeError

# The reason of a hint the full inbox turned away (transient: the router may retry it).
FULL_INBOX_REASON = (REJECTED_INBOX_FULL
                     + " ({limit} messages waiting for the scheduler); not applied")
# The error a snapshot request the full inbox turned away is answered (retry soon).
FULL_SNAPSHOT_REASON = (REJECTED_INBOX_FULL
                        + " ({limit} messages waiting for the scheduler); no snapshot "
                          "taken, ask again")


def count_answers(mailbox: Mailbox, counters: TransportCounters,
                  outcomes: Sequence[HintOutcome]) -> None:
    with mailbox.lock:
        counters.outcomes.update((counted_action_type(o.action_type), o.status.value)
                                 for o in outcomes)


def decoder_failed(counters: TransportCounters, exc: Exception) -> None:
    """A decoder raised what it should have answered (a bug): counted with the
    publisher's (kvhint:internal_errors), logged with its traceback the first time."""
    note_internal_error(counters, "a decoder failed on an inbound message; it is answered "
                                  "rejected", exc)


def decode_advice_or_reject(data: bytes, mailbox: Mailbox, counters: TransportCounters,
                            worker_id: str) -> DonorAdvice | None:
    """``data`` decoded for the engine, or None when it was answered ``rejected`` here
    (nothing for the engine to do; a corrected retry under the same id is applied). The
    engine checks the rest (namespace, number of hashes, residency)."""
    try:
        return decode_advice(data)
    except WireDecodeError as exc:
        reason = str(exc)
    except Exception as exc:  # the decoder's bug must not cost the advice its answer
        decoder_failed(counters, exc)
        reason = INTERNAL_ERROR_REASON
    advice_id = peek_advice_id(data)
    outcome = HintOutcome(message_id=advice_id, action_id=advice_id,
                          action_type=DONOR_ACTION_TYPE, worker_id=worker_id,
                          status=OutcomeStatus.REJECTED, reason=reason, at=time.time())
    mailbox.put_outcomes([outcome], remember=False)
    count_answers(mailbox, counters, [outcome])
    return None


def answer_full_inbox(mailbox: Mailbox, counters: TransportCounters, worker_id: str,
                      decoded: DecodedHints) -> None:
    """The inbox is full: reject the message's new actions (transient: the router
    may retry them). A repeat of an action already answered gets that outcome again
    and one still queued or being applied gets nothing new (its own outcome
    follows), so no answer for an id contradicts another."""
    sorted_ids = mailbox.repeat_answers([a.action_id for a in decoded.actions])
    if sorted_ids.again:
        mailbox.put_outcomes(sorted_ids.again)
    counters.repeats_answered_again += len(sorted_ids.again)
    counters.repeats_in_flight += len(sorted_ids.in_flight)
    new = set(sorted_ids.new)
    targets = [(a.action_id, getattr(a.action_type, "value", a.action_type))
               for a in decoded.actions if a.action_id in new]
    if not decoded.actions:
        targets = [("", "")]
    if not targets:
        return
    reason = FULL_INBOX_REASON.format(limit=mailbox.inbound_limit)
    outcomes = [HintOutcome(message_id=decoded.message_id, action_id=action_id,
                            action_type=action_type, worker_id=worker_id,
                            status=OutcomeStatus.REJECTED, reason=reason, at=time.time())
                for action_id, action_type in targets]
    mailbox.put_outcomes(outcomes, remember=False)
    count_answers(mailbox, counters, outcomes)


def answer_full_inbox_advice(mailbox: Mailbox, counters: TransportCounters, worker_id: str,
                             advice: DonorAdvice) -> None:
    """The inbox is full: answer the advice ``rejected`` (transient: a retry under the same
    id is applied), counted, as a hints message's actions are; a repeat of an advice
    already answered gets that outcome again, and one still queued nothing new (its own
    outcome follows). Before, the advice was only counted (``inbound_dropped``): its
    sender never heard of it, against "one terminal outcome per action"."""
    sorted_ids = mailbox.repeat_answers([answer_key(advice.advice_id, DONOR_ACTION_TYPE)]
                                        if advice.advice_id else [""])
    if sorted_ids.again:
        mailbox.put_outcomes(sorted_ids.again, advice=True)
    counters.repeats_answered_again += len(sorted_ids.again)
    counters.repeats_in_flight += len(sorted_ids.in_flight)
    if not sorted_ids.new:
        return
    outcome = HintOutcome(message_id=advice.advice_id, action_id=advice.advice_id,
                          action_type=DONOR_ACTION_TYPE, worker_id=worker_id,
                          status=OutcomeStatus.REJECTED,
                          reason=FULL_INBOX_REASON.format(limit=mailbox.inbound_limit),
                          at=time.time())
    mailbox.put_outcomes([outcome], remember=False)
    count_answers(mailbox, counters, [outcome])


def busy_snapshot(mailbox: Mailbox, reply_to: str | None) -> SnapshotOut:
    """The answer to a snapshot request the full inbox turned away: a refusal
    (``SnapshotRefused``, as for a request the engine failed on), sent at once; the router
    counts it refused and asks again soon (``snapshot_retry_s``, doubled for each failure
    in a row, up to its ``snapshot_retry_max_s``), not after its whole snapshot timeout."""
    return SnapshotOut(0, [], [], reply_to, -1, 0,
                       error=FULL_SNAPSHOT_REASON.format(limit=mailbox.inbound_limit))


def deferred_outcomes(item: Inbound, worker_id: str, defer_after_s: float
                      ) -> list[HintOutcome]:
    """``deferred`` for each action of ``item`` (hints or advice; the transport decoded
    it when it came, but one posted otherwise is decoded here): the engine has not taken
    it within ``defer_after_s``."""
    reason = (f"not applied yet: the engine has not reached its next scheduler step "
              f"within {defer_after_s:g}s; the final outcome follows")
    now = time.time()
    if item.kind == "advice":
        advice_id = (item.decoded.advice_id if isinstance(item.decoded, DonorAdvice)
                     else peek_advice_id(item.data))
        return [HintOutcome(message_id=advice_id, action_id=advice_id,
                            action_type=DONOR_ACTION_TYPE, worker_id=worker_id,
                            status=OutcomeStatus.DEFERRED, reason=reason, at=now)]
    decoded = item.decoded if item.decoded is not None else decode_hints_safely(item.data)[0]
    return [HintOutcome(message_id=decoded.message_id, action_id=a.action_id,
                        action_type=a.action_type.value, worker_id=worker_id,
                        status=OutcomeStatus.DEFERRED, reason=reason, at=now)
            for a in decoded.actions if isinstance(a, ParsedAction)]
