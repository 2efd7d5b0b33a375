"""The session list of a paged snapshot, with a real NATS server and vLLM's real scheduler.

A prefix-cache hit moves a session in the plugin's index (its frontier, and its place in the
session list, which is least recently used first) but publishes no event, so no new
sequence number: two copies of the index taken at one ``seq`` hold the same blocks but may
list the sessions differently. Pages of one snapshot are named by ``seq`` alone
(``SnapshotRequest.seq``); every page at one ``seq`` must come from one copy, or a router
paging through the session list reads part of it from one copy and part from another, and
a session falls between the two (or is read twice). The router's view here is its real
``snapshot_to_event`` and ``InMemoryClusterKvIndex``.
"""

from __future__ import annotations

import asyncio

import pytest

from kvhint.router.kv_index import InMemoryClusterKvIndex, snapshot_to_event
from kvhint.schemas import (
    SnapshotRequest,
    Subjects,
    WorkerSnapshot,
    decode_snapshot,
    encode_snapshot_request,
)
from scheduler_fixtures import nats_client, step_until, turn, until
from scheduler_fixtures import nats_plugin as plugin


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


def _placements(pages: list[WorkerSnapshot]) -> dict[str, tuple[int, ...]]:
    """session -> frontiers on w0 in a router index resynced from ``pages``."""
    index = InMemoryClusterKvIndex()
    index.apply(snapshot_to_event(pages))
    return {sid: placements["w0"] for sid, placements in index.export_state().sessions.items()}


async def test_a_router_starting_its_paging_after_a_cache_hit_reads_every_session_once(
        nats_url: str, subject_prefix: str) -> None:
    """Router A takes the first page of a snapshot; a turn then hits the cache (no event,
    the seq stays) and router B starts its own paging at that seq. Before, B's first page
    came from a new copy (session "a" moved last by the hit) and its later pages from the
    copy kept for A: B read "b" twice and never "a", so its resynced view had no placement
    for "a" on w0 (and "b"'s frontier twice). Every page of one seq now comes from the copy
    kept for it, the session list included."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:

        async def page(h, request: SnapshotRequest) -> WorkerSnapshot:  # noqa: ANN001
            reply = asyncio.ensure_future(nc.request(
                subjects.snapshot("w0"), encode_snapshot_request(request), timeout=5))
            await step_until(h, reply.done)
            return decode_snapshot((await reply).data)

        async def rest(h, first: WorkerSnapshot, limit: int) -> list[WorkerSnapshot]:  # noqa: ANN001
            pages = [first]
            while pages[-1].next_cursor is not None:
                pages.append(await page(h, SnapshotRequest(
                    cursor=pages[-1].next_cursor, limit=limit, seq=first.seq)))
            return pages

        with plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            await until(lambda: h.connector.transport.set_up)
            core = h.connector.core
            turn(h, "a", [1, 2, 3])
            turn(h, "b", [7, 8])
            turn(h, "c", [20])  # 6 blocks, then sessions a, b, c
            live = dict(core.index.snapshot_sessions())
            first_a = await page(h, SnapshotRequest(limit=3))  # blocks only
            seq = core.event_seq
            turn(h, "a", [1, 2, 3])  # all cached: a hit, no event
            assert core.event_seq == seq
            assert [sid for sid, _ in core.index.snapshot_sessions()] == ["b", "c", "a"]
            # B: all 6 blocks and the first session on its first page, the rest after.
            first_b = await page(h, SnapshotRequest(limit=7))
            pages_b = await rest(h, first_b, 3)
            pages_a = await rest(h, first_a, 3)
            assert {p.seq for p in pages_a + pages_b} == {seq}
            sessions_b = [s.session_id for p in pages_b for s in p.sessions]
            assert sorted(sessions_b) == ["a", "b", "c"]
            # Both routers resync to the same view: the copy the pages at seq came from.
            assert _placements(pages_b) == _placements(pages_a)
            assert _placements(pages_b) == {sid: tuple(f) for sid, f in live.items()}
