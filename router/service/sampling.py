"""Parallel sampling (``n`` > 1, or ``best_of``): how many sequences one request asks a
worker to decode, and the router's bound on it.

vLLM runs ``n`` > 1 as ``n`` child requests of one prompt, scheduled together, and
answers with ``n`` choices and one usage: the prompt counted once, ``completion_tokens``
summed over the choices, ``cached_tokens`` one child's. The router accepts it, within
``routing.max_n``: each sequence decodes on the worker beside every other tenant's, so an
unbounded ``n`` lets one request take a worker's batch (and one tenant's
``max_in_flight`` counts requests, not sequences). What the router learns from such a
response is read per completion (``ResponseObservation.completion_tokens_per_choice``):
a session continues at most one of them.
"""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from kvhint.router.service.inbound import BadRequest, Endpoint

SAMPLING_KEYS = ("n", "best_of")
# vLLM declares them ``int`` (``int | None``) and pydantic reads them laxly: "64", 64.0
# and " 64" are 64, true is 1. Read otherwise (an int only), "64" passed max_n as 1.
_LAX_INT = TypeAdapter(int | None)


def _asked(body: dict[str, object], endpoint: Endpoint | None) -> dict[str, int]:
    """The sampling keys the body sets to what vLLM reads as an integer, by key; a value
    vLLM refuses (64.5, "x") is left out, for vLLM's own 400. None on ``/v1/responses``:
    vLLM 0.32's ResponsesRequest has no ``n`` nor ``best_of`` (it takes and ignores
    extra fields), one output whatever they say."""
    if endpoint is Endpoint.RESPONSES:
        return {}
    asked: dict[str, int] = {}
    for key in SAMPLING_KEYS:
        try:
            value = _LAX_INT.validate_python(body.get(key))
        except ValidationError:
            continue
        if value is not None:
            asked[key] = value
    return asked


def parallel_samples(body: dict[str, object], endpoint: Endpoint | None = None) -> int:
    """How many sequences the request asks the worker to sample per prompt (``n``, or
    ``best_of`` where a vLLM still takes it); 1 for anything unreadable."""
    return max([1, *_asked(body, endpoint).values()])


def check_parallel_samples(body: dict[str, object], max_n: int,
                           endpoint: Endpoint | None = None) -> None:
    """Raises :class:`BadRequest` (400, naming the field) for a request that asks for more
    than ``max_n`` sequences; anything else (a value vLLM refuses) is left to vLLM."""
    for key, value in _asked(body, endpoint).items():
        if value > max_n:
            raise BadRequest(f"{key}={value} is over this router's limit of {max_n} "
                             "sequences per request (routing.max_n)", param=key)
