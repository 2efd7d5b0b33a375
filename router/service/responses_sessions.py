"""The session each stored Responses API response was made in, shared by the replicas
through the store.

A follow-up (``previous_response_id``) naming no session continues the session of the
response it follows. The replica that relayed the response remembers it
(responses_ids.py); the id does not say it (responses_id_codec.py: client session ids
may be long and say what they should not). So each stored response made in a session is
written to the store (``response_sessions``: id -> tenant, session; behind, as every
store write is, within ``store_flush_interval_s``), and a replica that does not hold the
id (another replica's, one from before its restart, one it forgot past
``responses.max_ids``) reads it there: only for a follow-up that names no session, of an
id that says it was made in one, whose tag checked out for the requesting tenant. One
lookup by the primary key, waited for at most ``responses.session_read_timeout_s``.

The row is used only for the tenant the id was verified for: one naming another tenant
is not (``other_tenant``). Whatever the store does, the follow-up is served, continuing
no session when the read does not give one:

- ``missing``: no row. A follow-up within the write-behind window of its response (the
  other replica has not flushed yet), a row pruned past ``responses.session_retention_s``
  (at most ``store_retention_s``: store.retention), a response made by a router before
  this release. Counted ``drops_total{what="response_session_unknown"}`` (by design:
  name the session to be sure of it), as ``other_tenant`` is.
- ``error``, ``timeout``, ``busy`` (not read: :data:`MAX_READS_IN_FLIGHT` reads in
  flight already, the store slow; or :data:`MAX_READS_PER_TENANT` of the requesting
  tenant's, so one tenant's burst of follow-ups never takes every slot): counted
  ``drops_total{what="response_session_unread"}``.

Every read is counted by outcome (``kvhint_router_response_session_reads_total``).
"""

from __future__ import annotations

import time

from sqlalchemy import Engine

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.read_slots import TenantReadSlots
from kvhint.router.store.models import ResponseSessionRow
from kvhint.router.store.reader import get_response_session
from kvhint.router.store.writer import StoreWriter

# Reads waited for (or given up on, their thread still running) at once, at most: past
# it a follow-up is not held for a store that is slow already (``busy``). A read given up
# on keeps its thread and a connection until the store answers (PostgreSQL gives up the
# statement after the same timeout; a connection attempt takes up to
# store_connect_timeout_s): the bound keeps those from taking every thread of the loop's
# executor and every connection of the store's pool (8) from the writer's flushes.
MAX_READS_IN_FLIGHT = 4
# Of those, one tenant's at most (tenancy review): past it, its follow-ups are ``busy``
# while every other tenant's still find a slot. Before, one tenant's burst of follow-ups
# of ids this replica does not hold (a plain load balancer, a restart) held all 4 and
# every other tenant's follow-up meanwhile continued no session.
MAX_READS_PER_TENANT = MAX_READS_IN_FLIGHT - 1
_TABLE = ResponseSessionRow.__tablename__


class ResponseSessions:
    """Writes and reads ``response_sessions`` for the Responses API (loop thread only)."""

    def __init__(self, engine: Engine, writer: StoreWriter, metrics: RouterMetrics,
                 timeout_s: float) -> None:
        self._engine = engine
        self._writer = writer
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._slots = TenantReadSlots(MAX_READS_IN_FLIGHT, MAX_READS_PER_TENANT)

    @property
    def in_flight(self) -> int:
        """Reads not over yet, those given up on included."""
        return self._slots.held

    @property
    def tenants_reading(self) -> int:
        """Tenants with a read not over yet."""
        return self._slots.tenants

    def remember(self, response_id: str, tenant: str, session_id: str) -> None:
        """``response_id`` (stored, ``tenant``'s) was made in ``session_id``: queued for
        the store's next flush (no I/O here)."""
        self._writer.upsert(_TABLE, (response_id,), {
            "response_id": response_id, "tenant": tenant, "session_id": session_id,
            "created_at": time.time()})

    async def session_of(self, response_id: str, tenant: str) -> str | None:
        """The client session ``tenant``'s response ``response_id`` was made in, as the
        store says it within the timeout, or None (module doc; counted either way)."""
        outcome, session = await self._read(response_id, tenant)
        self._metrics.response_session_reads.labels(outcome).inc()
        if outcome in ("missing", "other_tenant"):
            self._metrics.drop("response_session_unknown")
        elif outcome != "found":
            self._metrics.drop("response_session_unread")
        return session

    async def _read(self, response_id: str, tenant: str) -> tuple[str, str | None]:
        outcome, row = await self._slots.read(
            tenant, self._timeout_s, get_response_session, self._engine, response_id,
            self._timeout_s, wait=False, what=f"the session of response {response_id}")
        if outcome != "read":
            return outcome, None
        if row is None:
            return "missing", None
        stored_tenant, session_id = row
        if stored_tenant != tenant:
            return "other_tenant", None
        return "found", session_id
