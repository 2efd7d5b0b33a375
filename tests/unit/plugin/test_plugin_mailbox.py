"""The scheduler -> transport boundary drops only what does not fit, oldest first, and
counts it."""

from __future__ import annotations

from kvhint.engine_plugin.mailbox import Mailbox
from kvhint.schemas import Amount, HoldRelease, HoldsReleased, ReleaseReason


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
