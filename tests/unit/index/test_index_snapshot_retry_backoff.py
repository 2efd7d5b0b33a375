"""Failed snapshot page requests in a row back off, bounded: a worker that answers "inbox
full" at once (or a NATS error) is asked again after ``snapshot_retry_s``, then twice that,
and so on up to ``snapshot_retry_max_s``; a page taken starts the delays over."""

from __future__ import annotations

from ingest_fixtures import make_paging_ingestor as make
from ingest_fixtures import page, status

from kvhint.router.kv_index import RequestSnapshot


def _retry_delays(ing, clock, failures: int) -> list[float]:  # noqa: ANN001
    """Fail each request at once; how long each retry took to come (0.25 s ticks)."""
    delays = []
    for _ in range(failures):
        assert ing.on_snapshot_failed("w0", "worker inbox full") == []
        failed_at = clock.now
        while True:
            clock.now += 0.25
            acts = ing.tick()
            if acts:
                assert [type(a) for a in acts] == [RequestSnapshot]
                break
        delays.append(clock.now - failed_at)
    return delays


def test_failures_in_a_row_are_retried_after_doubling_delays_up_to_the_bound() -> None:
    ing, _, clock = make(snapshot_retry_s=1.0, snapshot_retry_max_s=4.0)
    ing.on_status(status(last_seq=5, interval_s=100.0))  # asks for a snapshot
    assert _retry_delays(ing, clock, 5) == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert ing.stats().stream["snapshot_failures"] == 5


def test_a_page_taken_starts_the_delays_over() -> None:
    ing, _, clock = make(snapshot_retry_s=1.0, snapshot_retry_max_s=8.0)
    ing.on_status(status(last_seq=5, interval_s=100.0))
    assert _retry_delays(ing, clock, 3) == [1.0, 2.0, 4.0]
    acts = ing.on_snapshot_page(page("w0", "e1", 5, [(1, None, "GPU"), (2, 1, "GPU")],
                                     cursor_next=2), 0)
    assert acts == [RequestSnapshot("w0", 2, 2, "snapshot continues", 5)]
    assert _retry_delays(ing, clock, 2) == [1.0, 2.0]


def test_a_bound_below_the_first_delay_keeps_the_first_delay() -> None:
    ing, _, clock = make(snapshot_retry_s=2.0, snapshot_retry_max_s=0.5)
    ing.on_status(status(last_seq=5, interval_s=100.0))
    assert _retry_delays(ing, clock, 3) == [2.0, 2.0, 2.0]
