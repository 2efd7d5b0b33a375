"""Parallel sampling (``n`` > 1, or ``best_of``) and batched prompts: how many sequences
one request asks a worker to decode, and the router's bound on it.

vLLM runs ``n`` > 1 as ``n`` child requests of one prompt, scheduled together, and
answers with ``n`` choices and one usage: the prompt counted once, ``completion_tokens``
summed over the choices, ``cached_tokens`` one child's. The router accepts it, within
``routing.max_n``: each sequence decodes on the worker beside every other tenant's, so an
unbounded ``n`` lets one request take a worker's batch (and one tenant's
``max_in_flight`` counts requests, not sequences). What the router learns from such a
response is read per completion (``ResponseObservation.completion_tokens_per_choice``):
a session continues at most one of them.

A ``/v1/completions`` body may batch prompts (``prompt`` a list of strings or of
token-id lists, ``prompt_embeds`` a list): vLLM 0.32 makes one engine request of each
prompt (``completion/serving.py``: ``prompt_to_seq`` of ``prompt_embeds``, then of
``prompt``), each sampling ``n`` sequences, and answers them as one response (P x n
choices, one usage: every prompt's tokens summed, ``cached_tokens`` one prompt's). vLLM's
own bound on P (``VLLM_MAX_COMPLETION_PROMPTS``, 1024 by default, on each list apart)
is far above a router's per-request bound: ``routing.max_n`` bounds ``n``/``best_of``
(one prompt's samples), and ``routing.max_sequences`` the sequences of the whole
request, prompts x max(n, best_of) (256 by default: batch clients of up to 256 prompts
keep working, where one bound for both refused any batch past 16). A request over
either is a 400 naming the field (``n``/``best_of``, else ``prompt`` or
``prompt_embeds``), counted as ``gateway_rejections_total{reason="over_max_n"}``. It
still takes one of its tenant's ``max_in_flight`` slots, as an ``n`` > 1 request does:
a tenant's sequences in flight are at most ``max_in_flight`` x ``max_sequences``.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvhint.router.service.inbound import BadRequest, Endpoint

SAMPLING_KEYS = ("n", "best_of")
# kvhint_router_gateway_rejections_total{reason}: a request over routing.max_n sequences.
MAX_N_REJECTION = "over_max_n"
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


def prompt_batch(prompt: object) -> list[Any] | None:
    """The prompts of a ``/v1/completions`` ``prompt`` that batches several, as vLLM 0.32
    reads it (``prompt_to_seq`` of what its ``CompletionRequest`` validated): a list of
    strings, or of lists (token ids), one prompt per item; else None (a string, one
    list of token ids: pydantic reads ``[1, "2"]``, ``[1.0]``, ``[true]`` laxly as one;
    or what vLLM refuses). Read by shape, not by validating: a body of up to
    max_body_bytes is not validated item by item on the event loop."""
    if isinstance(prompt, list) and prompt and (
            all(map(isinstance, prompt, repeat(str)))
            or all(map(isinstance, prompt, repeat(list)))):
        return prompt
    return None


def _prompt_seq_len(prompt: object) -> int:
    """How many prompts vLLM 0.32 makes of a ``prompt`` (:func:`prompt_batch`): a batch's
    items, one for a string or any other non-empty list, none for none."""
    if (batch := prompt_batch(prompt)) is not None:
        return len(batch)
    return 1 if isinstance(prompt, str) or (isinstance(prompt, list) and prompt) else 0


def batched_prompts(body: dict[str, object], endpoint: Endpoint | None = None) -> int:
    """How many engine requests vLLM 0.32 makes of the request: on ``/v1/completions``
    one per prompt, ``prompt_embeds``' (one, or one per item of a list) and
    ``prompt``'s (:func:`_prompt_seq_len`); 1 elsewhere, and at least 1."""
    if endpoint is not Endpoint.COMPLETION:
        return 1
    embeds = body.get("prompt_embeds")
    count = len(embeds) if isinstance(embeds, list) else 1 if isinstance(embeds, str) else 0
    return max(count + _prompt_seq_len(body.get("prompt")), 1)


def check_parallel_samples(body: dict[str, object], max_n: int, max_sequences: int,
                           endpoint: Endpoint | None = None) -> None:
    """Raises :class:`BadRequest` (400, naming the field, counted as
    :data:`MAX_N_REJECTION`) for a request that asks for more than ``max_n`` sequences:
    ``n`` or ``best_of`` alone over ``max_n``, or its prompts x max(n, best_of) over
    ``max_sequences`` (module doc); anything
    else (a value vLLM refuses) is left to vLLM."""
    for key, value in _asked(body, endpoint).items():
        if value > max_n:
            raise BadRequest(f"{key}={value} is over this router's limit of {max_n} "
                             "sequences per request (routing.max_n)", param=key,
                             rejection=MAX_N_REJECTION)
    prompts = batched_prompts(body, endpoint)
    samples = parallel_samples(body, endpoint)
    if prompts * samples > max_sequences:
        embeds = body.get("prompt_embeds")
        field = "prompt_embeds" if isinstance(embeds, list) and len(embeds) > _prompt_seq_len(
            body.get("prompt")) else "prompt"
        raise BadRequest(
            f"the request batches {prompts} prompts, each sampled {samples} time(s) "
            f"(max of n and best_of): {prompts * samples} sequences, over this router's "
            f"limit of {max_sequences} sequences per request (routing.max_sequences, "
            "counting prompts x n); send fewer prompts per request", param=field,
            rejection=MAX_N_REJECTION)
