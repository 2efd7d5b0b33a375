"""Cancels told to every router replica (schemas/response_cancels.py).

The replica that relayed a cancel its worker accepted starts the grace of its own streams
of that response (responses_cancels.py) and publishes a ``ResponseCancelled`` on
``<prefix>.v1.cancels.<worker>``; every replica subscribes to ``<prefix>.v1.cancels.*``
and starts the grace of its streams of that response, so a stream relayed through
another replica than the cancel ends within ``responses.cancel_grace_s`` as well (plus the
notice's trip through NATS), not at ``request_timeout_s``.

Counted (``kvhint_router_responses_cancel_notices_total{outcome}``): ``sent``; ``applied``
(heard from another replica, at least one stream of its response open here); ``no_stream``
(heard, none here: the common case). Lost ones are drops: ``response_cancel_notice_unsent``
(no NATS link now, or the publish failed: kept, at most MAX_UNSENT_KEPT, and sent once
the link is up again, counted ``resent``; until then, and for good for one discarded
past the bound, ``response_cancel_notice_unsent_discarded``, other replicas' streams of
it end at their own bounds, ``responses.background_idle_s`` / ``request_timeout_s``; kept
at the router's stop: published then where the link is up, before NATS's drain sends
them on (:meth:`CancelNotices.close`), else lost, ``response_cancel_notice_unsent_at_stop``),
``response_cancel_notice_malformed`` (not a ResponseCancelled 1.x),
``response_cancel_notice_unverified`` (its id not minted for its tenant and worker under
this fleet's ``salt_secret``: a foreign publisher, or replicas configured apart; nothing
is ended for it). Without NATS (no ``nats_url``) nothing is sent or heard: a single
replica needs none. A notice published while this replica's link was down never comes:
once the link is back, the gateway asks the workers instead (responses_cancel_rechecks.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable

from nats.aio.msg import Msg

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.task_set import TaskSet
from kvhint.schemas import (
    ResponseCancelled,
    Subjects,
    WireDecodeError,
    decode_response_cancelled,
    encode_response_cancelled,
    is_valid_worker_id,
)

log = logging.getLogger(__name__)

# Notices kept to send once the link is back (~200 bytes each); past it the oldest is
# discarded, counted (``response_cancel_notice_unsent_discarded``).
MAX_UNSENT_KEPT = 1_000
# At the router's stop, how long publishing the notices still kept may take (each is a
# write into the NATS client's buffer, sent by the link's drain after it; a full buffer
# waits for the socket). A link down then is not waited for: an outage seldom ends
# within a stop, whose budget is the store's flush (launch.py STOP_AFTER_GRACE_S).
STOP_FLUSH_S = 2.0

# The notice's handler on this replica: ResponseCancelled -> how many streams it reached
# (the Responses gateway's, set once it exists).
Listener = Callable[[ResponseCancelled], int | None]


class CancelNotices:
    """This replica's side of the cancels subject (module doc). ``link`` None: no NATS."""

    def __init__(self, link: NatsLink | None, subjects: Subjects,
                 metrics: RouterMetrics, tasks: TaskSet | None = None) -> None:
        self._link = link
        # Where its resend runs: the runtime's (task_set.py), ended at its stop.
        self._tasks = tasks if tasks is not None else TaskSet()
        self._subjects = subjects
        self._metrics = metrics
        # Tells this replica's notices from the others' (it skips its own).
        self.origin = secrets.token_hex(8)
        # Set by the Responses gateway (app.py builds it after the runtime started).
        self.listener: Listener | None = None
        # Also the gateway's: called each time the link is up with the subject subscribed
        # (first connect, each reconnect): the notices published while it was down are
        # lost, and the gateway rechecks its streams (responses_cancel_rechecks.py).
        self.on_link_up: Callable[[], None] | None = None
        # Notices not sent when relayed (no link then), oldest first: sent once the link
        # is up again (module doc), at most MAX_UNSENT_KEPT.
        self._unsent: deque[ResponseCancelled] = deque(maxlen=MAX_UNSENT_KEPT)
        self._resending: asyncio.Task[None] | None = None
        if link is not None:
            link.on_reconnected.append(self._link_up)

    async def on_connected(self) -> None:
        """Subscribe (NatsLink calls it once per established link, beside the feed's)."""
        if self._link is not None:
            await self._link.subscribe(self._subjects.all_of("cancels"), self._on_message)
            self._link_up()

    def _link_up(self) -> None:
        if self.on_link_up is not None:
            self.on_link_up()
        if self._unsent and (self._resending is None or self._resending.done()):
            self._resending = self._tasks.spawn(self._resend(), "kvhint-cancel-notices")

    async def _resend(self) -> None:
        """The notices kept unsent, in order, while the link takes them."""
        assert self._link is not None
        while self._unsent:
            notice = self._unsent[0]
            if not await self._link.publish(self._subjects.cancels(notice.worker_id),
                                            encode_response_cancelled(notice)):
                return  # down again: the next link-up goes on
            self._unsent.popleft()
            self._metrics.responses_cancel_notices.labels("resent").inc()

    async def close(self, timeout_s: float = STOP_FLUSH_S) -> int:
        """At the router's stop, after its tasks (the resend among them) ended and before
        the link's drain: the notices still kept published if the link is up (within
        ``timeout_s``); the rest lost for good, counted
        (``response_cancel_notice_unsent_at_stop``), how many returned."""
        if self._unsent and self._link is not None and self._link.connected:
            try:
                await asyncio.wait_for(self._resend(), timeout_s)
            except asyncio.TimeoutError:
                pass
        lost = len(self._unsent)
        if lost:
            self._metrics.drop("response_cancel_notice_unsent_at_stop", lost)
            log.warning("%d response cancel notices never told to the other replicas "
                        "(no NATS link at the router's stop)", lost)
            self._unsent.clear()
        return lost

    async def publish(self, response_id: str, tenant: str, worker_id: str) -> bool:
        """Tell the other replicas ``worker_id`` accepted a cancel of ``response_id``."""
        if self._link is None:
            return False
        notice = ResponseCancelled(origin=self.origin, response_id=response_id,
                                   tenant=tenant, worker_id=worker_id, at=time.time())
        if await self._link.publish(self._subjects.cancels(worker_id),
                                    encode_response_cancelled(notice)):
            self._metrics.responses_cancel_notices.labels("sent").inc()
            return True
        self._metrics.drop("response_cancel_notice_unsent")
        if len(self._unsent) == MAX_UNSENT_KEPT:
            self._metrics.drop("response_cancel_notice_unsent_discarded")
        self._unsent.append(notice)
        return False

    async def _on_message(self, msg: Msg) -> None:
        try:
            notice = decode_response_cancelled(msg.data)
        except WireDecodeError as exc:
            self._metrics.drop("response_cancel_notice_malformed")
            log.warning("response cancel notice dropped (%r): %r", msg.subject, str(exc)[:500])
            return
        if notice.origin == self.origin:
            return  # its streams' grace started when this replica relayed the cancel
        if (not notice.version.startswith("1.") or not is_valid_worker_id(notice.worker_id)
                or msg.subject != self._subjects.cancels(notice.worker_id)):
            self._metrics.drop("response_cancel_notice_malformed")
            log.warning("response cancel notice dropped (%r): version %r, worker %r",
                        msg.subject, notice.version, notice.worker_id)
            return
        listener = self.listener
        reached = listener(notice) if listener is not None else 0
        if reached is None:
            self._metrics.drop("response_cancel_notice_unverified")
            log.warning("response cancel notice dropped (%r): id not minted for tenant %r "
                        "and worker %r", msg.subject, notice.tenant, notice.worker_id)
            return
        self._metrics.responses_cancel_notices.labels(
            "applied" if reached else "no_stream").inc()
