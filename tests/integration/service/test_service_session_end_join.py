"""Ends of one session that come while another is still sending (router/service/lifecycle.py
``SessionLifecycle.end``), against a NATS server this test owns, the real router app and
two workers whose plugins this test plays (test_service_hint_publish_faults.py's fleet).

No fake: the end's publish awaits for real. The server is frozen (SIGSTOP) and the
router's connection filled until every publish waits on its flush; the first DELETE's
releases are then recorded and waiting, and the other ends come meanwhile."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from conftest import StubWorker
from feed_helpers import until
from kvhint.router.devstack.nats_server import NatsServerProcess
import test_service_hint_publish_faults as faults
from test_service_hint_publish_faults import (
    WORKERS,
    _claim,
    _flush_blocked,
    _recorded,
    _signal,
    _turn,
    fleet,
)

nats_own = faults.nats_own  # the fixture: a NATS server this test freezes
RELEASE = "end:agent_release"


async def test_ends_that_come_while_one_sends_join_it_and_send_nothing_more(
        tmp_path: Path, nats_own: NatsServerProcess,
        stub_workers: list[StubWorker]) -> None:
    """The session's agent holds claims on w0 and w1. A DELETE ends it while NATS cannot
    take its releases; a second DELETE and an admin's end come while it waits. All three
    answer 200, the later two with what the first sent, and the workers get one release
    each. Before, each later end ran the end again (the planner's end had not yet marked
    the session's plan ended): a second set of releases went out, and the planner's end
    after them."""
    async with fleet(tmp_path, nats_own, stub_workers) as (router, client, plugins):
        url, runtime = router.url, router.runtime
        await _turn(client, url, "s")
        for worker in WORKERS:
            claimed = await client.post(f"{url}/v1/sessions/s/hints", json=_claim(worker, 5))
            assert claimed.status_code == 200, claimed.text
            assert claimed.json()["actions"][0]["status"] == "accepted"
        before = {w: len(plugins.received[w]) for w in WORKERS}
        _signal(nats_own, signal.SIGSTOP)
        try:
            junk = await _flush_blocked(runtime)
            first = asyncio.create_task(client.delete(f"{url}/v1/sessions/s"))
            await until(lambda: _recorded(runtime, "w0", trigger=RELEASE) is not None)
            second = asyncio.create_task(client.delete(f"{url}/v1/sessions/s"))
            by_admin = asyncio.create_task(client.post(  # dev mode: no key
                f"{url}/admin/sessions/default/s/end", headers={"x-kvhint-request": "1"}))
            await asyncio.sleep(0.3)  # the later ends as far as they go while frozen
            assert not first.done()  # still publishing: the later ends came meanwhile
        finally:
            _signal(nats_own, signal.SIGCONT)
        answers = await asyncio.gather(first, second, by_admin)
        await asyncio.gather(*junk)
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["state"] == "ended"
        hints = answers[0].json()["hints"]
        sent = sorted(h["action_id"] for h in hints)
        assert sorted(h["worker_id"] for h in hints if h["trigger"] == RELEASE) == ["w0", "w1"]
        await until(lambda: set(sent) <= {a for w in WORKERS for a in plugins.received[w]})
        await asyncio.sleep(0.5)  # time for any more to arrive
        received = sorted(a for w in WORKERS for a in plugins.received[w][before[w]:])
        assert received == sent
        assert sorted(h["action_id"] for h in answers[1].json()["hints"]) == sent
        record = runtime.sessions.get("default", "s")
        assert record.plan.ended and record.plan.ended_explicitly
        # Ended again once done: nothing is held any more, so nothing is sent.
        again = await client.delete(f"{url}/v1/sessions/s")
        assert again.status_code == 200 and again.json()["hints"] == [], again.text
