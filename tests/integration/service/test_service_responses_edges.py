"""Edges of the Responses API through the router, against the stand-in workers of
test_service_responses_api.py (vLLM 0.32's shapes): a client leaving a streamed GET,
``n`` (which vLLM's Responses API ignores), and background responses of a tenant with
an in-flight cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import router_settings, running_router, sample, scrape, serving
from pydantic import ValidationError
from test_service_responses_api import ResponsesStub, create
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.exceptions import VLLMClientError

from kvhint.router.service.request_fields import runs_in_background


@pytest.fixture
async def stubs(tiny_model_dir: Path) -> AsyncIterator[list[ResponsesStub]]:
    async with serving([ResponsesStub(str(tiny_model_dir))]) as workers:
        yield workers


BACKGROUND_VALUES: list[Any] = [True, False, None, "true", "false", "1", "0", 1, 0, "yes",
                                "no", "on", "off", "maybe", 2, [], {}]


@pytest.mark.parametrize("value", BACKGROUND_VALUES)
def test_the_router_reads_background_as_vllm_does(value: Any) -> None:
    """vLLM 0.32 runs a response in the background as its ``ResponsesRequest`` reads
    ``background`` (pydantic's lax bool); one it refuses is its own 400, whatever the
    router read."""
    try:
        request = ResponsesRequest.model_validate({"input": "x", "background": value})
    except (ValidationError, VLLMClientError):
        return
    assert runs_in_background({"background": value}) is bool(request.background)
    assert runs_in_background({}) is False


async def test_a_client_leaving_a_streamed_get_is_counted_as_gone(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    """``GET /v1/responses/{id}?stream=true`` on a background response still queued: a
    client that leaves while the worker has nothing to send is a 499, not a worker's
    failure (the router closed the worker's stream itself)."""
    stub = stubs[0]
    stub.mode = "background"
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        response_id = (await client.post(url, json=create(background=True))).json()["id"]
        async with client.stream("GET", f"{url}/{response_id}?stream=true") as streamed:
            assert streamed.status_code == 200
            first = await anext(streamed.aiter_raw())
            assert b"response.created" in first
        name = "kvhint_router_response_id_requests_total"
        for _ in range(100):  # the router notices the client gone, then counts it
            samples = await scrape(client, router.url)
            counted = {code: sample(samples, name, op="get", code=code)
                       for code in ("499", "502")}
            if any(counted.values()):
                break
            await asyncio.sleep(0.05)
        assert counted == {"499": 1, "502": None}


async def test_n_is_not_parallel_sampling_on_responses(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    """vLLM 0.32's ResponsesRequest has no ``n`` nor ``best_of`` (extra fields are
    allowed and ignored): one output whatever they say. The router's bound on parallel
    sampling (routing.max_n) refuses nothing there, and the usage is checked against the
    prediction as for any single-sample request."""
    stub = stubs[0]
    settings = router_settings(tmp_path, [("w0", stub.url)], routing={"max_n": 2})
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        answer = await client.post(url, json=create(n=8, best_of=8, session_id="s1"))
        assert answer.status_code == 200, answer.text
        assert stub.received[-1]["n"] == 8  # passed on as it came: vLLM ignores it
        assert (await client.post(url, json=create(n=2, session_id="s2"))).status_code == 200
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_drops_total",
                      what="cached_prediction_unchecked:parallel_sampling") is None
        assert sample(samples, "kvhint_router_cached_tokens_actual_total", worker="w0",
                      predicted="true") == 64


async def test_a_tenant_with_an_in_flight_cap_starts_no_background_response(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    """A background response is answered queued and runs on its worker after the
    router's request ended, its tenant slot given back: a tenant capped at
    ``max_in_flight`` could queue any number of them. Refused for a capped tenant
    (400, as vLLM words its own refusals of ``background``), sent nowhere, counted; a
    tenant without a cap starts them as before, and so does the capped one without."""
    stub = stubs[0]
    stub.mode = "background"
    tenants = [{"name": "acme", "api_keys": ["ka"], "max_in_flight": 2},
               {"name": "beta", "api_keys": ["kb"]}]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=tenants)
    acme, beta = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        for flag in (True, "true", 1):
            refused = await client.post(url, json=create(background=flag, stream=True),
                                        headers=acme)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "background" and "max_in_flight" in error["message"]
        assert stub.received == []
        for flag in (False, "false", 0, None):  # vLLM reads these as no background
            stub.mode = "ok"
            assert (await client.post(url, json=create(background=flag),
                                      headers=acme)).status_code == 200
        stub.mode = "background"
        queued = await client.post(url, json=create(background=True), headers=beta)
        assert queued.status_code == 200 and queued.json()["status"] == "queued"
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="acme",
                      reason="background_over_cap") == 3
        assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                      worker="none", code="400") == 3


async def test_a_stream_that_breaks_after_its_terminal_event_was_answered(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    """A worker whose connection breaks once response.completed is relayed (before its
    stream's own end): the client has the whole answer; nothing is added after it, and
    the turn counts as answered (its tool gap opened), not as a broken 502."""
    stub = stubs[0]
    stub.mode = "die_after_end"
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        async with client.stream("POST", url, json=create(
                stream=True, session_id="agent")) as streamed:
            text = (await streamed.aread()).decode()
        kinds = [block.split("\n", 1)[0] for block in text.split("\n\n") if block]
        assert kinds[-1] == "event: response.completed", kinds
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                      worker="w0", code="200") == 1
        assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") is None
        session = (await client.get(f"{router.url}/admin/sessions/default/agent")).json()
        assert session["turns"] == 1 and session["prompt_tokens"] == 40
