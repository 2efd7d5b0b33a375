"""The fields of an inference body the router acts on, read as vLLM 0.32 reads them.

vLLM validates a request body with its pydantic models (``ChatCompletionRequest``,
``CompletionRequest``, ``ResponsesRequest``) in pydantic's lax mode: ``"true"``, ``"1"``,
``1``, ``"yes"``, ``"on"`` are a True ``stream``; ``"false"``, ``"0"``, ``0``, ``"no"``,
``"off"`` a False one; ``"5"`` or ``5.0`` a ``priority`` of 5, ``true`` one of 1. The
router reads those fields with the same declarations, so what it acts on (relaying an
event stream, asking for the usage chunk, a tenant's priority bounds) is what the worker
does. A reader answers None for a value vLLM refuses: the caller refuses it too (400,
naming the field), as vLLM would (inbound.py). The Responses API's ``store`` and
``background`` too (responses_api.py): whether vLLM stores a response, runs it queued.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError

from kvhint.router.service.tenancy import Tenant

# vLLM's bounds on ``priority`` (chat_completion/protocol.py: _INT64_MIN, _INT64_MAX).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# kvhint_router_gateway_rejections_total{reason}: a priority outside the tenant's bounds.
PRIORITY_REJECTION = "priority_not_allowed"


class _Stream(BaseModel):
    """``stream`` as every one of vLLM's three request models declares it."""

    stream: bool | None = False


class _StreamOptions(BaseModel):
    """``stream_options.include_usage`` as vLLM's ``StreamOptions`` declares it (vLLM
    sends the usage chunk when it reads True: ``should_include_usage``)."""

    include_usage: bool | None = False


class _Priority(BaseModel):
    """``priority`` as vLLM's three request models declare it (default 0)."""

    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)


def read_stream(body: dict[str, Any]) -> bool | None:
    """Whether vLLM answers ``body`` as an event stream (null: it does not); None: vLLM
    refuses the value."""
    try:
        return bool(_Stream.model_validate(
            {"stream": body["stream"]} if "stream" in body else {}).stream)
    except ValidationError:
        return None


def wants_usage(options: dict[str, Any]) -> bool | None:
    """Whether vLLM sends a stream's usage chunk for ``stream_options`` ``options``;
    None: vLLM refuses the value."""
    try:
        return bool(_StreamOptions.model_validate(
            {"include_usage": options["include_usage"]}
            if "include_usage" in options else {}).include_usage)
    except ValidationError:
        return None


def priority_refusal(body: dict[str, Any], tenant: Tenant) -> str | None:
    """Why ``body``'s ``priority`` is refused for ``tenant`` (a 400 naming ``priority``,
    counted as :data:`PRIORITY_REJECTION`), or None. On a worker scheduling by priority a
    lower value is served first and may preempt what runs there: a tenant free to set it
    could take every other tenant's turn. A tenant without bounds (dev mode, a global
    admin's own traffic with no ``default`` configured: a configured one's bounds hold
    it, tenancy.py) sends what it likes. A value vLLM refuses is refused (and
    counted) here too: fail closed, never a priority the router did not read."""
    bounds = tenant.priority_range
    if bounds is None or "priority" not in body:
        return None
    try:
        priority = _Priority.model_validate({"priority": body["priority"]}).priority
    except ValidationError:
        return "'priority' must be an integer"
    low, high = bounds
    if low <= priority <= high:
        return None
    if low == high == 0:
        return (f"priority={priority} is not allowed for your key: its tenant may not set "
                "'priority' (lower is served first, ahead of other tenants' requests, on "
                "workers scheduling by priority); send the request without it, or 0")
    return (f"priority={priority} is not allowed for your key: its tenant may set "
            f"'priority' from {low} to {high} (lower is served first)")


class _Storing(BaseModel):
    """The fields deciding whether vLLM 0.32 stores a response, as its ``ResponsesRequest``
    declares them, read by pydantic's lax rules as vLLM reads them: "false", 0, "0",
    "no", "off", "n", "f" are False; an explicit null is None, for which vLLM stores
    nothing (``if request.store``)."""

    store: bool | None = True
    background: bool | None = False


def stores_response(body: dict[str, Any]) -> bool:
    """Whether vLLM stores the response ``body`` asks for (``store`` absent: it does), so
    the router never remembers an id its worker did not store. A background response is
    stored, queued, whatever ``store`` reads as (vLLM refuses ``background`` with a
    ``store`` falsy as it comes, false, 0 or null, but not with "false"). What vLLM
    refuses is answered 400, so nothing is learnt whatever this says (a value pydantic
    refuses reads as not stored)."""
    try:
        flags = _Storing.model_validate({k: body[k] for k in ("store", "background")
                                         if k in body})
    except ValidationError:
        return False
    return bool(flags.store) or bool(flags.background)


def runs_in_background(body: dict[str, Any]) -> bool:
    """Whether vLLM runs the Responses request ``body`` in the background (``background``
    read as :class:`_Storing` reads it; a value pydantic refuses: vLLM answers 400)."""
    try:
        return bool(_Storing.model_validate(
            {"background": body["background"]} if "background" in body else {}).background)
    except ValidationError:
        return False
