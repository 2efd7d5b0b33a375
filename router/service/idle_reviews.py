"""Which replica reviews an idle session: the one that saw its latest event.

Replicas share the store, and each holds its own records of the sessions it served in
memory; a session's turns may alternate between them. Its idle review
(``SessionLifecycle.tick``: decay, release, abandonment, the planner's idle hints) is
the replica's that saw the session's latest event (served its latest turn, or ended it),
as the merged record says (:attr:`SessionRecord.latest_elsewhere`, session_merge.py).
Before a due review a replica reads the session's row (the read before a turn,
``routing.session_refresh``) and merges another replica's saves since; where that
replica's later turn is merged in, this one forgets its record (the store keeps it; a
turn here reads it back and makes the review this replica's again) and its own count of
the planner's holdings of the session (whose protection the other replica's planner
state carries on), counted (``kvhint_router_idle_reviews_yielded_total``).

Before, every replica holding a record of a session reviewed it: one whose record was
behind (the session's later turns served elsewhere) decayed, released and finally
abandoned it from its older state, its release superseding the other replica's newer
Retain on the worker (the same session and owner), learning a non-return of a session
that had returned, and counting in its budget a holding the worker no longer kept. Not
read (the read off: one replica, or a load balancer's affinity; busy, failed, or no row
yet), it is decided from what the record knows (its saves' merges).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvhint.router.policy.holdings import HoldingsLedger
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.sessions import SessionRecord, SessionRegistry

LatestSession = Callable[[str, str], Awaitable[tuple[str, dict[str, Any] | None]]]


async def reviewed_elsewhere(record: SessionRecord, sessions: SessionRegistry,
                             holdings: HoldingsLedger, latest_session: LatestSession | None,
                             metrics: RouterMetrics) -> bool:
    """Whether ``record``'s idle review is another replica's (module docstring); then
    the record is forgotten here, with this replica's count of the planner's holdings of
    its session, and counted. ``latest_session``: the bounded read of its row
    (session_reads.StoredSessions.latest); None: not read."""
    if latest_session is not None:
        _outcome, row = await latest_session(record.tenant, record.session_id)
        if row is not None and not record.inflight:
            sessions.refresh(record, row)
    if not record.latest_elsewhere or record.inflight:
        return False
    scope = record.worker_session_id
    agents = set(holdings.api_holders(scope))
    for worker_id in holdings.workers_holding(scope):
        if worker_id not in agents:  # an agent runtime's claim stays its own
            holdings.release_scope(worker_id, scope)
    if sessions.get(record.tenant, record.session_id) is record:
        sessions.forget(record)
    metrics.idle_reviews_yielded.inc()
    return True
