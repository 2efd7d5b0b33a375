"""Cancels this replica may have missed while its NATS link was down.

Cancels relayed by other replicas reach this one as core NATS notices
(responses_cancel_notices.py): one published while this replica had no link (NATS down
for it alone, a network split, this replica still connecting) never comes, and its
streams of that response would wait for events vLLM never sends
(responses_cancels.py) until ``responses.background_idle_s`` / ``request_timeout_s``.

So each time the link comes up (the first time and after each reconnect, once the
cancels subject is subscribed again: a notice published from then on is heard), the
router asks the worker of each response with a stream open here that no cancel reached
yet for that response (``GET /v1/responses/{id}``, not streamed). vLLM 0.32 keeps a
cancelled response in its store with status ``cancelled`` for good (responses/serving.py
``cancel_responses``; a background task that ends later leaves that status as it is):
where the worker says so, the response counts as cancelled here as a notice would have
made it (its streams' grace starts, a stream opened later starts in it), counted
(``kvhint_router_responses_cancel_notices_total{outcome="recovered"}``). A check the
worker does not answer (unreachable, not within RECHECK_TIMEOUT_S, an error status, an
answer not JSON) is a drop, ``response_cancel_recheck_failed``: that stream ends at its
own bounds if its response was cancelled.

Not covered: a stream opened after the link came back, of a response cancelled while it
was down, through a replica that did not relay that cancel; it ends at
``responses.background_idle_s`` (nothing here knows of the cancel to check it against,
short of asking the worker at every streamed GET).

Why a recheck and not a JetStream stream of the notices: the worker's store is the
truth of a cancel for as long as the response exists, an outage of any length is
covered, and nothing new is kept on NATS (no stream, consumer or sequence to keep).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.responses_cancels import CancelWatches
from kvhint.router.service.upstream import UpstreamBroken, UpstreamPool, UpstreamUnavailable
from kvhint.router.service.workers import WorkerRegistry

log = logging.getLogger(__name__)

# How long one check waits for its worker's answer (a stored response's GET is a lookup
# in vLLM's memory: a worker slower than this is in trouble anyway).
RECHECK_TIMEOUT_S = 5.0
# Checks in flight at once: hundreds of open streams do not open hundreds of
# connections to the workers at a reconnect.
RECHECKS_AT_ONCE = 8

# The gateway's own: the worker accepted a cancel of the response, whose answer this is;
# returns how many streams it reached.
OnCancelled = Callable[[str, dict[str, Any]], int]


async def recheck_streams(watches: CancelWatches, workers: WorkerRegistry,
                          pool: UpstreamPool, metrics: RouterMetrics,
                          on_cancelled: OnCancelled) -> int:
    """Check each response with an unsettled stream here (module doc); how many were
    found cancelled."""
    slots = asyncio.Semaphore(RECHECKS_AT_ONCE)

    async def check(response_id: str, worker_id: str) -> bool:
        async with slots:
            answer = await _status(response_id, worker_id, workers, pool)
        if answer is None:
            metrics.drop("response_cancel_recheck_failed")
            return False
        if answer.get("status") != "cancelled":
            return False
        on_cancelled(response_id, answer)
        metrics.responses_cancel_notices.labels("recovered").inc()
        log.info("response %s was cancelled while this router's NATS link was down: its "
                 "streams here end within the grace", response_id)
        return True

    found = await asyncio.gather(*(check(response_id, worker_id) for response_id, worker_id
                                   in watches.unsettled().items()))
    return sum(found)


async def _status(response_id: str, worker_id: str, workers: WorkerRegistry,
                  pool: UpstreamPool) -> dict[str, Any] | None:
    """The worker's stored response (None: no usable answer, logged)."""
    worker = workers.get(worker_id)
    if worker is None or worker.url is None:
        log.warning("response %s: its worker %s is gone, its cancel not checked",
                    response_id, worker_id)
        return None
    url = f"{worker.url}/v1/responses/{quote(response_id, safe='')}"
    try:
        # A stored response is bounded as any answer (upstream_answer_max_bytes), not as a
        # model listing: it echoes its request's instructions and tools, its whole output.
        answer = await pool.get_json(url, RECHECK_TIMEOUT_S, worker_id=worker_id,
                                     whole_answer=True)
    except (UpstreamUnavailable, UpstreamBroken, aiohttp.ClientError, asyncio.TimeoutError,
            OSError, ValueError) as exc:
        log.warning("response %s: its cancel not checked at worker %s: %s", response_id,
                    worker_id, f"{type(exc).__name__}: {exc}"[:300])
        return None
    return answer if isinstance(answer, dict) else None
