"""A worker's snapshot, paged over a real NATS server, listing a session on both of its
pages (as an older plugin did when two routers paged at once: pages from two copies of
its index). Before, the router's resynced index joined the listings: the session's
placement named its frontier twice and lost a branch to the copies. Now the session is
read once with every branch, and the repeat counted
(``kvhint_router_index_ingest_total{what="adapter_snapshot_session_repeats"}``).

The "plugin" is this test answering the snapshot requests: a repeat needs pages a
current plugin no longer serves (its paging: test_plugin_snapshot_session_pages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from feed_helpers import router_hearing_nats, status, until
from kvhint.schemas import (
    SnapshotBlock,
    SnapshotSession,
    Subjects,
    WorkerSnapshot,
    decode_snapshot_request,
    encode_snapshot,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")

# cursor -> (blocks, sessions, next cursor): the session on both pages, branch 5 on both.
PAGES = {
    0: ([(1, None), (3, 1)], [("default/s", [3, 5])], 2),
    2: ([(5, 1), (6, 5)], [("default/s", [5, 6])], None),
}


async def test_a_session_listed_on_two_snapshot_pages_is_read_once(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (router, client, nc):
        runtime = router.runtime
        asked: list[int] = []

        async def answer(msg) -> None:  # noqa: ANN001
            cursor = decode_snapshot_request(msg.data).cursor
            asked.append(cursor)
            blocks, sessions, next_cursor = PAGES[cursor]
            await msg.respond(encode_snapshot(WorkerSnapshot(
                worker_id="w7", epoch="e1", seq=4, block_size=32,
                blocks=[SnapshotBlock(h, p, "GPU") for h, p in blocks],
                sessions=[SnapshotSession(sid, f) for sid, f in sessions],
                next_cursor=next_cursor)))

        await nc.subscribe(subjects.snapshot("w7"), cb=answer)
        # Heard first at seq 4: the router starts from the worker's snapshot.
        await nc.publish(subjects.status("w7"), status("w7", "e1", 4))
        await until(lambda: runtime.index.session_placements("default/s") != ())
        assert asked == [0, 2]
        (placement,) = runtime.index.session_placements("default/s")
        assert placement.frontiers == (3, 5, 6)
        assert dict(runtime.index.worker_block_counts("w7")) == {"GPU": 4}
        text = (await client.get(f"{router.url}/metrics")).text
        assert ('kvhint_router_index_ingest_total{what="adapter_snapshot_session_repeats"} '
                "1.0") in text
