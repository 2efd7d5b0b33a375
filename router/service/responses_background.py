"""A background response that can no longer end, read by ``GET /v1/responses/{id}``:
answered ``failed``, with an error, where vLLM would leave it ``queued`` for good (or
the router would answer a bare 404), as OpenAI ends a background response its run lost.

vLLM 0.32 stores a background response ``queued`` when it answers it and replaces it
with its final response once made (responses/serving.py). Nothing is stored when its run
ends otherwise, so a client polling the GET for a terminal status waits for good. The
router answers ``failed`` (status 200, the response object with ``error``, a streamed
GET a one-event stream: ``response.failed``) where it knows the run ended without its
answer, for a background response it relayed queued (``IdEntry.running_since``, this
replica's id map) and has not seen end since (a terminal status or event relayed, a
cancel accepted), counted (``kvhint_router_responses_read_failed_total{reason}``):

- ``worker_gone``/``worker_restarted``: its worker left the fleet or its engine restarted
  (vLLM keeps the response in that process's memory: it is lost with it);
- ``worker_forgot``: its worker answered 404 (its API server restarted unseen: a worker
  without the plugin's heartbeat has no epoch to tell);
- ``stream_error``: a stream of it relayed vLLM's ``error`` event (a failed generation:
  ``responses_stream_generator`` returns after it and the store keeps ``queued``); the
  GET's ``queued``/``in_progress`` answer goes out ``failed``, with that event's error.

Not told (answered as before): a response whose run died on a live worker without a
stream of it through this replica (vLLM 0.32's ``_run_background_request`` marks
``failed`` only for an error returned, not one raised, and ``responses_full_generator``
raises even a failed generation's): nothing the worker answers tells it from a queued or
running one; and an id this replica did not relay (another replica's, one forgotten past
``responses.max_ids``): a 404 as before where its worker is gone.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.responses_ids import IdEntry, ResponseIds
from kvhint.router.service.responses_scan import RUNNING_STATUSES, ResponsesObservation

_encode = msgspec.json.Encoder().encode
# What each reason says of the response's run.
_LOST = {
    "worker_gone": "left the fleet",
    "worker_restarted": "restarted",
    "worker_forgot": "no longer holds it (its server restarted)",
}
_MAX_MESSAGE = 1_000


class BackgroundReads:
    """What this router knows of the background responses it relayed, for their GETs
    (module doc); the gateway's (responses_api.py)."""

    def __init__(self, ids: ResponseIds, metrics: RouterMetrics) -> None:
        self._ids = ids
        self._metrics = metrics

    def follow(self, observation: ResponsesObservation, response_id: str) -> None:
        """A stream of running ``response_id`` tells whether it ended: its terminal event
        carrying the response, or vLLM's ``error`` event (module doc)."""
        ids = self._ids
        observation.on_end = lambda _observation: ids.settled(response_id)
        observation.on_error = lambda code, message: ids.failed(
            response_id, *error_of(code, message))

    def lost(self, response_id: str, tenant: str, reason: str,
             streamed: bool) -> Response | None:
        """A GET's answer for a background response this router relayed queued, running
        as far as it knows, whose worker lost it (``reason``: an id miss's, or
        ``worker_forgot``); None where it is not one."""
        entry = self._ids.held(response_id, tenant)
        if entry is None or entry.running_since is None or reason not in _LOST:
            return None
        self._metrics.responses_read_failed.labels(reason).inc()
        return lost_answer(response_id, entry, reason, streamed)

    def read_back(self, response_id: str, tenant: str, status: int, payload: bytes,
                  streamed: bool) -> Response | None:
        """A GET's whole answer (``status``, ``payload``) for a background response
        running as far as this router knows: its end seen (a terminal status), or what
        goes out in place of the worker's answer; None: the worker's goes out."""
        entry = self._ids.held(response_id, tenant)
        if entry is None or entry.running_since is None:
            return None
        if status == 404:
            return self.lost(response_id, tenant, "worker_forgot", streamed)
        if status != 200:
            return None
        stored = status_of(payload)
        if stored is not None and not is_running(stored):
            self._ids.settled(response_id)
            return None
        if entry.error is None or stored is None:
            return None
        try:
            response = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return None
        if not isinstance(response, dict):
            return None
        self._metrics.responses_read_failed.labels("stream_error").inc()
        return failed_answer(response, entry.error, streamed)


class _Status(msgspec.Struct):
    status: Any = None


_status_decoder = msgspec.json.Decoder(_Status)


def status_of(payload: bytes) -> str | None:
    """A response object's ``status``, or None where ``payload`` is not one."""
    try:
        status = _status_decoder.decode(payload).status
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return status if isinstance(status, str) else None


def is_running(status: str | None) -> bool:
    """Whether a stored response with ``status`` has not ended yet."""
    return status in RUNNING_STATUSES


def error_of(code: Any, message: Any) -> tuple[str, str]:
    """A stream's ``error`` event's code and message, as a response's error keeps them."""
    text = message if isinstance(message, str) else "the response's generation failed"
    return (code if isinstance(code, str) and code else "server_error",
            text[:_MAX_MESSAGE])


def lost_answer(response_id: str, entry: IdEntry, reason: str, streamed: bool) -> Response:
    """The GET's answer for running ``entry`` whose worker lost it (module doc)."""
    message = (f"the worker that ran this background response ({entry.worker_id}) "
               f"{_LOST[reason]} before it ended: vLLM keeps a response in its server's "
               "memory only, and this one's run is lost; create it again")
    response = {"id": response_id, "object": "response", "created_at": entry.running_since,
                "model": entry.model, "background": True, "output": [], "usage": None,
                "incomplete_details": None}
    return failed_answer(response, ("server_error", message), streamed)


def failed_answer(response: dict[str, Any], error: tuple[str, str],
                  streamed: bool) -> Response:
    """``response`` answered ``failed`` with ``error`` (code, message): the response
    object, or for a streamed GET an event stream of its ``response.failed`` alone."""
    failed = {**response, "status": "failed",
              "error": {"code": error[0], "message": error[1]}}
    if not streamed:
        return Response(_encode(failed), media_type="application/json")
    event = {"type": "response.failed", "sequence_number": 0, "response": failed}
    return Response(b"event: response.failed\ndata: " + _encode(event) + b"\n\n",
                    media_type="text/event-stream")
