"""The stored row of a session this router holds no record of, read with a bounded wait.

Replicas share the store, and each holds its own records in memory. A turn of a session
id this replica has not seen (another replica served its earlier turns: a load balancer
spreading an agent's requests, a Responses follow-up continued here; or a session this
replica forgot, evicted, or did not restore) first reads the session's row, so the turn
continues its turns, tool gap and planner state (``SessionRegistry.adopt``: the same
``SessionRecord.from_row`` the start-up restore uses) instead of starting a blank record
whose first save writes over the stored row. Only on first sight: a record in memory is
never read again, and the record a turn of a new session makes is what later turns find
(a new session pays one read, a lookup by the primary key that finds no row). Turns of
one id arriving together share one read.

The read is tenant-scoped (the primary key is the tenant and the client's session id),
waited for at most ``routing.session_read_timeout_s``, and counted by outcome
(``kvhint_router_session_reads_total``). Whatever the store does, the turn is served:

- ``found``: continued from the row. ``missing``: no row (a new session; or one whose
  earlier turns another replica has not flushed yet, ``store_flush_interval_s``): a
  record of its own, as before.
- ``error``: the store failed the read (``drops_total{what="store_read_error"}``);
  ``timeout`` (no answer in time) and ``busy`` (no read slot came free in time:
  :data:`MAX_READS_IN_FLIGHT` reads not over yet, the store slow; or the tenant's own
  :data:`MAX_READS_PER_TENANT`, so one tenant's burst never takes every slot):
  ``drops_total{what="session_unread"}``. Each starts a record of its own, as before
  this read existed; its first save finds the stored row and merges with it
  (session_merge.py), never written over it.

A session this replica holds a record of is read again before each turn (end, hints
call) with no turn of it in flight here (:meth:`StoredSessions.latest`: the same bounded
read, counted in ``kvhint_router_session_refreshes_total``): another replica may have
served turns of it since, which the record then merges in (``SessionRegistry.refresh``),
so the turn continues them. One lookup by the primary key per turn (measured: ~0.2 ms on
a local SQLite file, ~0.7 ms on a local PostgreSQL, docs/router.md). One not read in time
leaves the turn on the record as it is; its save still merges. Such a read takes a slot
only if one is free at once (else ``busy``, at once): it never queues the turn behind
the tenant's other reads (:meth:`StoredSessions.latest`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import Engine

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.read_slots import TenantReadSlots
from kvhint.router.store.reader import (
    get_session_within,
    live_agent_claims_within,
    session_revisions_within,
)

# Reads not over yet (those given up on included: each keeps its thread and a connection
# until the store answers; PostgreSQL gives up the statement after the same timeout) at
# most. Beside responses_sessions' 4, this leaves the writer's flushes one of the
# PostgreSQL pool's 8 connections when both kinds of read are stuck on a slow store.
MAX_READS_IN_FLIGHT = 3
# Of those, one tenant's at most: its other reads wait for one of its own to end, so a
# burst of one tenant's (a flood of session ids never seen: DELETEs, hints calls, new
# sessions) always leaves a slot to every other tenant's. Before, one tenant's client
# key sending a few hundred DELETEs of unknown ids held every slot: the turns of other
# tenants' stored sessions read nothing ("busy", "timeout") and started blank records
# that wrote over their stored rows (their turns, gaps and planner state lost).
MAX_READS_PER_TENANT = MAX_READS_IN_FLIGHT - 1

Row = dict[str, Any]
T = TypeVar("T")
# Whose slots a tick's read of its due idle reviews' revisions takes (:meth:`revisions`):
# one read at a time, never one of a tenant's own.
_IDLE_REVIEWS = "\x00idle-reviews"


class StoredSessions:
    """Bounded, counted reads of sessions' stored rows (loop thread only)."""

    def __init__(self, engine: Engine, metrics: RouterMetrics, timeout_s: float) -> None:
        self._engine = engine
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._slots = TenantReadSlots(MAX_READS_IN_FLIGHT, MAX_READS_PER_TENANT)
        # The read of each session id under way: a second turn of it waits for that one.
        self._reading: dict[tuple[str, str], asyncio.Future[Row | None]] = {}
        # The same for the reads of sessions held in memory (:meth:`latest`).
        self._refreshing: dict[tuple[str, str], asyncio.Future[tuple[str, Row | None]]] = {}

    async def row(self, tenant: str, session_id: str) -> Row | None:
        """``tenant``'s stored row of ``session_id`` as the store gives it within the
        timeout, or None (module doc; counted either way)."""
        return await _joined(self._reading, (tenant, session_id),
                             lambda: self._counted(tenant, session_id))

    async def latest(self, tenant: str, session_id: str) -> tuple[str, Row | None]:
        """The outcome (``found``, ``missing``, ``error``, ``timeout``, ``busy``) and
        row of a read of a session this replica holds a record of (module doc), not
        counted here (the caller counts what it made of it)."""
        # A slot only if one is free now ("busy" else): the record in memory serves the
        # turn and its save still merges, while waiting queued each turn behind the
        # tenant's other reads. Measured (tests/benchmarks/service/
        # bench_service_overhead.py, 32 streams, one tenant, one vLLM CPU worker): the
        # read itself 0.8 ms in its thread, but ~30 ms from the loop and back on a busy
        # 2-core machine, 2 slots a tenant: turns waited 230 ms on average for a slot,
        # 0.5 s (the timeout) when it came to "busy" anyway. With no read of it under
        # way to join and no slot free, "busy" comes here, before the task and its two
        # trips through the loop (10-25 ms a turn then, BENCHMARKS.md); ``wait=False``
        # still answers "busy" where the slot went between this check and the read.
        if (tenant, session_id) not in self._refreshing and not self._slots.free_now(tenant):
            return "busy", None
        return await _joined(self._refreshing, (tenant, session_id),
                             lambda: self._read(tenant, session_id, wait=False))

    async def agent_claims(self, tenant: str, session_id: str, now: float) -> list[Row]:
        """The live agent claims the store holds of the session, any replica's
        (``store.reader.live_agent_claims_within``), read as an end needs them
        (service.agent_releases), waiting for a slot as a first sight does. Not read
        (failed, slow, busy): none, counted (``drops_total{what="agent_claims_unread"}``):
        another replica's claims are then left to their TTL."""
        outcome, rows = await self._slots.read(
            tenant, self._timeout_s, live_agent_claims_within, self._engine, tenant,
            session_id, now, self._timeout_s, wait=True,
            what=f"agent claims of session {tenant}/{session_id}")
        if outcome != "read":
            self._metrics.drop("agent_claims_unread")
            return []
        return list(rows)

    async def revisions(self, keys: list[tuple[str, str]]
                        ) -> dict[tuple[str, str], int] | None:
        """The stored revision of each of ``keys``'s rows (sessions held in memory whose
        idle review is due: idle_reviews.py), one read for them all, slot included
        within the timeout (a tick can wait that long for one: a slot free now only, a
        busy moment would leave every due review unread); None: not read (busy,
        timeout, error). Not counted: the reviews are decided from the records then, as
        where a session's own read is not answered."""
        if not keys:
            return {}
        outcome, found = await self._slots.read(
            _IDLE_REVIEWS, self._timeout_s, session_revisions_within, self._engine,
            list(keys), self._timeout_s, wait=True,
            what=f"the revisions of {len(keys)} sessions")
        return found if outcome == "read" else None

    async def _counted(self, tenant: str, session_id: str) -> Row | None:
        outcome, row = await self._read(tenant, session_id)
        self._metrics.session_reads.labels(outcome).inc()
        if outcome == "error":
            self._metrics.drop("store_read_error")
        elif outcome != "found" and outcome != "missing":
            self._metrics.drop("session_unread")
        return row

    async def _read(self, tenant: str, session_id: str, wait: bool = True
                    ) -> tuple[str, Row | None]:
        outcome, row = await self._slots.read(
            tenant, self._timeout_s, get_session_within, self._engine, tenant, session_id,
            self._timeout_s, wait=wait, what=f"session {tenant}/{session_id}")
        if outcome != "read":
            return outcome, None
        return ("missing", None) if row is None else ("found", row)


async def _joined(under_way: dict[tuple[str, str], asyncio.Future[T]],
                     key: tuple[str, str], start: Callable[[], Awaitable[T]]) -> T:
    """The read of ``key`` under way in ``under_way``, else one ``start`` begins there
    (gone from it when done): turns of one session arriving together share one read.
    Shielded: a client that leaves does not cancel the read another turn waits for."""
    reading = under_way.get(key)
    if reading is None:
        reading = asyncio.ensure_future(start())
        under_way[key] = reading
        reading.add_done_callback(lambda _done: under_way.pop(key, None))
    return await asyncio.shield(reading)
