"""The router reads ``stream``, ``stream_options.include_usage`` and ``priority`` as vLLM
0.32's own request models read them (pydantic's lax mode), on each endpoint: every value
tried is validated by vLLM's ``ChatCompletionRequest``, ``CompletionRequest`` and
``ResponsesRequest`` in-process, and the router must agree with what each makes of it
(or refuse, 400 naming the field, what vLLM refuses)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.serve.utils.api_utils import should_include_usage
from vllm.exceptions import VLLMClientError

from kvhint.router.service.inbound import BadRequest, Endpoint, parse_inbound
from kvhint.router.service.request_fields import PRIORITY_REJECTION
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import Tenant

DEV = Tenant("default", None, TenantBudget())
# A tenant's key with the default bounds (0 to 0), and one allowed -5 to 5.
ACME = Tenant("acme", "salt-acme", TenantBudget(), priority_range=(0, 0))
BETA = Tenant("beta", "salt-beta", TenantBudget(), priority_range=(-5, 5))

MODELS: dict[Endpoint, tuple[type, dict[str, Any]]] = {
    Endpoint.CHAT: (ChatCompletionRequest,
                    {"messages": [{"role": "user", "content": "hi"}]}),
    Endpoint.COMPLETION: (CompletionRequest, {"prompt": "hi"}),
    Endpoint.RESPONSES: (ResponsesRequest, {"input": "hi"}),
}
# JSON values a client may send for a boolean: pydantic's lax strings and numbers, their
# case, what it refuses (" true", "maybe", 2, 0.5, [], {}), and null.
BOOLEANS: list[Any] = [True, False, None, "true", "false", "True", "FALSE", "1", "0", 1, 0,
                       1.0, 0.0, "yes", "no", "on", "off", "y", "n", "t", "f", " true",
                       "maybe", "", 2, -1, 0.5, [], {}, "null"]
PRIORITIES: list[Any] = [0, "0", 0.0, False, True, 1, -1, "-1", 5, -5, 6, -6, "6", 5.0, 1.5,
                         "x", None, [], 2**63, -(2**63) - 1, 2**63 - 1]


def vllm_reads(endpoint: Endpoint, fields: dict[str, Any]) -> Any:
    """vLLM's request model for ``endpoint`` of a body with ``fields``; None: refused."""
    model, base = MODELS[endpoint]
    try:
        return model.model_validate(json.loads(json.dumps({**base, **fields})))
    except (ValidationError, VLLMClientError):
        return None


def router_reads(endpoint: Endpoint, fields: dict[str, Any],
                 tenant: Tenant = DEV) -> Any:
    """The router's InboundRequest for the same body; the BadRequest if it refuses."""
    _, base = MODELS[endpoint]
    try:
        return parse_inbound(endpoint, json.dumps({**base, **fields}).encode(), tenant,
                             None, None)
    except BadRequest as exc:
        return exc


@pytest.mark.parametrize("endpoint", list(MODELS))
@pytest.mark.parametrize("value", BOOLEANS)
def test_stream_is_read_as_vllm_reads_it(endpoint: Endpoint, value: Any) -> None:
    vllm = vllm_reads(endpoint, {"stream": value})
    router = router_reads(endpoint, {"stream": value})
    if vllm is None:
        assert isinstance(router, BadRequest) and router.param == "stream", router
        return
    assert not isinstance(router, BadRequest), router.message
    assert router.stream is bool(vllm.stream)


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
@pytest.mark.parametrize("value", BOOLEANS)
def test_include_usage_is_read_as_vllm_reads_it(endpoint: Endpoint, value: Any) -> None:
    """A stream's usage chunk: the router asks for it (and strips it) exactly when vLLM
    would not send it for the client's ``stream_options``; what it forwards then makes
    vLLM send it."""
    fields = {"stream": "true", "stream_options": {"include_usage": value}}
    vllm = vllm_reads(endpoint, fields)
    router = router_reads(endpoint, fields)
    if vllm is None:
        assert isinstance(router, BadRequest) and router.param == "stream_options", router
        return
    assert not isinstance(router, BadRequest), router.message
    client_wants, _ = should_include_usage(vllm.stream_options, False)
    assert router.strip_usage_chunk is not client_wants
    forwarded = vllm_reads(endpoint, router.body)
    assert forwarded is not None and forwarded.stream
    assert should_include_usage(forwarded.stream_options, False)[0] is True


@pytest.mark.parametrize("endpoint", list(MODELS))
@pytest.mark.parametrize("value", PRIORITIES)
def test_priority_is_bounded_as_vllm_reads_it(endpoint: Endpoint, value: Any) -> None:
    """A tenant's key sends a priority within its bounds as vLLM reads it ("6" and 6.0
    are 6, true is 1); out of them, or one vLLM refuses, is a 400 naming ``priority``
    counted as the tenant's policy refusal. Without bounds (dev mode)
    the router passes any value on, vLLM's to judge, as before."""
    vllm = vllm_reads(endpoint, {"priority": value})
    for tenant in (ACME, BETA):
        router = router_reads(endpoint, {"priority": value}, tenant)
        low, high = tenant.priority_range  # type: ignore[misc]
        if vllm is not None and low <= vllm.priority <= high:
            assert not isinstance(router, BadRequest), router.message
            assert router.body["priority"] == value
            continue
        assert isinstance(router, BadRequest) and router.param == "priority", router
        assert router.status == 400
        assert router.rejection == PRIORITY_REJECTION
    router = router_reads(endpoint, {"priority": value}, DEV)
    assert not isinstance(router, BadRequest) and router.body["priority"] == value


def test_the_refusal_says_what_the_key_may_send() -> None:
    refused = router_reads(Endpoint.CHAT, {"priority": -1}, ACME)
    assert isinstance(refused, BadRequest)
    assert "may not set 'priority'" in refused.message and "or 0" in refused.message
    refused = router_reads(Endpoint.CHAT, {"priority": 9}, BETA)
    assert isinstance(refused, BadRequest) and "from -5 to 5" in refused.message
    assert not isinstance(router_reads(Endpoint.CHAT, {}, ACME), BadRequest)
