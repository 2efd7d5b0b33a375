"""A tenant's bounds on ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
through the real router, and the end of a GET's stream its worker breaks, against the
stand-in workers of test_service_responses_api.py (vLLM 0.32's shapes).

Before, neither went through any per-tenant bound: a tenant could hold any number of
streamed GETs open on workers, past its ``max_in_flight``, and send GETs and cancels
without any rate; and a GET's stream cut by its worker ended with no terminal event
(where a POST's ends with ``response.failed``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from conftest import router_settings, running_router, sample, scrape, serving
from pydantic import TypeAdapter, ValidationError
from test_service_responses_api import ResponsesStub, create, events

from kvhint.router.service.responses_api import _asks_stream


class BreakingStub(ResponsesStub):
    """A worker whose GET stream dies after its first event (a crash, a proxy's cut):
    what a real server cannot be made to do on cue."""

    async def _get(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["id"]
        if request.query.get("stream") != "true" or response_id not in self.store:
            return await super()._get(request)
        stream = await self._stream_created(request, response_id)
        await asyncio.sleep(0.1)  # the event reaches the router first
        request.transport.close()  # type: ignore[union-attr]
        return stream


@pytest.fixture
async def stubs(tiny_model_dir: Path) -> AsyncIterator[list[ResponsesStub]]:
    async with serving([ResponsesStub(str(tiny_model_dir)),
                        BreakingStub(str(tiny_model_dir))]) as workers:
        yield workers


ACME = {"Authorization": "Bearer ka"}
STREAM_VALUES = ["true", "TRUE", "1", "yes", "on", "t", "y", "false", "False", "0", "off",
                 "f", "n", "no", " no", "maybe", ""]


@pytest.mark.parametrize("value", STREAM_VALUES)
def test_a_get_streams_as_vllm_reads_its_stream_query(value: str) -> None:
    """vLLM's GET reads ``?stream=`` as a bool (pydantic's lax one): whatever it may
    stream takes a slot; what it reads as false is a plain GET (the call rate's); what
    it refuses (its 422 at once) takes a slot, given back with that answer."""
    try:
        streams = TypeAdapter(bool).validate_python(value)
    except ValidationError:
        streams = True
    assert _asks_stream(value) is streams
    assert _asks_stream(None) is False


async def _in_flight(client: httpx.AsyncClient, url: str, tenant: str) -> float | None:
    return sample(await scrape(client, url), "kvhint_router_tenant_in_flight", tenant=tenant)


async def test_a_streamed_get_takes_one_of_its_tenants_in_flight_slots(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    """A streamed GET holds its worker's connection while the response lasts: it takes a
    ``max_in_flight`` slot as an inference request does, given back at its end. Past the
    cap a GET is a 429 with ``Retry-After`` sent nowhere, and so is an inference request
    while the GET holds the slot."""
    stub = stubs[0]
    tenants = [{"name": "acme", "api_keys": ["ka"], "max_in_flight": 1}]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=tenants)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        response_id = (await client.post(url, json=create(), headers=ACME)).json()["id"]
        async with client.stream("GET", f"{url}/{response_id}?stream=true",
                                 headers=ACME) as held:
            assert held.status_code == 200
            chunks = held.aiter_raw()  # kept: a dropped iterator closes the stream
            assert b"response.created" in await anext(chunks)
            assert await _in_flight(client, router.url, "acme") == 1
            fetched = len(stub.fetched)
            for value in ("true", "1", "yes", "on"):  # vLLM's lax bool: each streams
                refused = await client.get(f"{url}/{response_id}?stream={value}",
                                           headers=ACME)
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
                error = refused.json()["error"]
                assert error["type"] == "rate_limit_error"
                assert "max_in_flight" in error["message"]
            assert len(stub.fetched) == fetched  # none sent
            blocked = await client.post(url, json=create(), headers=ACME)
            assert blocked.status_code == 429, blocked.text
            # A plain GET is a short call (the call rate's), no slot: it passes.
            plain = await client.get(f"{url}/{response_id}?stream=false", headers=ACME)
            assert plain.status_code == 200, plain.text
        for _ in range(100):  # the router notices the client gone, gives the slot back
            if await _in_flight(client, router.url, "acme") == 0:
                break
            await asyncio.sleep(0.05)
        assert await _in_flight(client, router.url, "acme") == 0
        again = await client.get(f"{url}/{response_id}", headers=ACME)  # whole: no slot
        assert again.status_code == 200
        assert (await client.post(url, json=create(), headers=ACME)).status_code == 200
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="acme",
                      reason="over_in_flight") == 5
        assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                      code="429") == 4
        assert sample(samples, "kvhint_router_tenant_in_flight", tenant="acme") == 0


async def test_plain_gets_and_cancels_are_charged_to_the_tenants_call_rate(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    """A plain GET and a cancel each take one of the tenant's ``api_calls``; past it a
    429 with ``Retry-After``, sent nowhere, counted. Another tenant's go on; an
    inference request and a streamed GET (an in-flight slot instead) are not charged."""
    stub = stubs[0]
    tenants = [{"name": "acme", "api_keys": ["ka"],
                "api_calls": {"per_s": 0.5, "burst": 3}},
               {"name": "beta", "api_keys": ["kb"]}]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=tenants)
    beta = {"Authorization": "Bearer kb"}
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        ids = [(await client.post(url, json=create(), headers=h)).json()["id"]
               for h in (ACME, beta)]
        assert (await client.get(f"{url}/{ids[0]}", headers=ACME)).status_code == 200
        assert (await client.get(f"{url}/{ids[0]}?stream=0", headers=ACME)).status_code == 200
        cancel = await client.post(f"{url}/{ids[0]}/cancel", headers=ACME | {
            "Content-Type": "application/json"})
        assert cancel.status_code == 400, cancel.text  # a synchronous one: vLLM's 400
        fetched = len(stub.fetched)
        refused = [await client.get(f"{url}/{ids[0]}", headers=ACME),
                   await client.post(f"{url}/{ids[0]}/cancel", headers=ACME | {
                       "Content-Type": "application/json"}),
                   await client.get(f"{url}/not-an-id", headers=ACME)]
        for answer in refused:
            assert answer.status_code == 429, answer.text
            assert answer.headers["retry-after"] in ("1", "2"), answer.headers
            error = answer.json()["error"]
            assert error["type"] == "rate_limit_error" and "api_calls" in error["message"]
        assert len(stub.fetched) == fetched
        assert (await client.get(f"{url}/{ids[1]}", headers=beta)).status_code == 200
        assert (await client.post(url, json=create(), headers=ACME)).status_code == 200
        async with client.stream("GET", f"{url}/{ids[0]}?stream=true",
                                 headers=ACME) as streamed:
            assert streamed.status_code == 200
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="acme",
                      reason="over_call_rate") == 3
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="beta",
                      reason="over_call_rate") == 0
        assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                      code="429") == 2
        assert sample(samples, "kvhint_router_response_id_requests_total", op="cancel",
                      code="429") == 1
        await asyncio.sleep(2.1)  # a token back
        assert (await client.get(f"{url}/{ids[0]}", headers=ACME)).status_code == 200


@pytest.mark.parametrize("case", ["broken", "silent"])
async def test_a_get_stream_its_worker_cuts_ends_with_response_failed(
        tmp_path: Path, stubs: list[ResponsesStub], case: str) -> None:
    """A GET's stream whose worker breaks (or sends nothing for ``request_timeout_s``)
    mid-way ends as a POST's does: ``response.failed`` on the response its
    ``response.created`` announced, numbered after it, counted as a broken response;
    the tenant's slot comes back."""
    stub = stubs[1] if case == "broken" else stubs[0]
    tenants = [{"name": "acme", "api_keys": ["ka"], "max_in_flight": 1}]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=tenants,
                               request_timeout_s=1.0)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        response_id = (await client.post(url, json=create(), headers=ACME)).json()["id"]
        async with client.stream("GET", f"{url}/{response_id}?stream=true",
                                 headers=ACME) as streamed:
            assert streamed.status_code == 200
            got = events((await streamed.aread()).decode())
        assert [kind for kind, _ in got] == ["response.created", "response.failed"], got
        failed = got[-1][1]
        assert failed["sequence_number"] == 1
        assert failed["response"]["id"] == response_id
        assert failed["response"]["status"] == "failed"
        code = "502" if case == "broken" else "504"
        assert failed["response"]["error"]["code"] == "server_error"
        assert f"HTTP {code}" in failed["response"]["error"]["message"]
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                      code=code) == 1
        assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") == 1
        assert sample(samples, "kvhint_router_tenant_in_flight", tenant="acme") == 0
