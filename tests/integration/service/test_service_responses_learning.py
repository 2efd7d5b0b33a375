"""What the router remembers of the responses it relays (responses_ids.py): only those
vLLM stores, ``store`` read as vLLM 0.32 reads it (pydantic's lax bool: "false", 0, "off"
and null store nothing), checked against vLLM's own ``ResponsesRequest``; and, within
``responses.max_ids``, one tenant's churn of stored responses never makes the router
forget another tenant's, whose follow-ups naming no session keep continuing theirs.

Stand-in workers answer in vLLM 0.32's shapes (test_service_responses_api.py); this one
reads the request with vLLM's own model, as vLLM's api_router does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from conftest import router_settings, running_router, sample, scrape
from pydantic import ValidationError
from test_service_responses_api import TENANTS, ResponsesStub, create
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.exceptions import VLLMClientError

from kvhint.router.service.request_fields import stores_response

ACME, BETA = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}


def vllm_stores(body: dict[str, Any]) -> bool | None:
    """Whether vLLM 0.32 stores the response ``body`` asks for; None: it refuses the body
    (a 400). responses/serving.py keeps it when ``request.store`` (forced False on a
    server without VLLM_ENABLE_RESPONSES_API_STORE, where nothing is stored anyway) and
    keeps every background response, queued, whatever ``store`` says."""
    try:
        request = ResponsesRequest.model_validate({"input": "x", **body})
    except (ValidationError, VLLMClientError):
        return None
    return bool(request.store) or bool(request.background)


class VllmReadingStub(ResponsesStub):
    """A worker that reads each request with vLLM's own ``ResponsesRequest``: refused as
    vLLM refuses it (400), stored as vLLM stores it."""

    def stores(self, body: dict[str, Any]) -> bool:
        return bool(vllm_stores(body))

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if vllm_stores(body) is None:
            self.received.append(body)
            return web.json_response({"error": {
                "message": "1 validation error for ResponsesRequest",
                "type": "BadRequestError", "param": None, "code": 400}}, status=400)
        return await super()._create(request)


@pytest.fixture
async def stub(tiny_model_dir: Path) -> AsyncIterator[VllmReadingStub]:
    worker = VllmReadingStub(str(tiny_model_dir))
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


STORE_VALUES: list[Any] = [
    True, False, None, "false", "False", "FALSE", "0", 0, 0.0, "no", "off", "f", "n",
    "true", "1", 1, 1.0, "yes", "on", "t", "y", "maybe", "", " false", 2, 0.5, [], {}]


@pytest.mark.parametrize("background", ["absent", True, False, "false", None])
def test_the_router_reads_store_as_vllm_does(background: Any) -> None:
    """For every ``store`` (and ``background``) a client may send and vLLM accepts, the
    router thinks the response stored exactly when vLLM stores it. (A body vLLM refuses
    is answered 400 and nothing is learnt from it: the test below.)"""
    extra = {} if background == "absent" else {"background": background}
    accepted = 0
    for body in [extra] + [{"store": value, **extra} for value in STORE_VALUES]:
        if (stored := vllm_stores(body)) is not None:
            accepted += 1
            assert stores_response(body) == stored, body
    assert accepted >= 18


async def test_a_response_vllm_does_not_store_is_not_remembered(
        tmp_path: Path, stub: VllmReadingStub) -> None:
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        for value in ("false", 0, "off", "no", None):
            answer = await client.post(url, json=create(store=value, session_id="s1"))
            assert answer.status_code == 200, answer.text
        assert stub.store == {}  # the worker stored none of them
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_response_ids") == 0
        # A value vLLM refuses: its 400, nothing remembered.
        refused = await client.post(url, json=create(store="maybe", session_id="s1"))
        assert refused.status_code == 400
        stored = await client.post(url, json=create(store="true", session_id="s1"))
        assert stored.status_code == 200 and list(stub.store) == [stored.json()["id"]]
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_response_ids") == 1


async def test_one_tenants_stored_responses_leave_anothers_sessions_continued(
        tmp_path: Path, stub: VllmReadingStub) -> None:
    """``max_ids`` 4: beta's ten stored responses make the router forget beta's own
    oldest; acme's one response is still remembered with its session, so acme's
    follow-up naming no session continues it (before, one LRU over every tenant forgot
    acme's first and the follow-up continued no session)."""
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=TENANTS,
                               responses={"max_ids": 4})
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        made = await client.post(url, json=create(session_id="agent"), headers=ACME)
        assert made.status_code == 200, made.text
        for _ in range(10):
            assert (await client.post(url, json=create(), headers=BETA)).status_code == 200
        follow = await client.post(url, json=create(previous_response_id=made.json()["id"]),
                                   headers=ACME)
        assert follow.status_code == 200, follow.text
        assert stub.received[-1].get("session_id") == "acme/agent"
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_drops_total",
                      what="response_session_unknown") is None
        assert sample(samples, "kvhint_router_response_ids_read_total") == 0
        # 1 + 10 + the follow-up learnt, 4 kept: beta gave up 7, then acme (holding as
        # many as beta, 2, once the follow-up was learnt) one of its own.
        assert sample(samples, "kvhint_router_response_ids_evicted_total") == 8
        assert sample(samples, "kvhint_router_response_ids") == 4
