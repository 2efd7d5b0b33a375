"""The router counts a ``/v1/completions`` body's prompts as vLLM 0.32 does (its own
``CompletionRequest`` and ``prompt_to_seq``, in-process): what ``routing.max_n`` bounds
as prompts x max(n, best_of) is the engine requests vLLM makes of the body."""

from __future__ import annotations

import pytest

from kvhint.router.service.inbound import BadRequest, Endpoint
from kvhint.router.service.sampling import (
    MAX_N_REJECTION,
    batched_prompts,
    check_parallel_samples,
    parallel_samples,
)

PROMPTS = ["a", "", ["a"], ["a", "b", "c"], [1, 2, 3], [[1], [2]], [[], []], [],
           ["1", "2"], [1, "2"], [1.0, 2.0], [True, False], [[1.0], [2]], [["1"], ["2"]],
           [1, [2]], ["a", [1]], [[1], "a"], [-1, 2], [None], [{"a": 1}], ["a", 1], [1.5],
           None, 7, {"a": 1}]
EMBEDS = [None, "QUJD", ["QUJD", "QUJD"], []]


def _vllm_prompts(body: dict[str, object]) -> int | None:
    """The engine requests vLLM makes of ``body`` (None: vLLM refuses it)."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.inputs.preprocess import prompt_to_seq

    try:
        request = CompletionRequest.model_validate({"model": "m", **body})
    except (ValidationError, VLLMValidationError):  # vLLM answers 400
        return None
    count = 0
    if request.prompt_embeds is not None:  # completion/serving.py: embeds first
        count += len(prompt_to_seq(request.prompt_embeds))
    if request.prompt is not None:
        count += len(prompt_to_seq(request.prompt))
    return count


@pytest.mark.parametrize("embeds", EMBEDS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompts_are_counted_as_vllm_counts_them(prompt: object, embeds: object) -> None:
    """Strings, token-id lists, lists of lists, empty lists, mixed lists (read laxly as
    one token-id list, or refused), ``prompt_embeds`` one or a list: the router's count
    is vLLM's wherever vLLM accepts the body (at least 1: the bound's unit)."""
    body: dict[str, object] = {"prompt": prompt}
    if embeds is not None:
        body["prompt_embeds"] = embeds
    vllm = _vllm_prompts(body)
    if vllm is not None:
        assert batched_prompts(body, Endpoint.COMPLETION) == max(vllm, 1)


def test_only_completions_batch() -> None:
    """A chat or Responses body's ``prompt`` field is no prompt of vLLM's there."""
    body = {"prompt": ["a"] * 40, "messages": [{"role": "user", "content": "x"}]}
    assert batched_prompts(body, Endpoint.CHAT) == 1
    assert batched_prompts(body, Endpoint.RESPONSES) == 1
    check_parallel_samples(body, 16, 16, Endpoint.CHAT)


def test_max_sequences_bounds_prompts_times_samples() -> None:
    """routing.max_sequences bounds the request's sequences: 8 prompts of n = 2 pass 16,
    one more prompt or n = 3 does not (a 400 naming ``prompt``, counted as over_max_n);
    routing.max_n bounds one prompt's n."""
    completion = Endpoint.COMPLETION
    body = {"prompt": ["a"] * 8, "n": 2}
    assert batched_prompts(body, completion) * parallel_samples(body, completion) == 16
    check_parallel_samples({"prompt": ["a"] * 8, "n": 2}, 16, 16, completion)
    check_parallel_samples({"prompt": list(range(5000))}, 16, 16, completion)  # one prompt
    check_parallel_samples({"prompt": ["a"] * 256}, 16, 256, completion)
    for body, field in (({"prompt": ["a"] * 9, "n": 2}, "prompt"),
                        ({"prompt": ["a"] * 8, "best_of": 3}, "prompt"),
                        ({"prompt": "a", "prompt_embeds": ["x"] * 16}, "prompt_embeds"),
                        ({"prompt": "a", "n": 17}, "n")):
        with pytest.raises(BadRequest) as refused:
            check_parallel_samples(body, 16, 16, completion)
        assert refused.value.status == 400 and refused.value.param == field
        assert refused.value.rejection == MAX_N_REJECTION
        assert ("routing.max_n" if field == "n" else "routing.max_sequences"
                ) in refused.value.message


def test_max_sequences_under_max_n_is_refused_at_start() -> None:
    """One prompt's n within routing.max_n must never be refused by the total."""
    from kvhint.router.service.settings_sections import RoutingSettings

    assert RoutingSettings(max_n=32).max_sequences == 256
    with pytest.raises(ValueError, match="max_sequences 8 is under routing.max_n 16"):
        RoutingSettings(max_sequences=8)
