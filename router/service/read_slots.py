"""Store-read slots shared by every tenant, of which one tenant holds at most a few: a
burst of one tenant's reads always leaves a slot to every other tenant's (tenancy
review).

Used by the store reads made for requests: session_reads.py (a first-sight session's
row; waits for a slot) and responses_sessions.py (a Responses follow-up's session; takes
one only if free now), both through :meth:`TenantReadSlots.read`. Each tenant's entry is
made with its first read waiting or under way and goes with its last (a global admin may
name any tenant: no entry outlives its reads). Not tenant_slots.py: that one is each
tenant's requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from kvhint.router.store.db_errors import sqlstate

log = logging.getLogger(__name__)

# 57014 query_canceled: PostgreSQL's statement_timeout (the readers set it to the wait).
_STATEMENT_TIMEOUT = "57014"
ReadOutcome = Literal["read", "busy", "timeout", "error"]


class TenantReadSlots:
    """``total`` slots, at most ``per_tenant`` of them one tenant's (loop thread only)."""

    def __init__(self, total: int, per_tenant: int) -> None:
        if not 0 < per_tenant <= total:
            raise ValueError(f"per_tenant {per_tenant} not in 1..{total}")
        self._slots = asyncio.Semaphore(total)
        self._per_tenant = per_tenant
        self._tenants: dict[str, _Own] = {}
        self._held = 0

    @property
    def held(self) -> int:
        """Slots held now (reads not over yet, those given up on included)."""
        return self._held

    @property
    def tenants(self) -> int:
        """Tenants with a read waiting for a slot or holding one."""
        return len(self._tenants)

    async def acquire(self, tenant: str) -> None:
        """One of ``tenant``'s own slots, then one of all: waits for both (first come,
        first served). Cancelled or timed out, holds nothing."""
        own = self._enter(tenant)
        try:
            await own.slots.acquire()
            try:
                await self._slots.acquire()
            except BaseException:
                own.slots.release()
                raise
        except BaseException:
            self._leave(tenant, own)
            raise
        self._held += 1

    def free_now(self, tenant: str) -> bool:
        """Whether :meth:`try_acquire` would take a slot for ``tenant`` now."""
        own = self._tenants.get(tenant)
        return not (self._slots.locked() or (own is not None and own.slots.locked()))

    async def try_acquire(self, tenant: str) -> bool:
        """A slot for ``tenant`` if one is free now (its own and one of all), without
        waiting: False when not."""
        if not self.free_now(tenant):
            return False
        own = self._enter(tenant)
        # Neither is locked: each acquire returns at once, without suspending (asyncio's
        # documented behaviour), so nothing can take them between the check and here.
        await own.slots.acquire()
        await self._slots.acquire()
        self._held += 1
        return True

    def release(self, tenant: str) -> None:
        """Gives back a slot ``tenant`` acquired."""
        own = self._tenants[tenant]
        self._held -= 1
        self._slots.release()
        own.slots.release()
        self._leave(tenant, own)

    async def read(self, tenant: str, timeout_s: float, read: Callable[..., Any],
                   *args: Any, wait: bool, what: str) -> tuple[ReadOutcome, Any]:
        """``read(*args)`` (a store read) in the loop's executor, on one of ``tenant``'s
        slots, waited for at most ``timeout_s`` from now, slot included: ("read", its
        result), or ("busy", None): no slot (``wait``: none came free in time; else
        none free now), ("timeout", None): no answer in time (or PostgreSQL's
        statement_timeout), ("error", None): the store failed it (logged, naming
        ``what``). A read given up on ends in its thread, its slot held until then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if wait:
            try:
                async with asyncio.timeout_at(deadline):
                    await self.acquire(tenant)
            except TimeoutError:
                return "busy", None
        elif not await self.try_acquire(tenant):
            return "busy", None
        try:
            running = loop.run_in_executor(None, read, *args)
        except BaseException:
            self.release(tenant)
            raise
        running.add_done_callback(lambda done: self._read_over(done, tenant))
        try:
            # Shielded: giving up on the read (or the client leaving) leaves it to end
            # in its thread, its slot held until then.
            async with asyncio.timeout_at(deadline):
                return "read", await asyncio.shield(running)
        except TimeoutError:
            return "timeout", None
        except SQLAlchemyError as exc:
            if isinstance(exc, DBAPIError) and sqlstate(exc.orig) == _STATEMENT_TIMEOUT:
                return "timeout", None
            log.warning("could not read %s from the store: %s", what,
                        f"{type(exc).__name__}: {exc}"[:300])
            return "error", None

    def _read_over(self, running: asyncio.Future[Any], tenant: str) -> None:
        self.release(tenant)
        if not running.cancelled():
            # Taken, so that a read given up on that fails later is not logged as an
            # exception nobody retrieved.
            running.exception()

    def _enter(self, tenant: str) -> _Own:
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = _Own(self._per_tenant)
        own.users += 1
        return own

    def _leave(self, tenant: str, own: _Own) -> None:
        own.users -= 1
        if own.users == 0:
            del self._tenants[tenant]


class _Own:
    """One tenant's slots and how many of its reads wait for one or hold one."""

    def __init__(self, per_tenant: int) -> None:
        self.slots = asyncio.Semaphore(per_tenant)
        self.users = 0
