"""Tenant limits through the router's HTTP front (real tokenizer, stub workers): a tenant's
requests in flight (``tenants[].max_in_flight``) and sessions in memory
(``tenants[].max_sessions``) bound that tenant alone, and ``n`` > 1 is bounded and read
per completion."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, sample, scrape, usage
from feed_helpers import until

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
TENANTS = [{"name": "acme", "api_keys": ["ka"], "max_in_flight": 1, "max_sessions": 2},
           {"name": "beta", "api_keys": ["kb"]}]
ACME = {"Authorization": "Bearer ka"}
BETA = {"Authorization": "Bearer kb"}
URL = "{}/v1/chat/completions".format


async def test_a_tenant_past_its_max_in_flight_gets_429_and_others_go_on(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A request past its tenant's max_in_flight is a 429 naming the limit, with
    Retry-After, counted; another tenant's requests are not held back. The slot comes
    back however the request ends: answered, a worker's error, a stream's end, a client
    that leaves mid-stream. Before, a tenant could take every slot the router had."""
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        forwarder = router.runtime.forwarder
        held = lambda: forwarder.slots.held("acme")  # noqa: E731
        stub.answer_delay_s = 0.5
        first = asyncio.create_task(client.post(URL(router.url), json=CHAT, headers=ACME))
        await until(lambda: held() == 1)
        refused = await client.post(URL(router.url), json=CHAT, headers=ACME)
        other = await client.post(URL(router.url), json=CHAT, headers=BETA)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert "max_in_flight" in error["message"] and "'acme'" in error["message"]
        assert error["type"] == "rate_limit_error"
        assert other.status_code == 200  # another tenant: no cap of its own
        assert (await first).status_code == 200
        assert held() == 0
        stub.answer_delay_s = 0.0
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_gateway_rejections_total",
                      tenant="acme", reason="over_in_flight") == 1
        assert sample(samples, "kvhint_router_gateway_rejections_total",
                      tenant="beta", reason="over_in_flight") == 0
        assert sample(samples, "kvhint_router_requests_total", endpoint="chat",
                      worker="none", code="429") == 1

        stub.mode = "status:500"  # a worker's error
        assert (await client.post(URL(router.url), json=CHAT, headers=ACME)).status_code == 500
        assert held() == 0
        stub.mode = "ok"
        async with client.stream("POST", URL(router.url), json={**CHAT, "stream": True},
                                  headers=ACME) as response:  # a stream to its end
            assert b"[DONE]" in await response.aread()
        await until(lambda: held() == 0)
        stub.chunk_gap_s = 5.0  # a client that leaves mid-stream
        async with client.stream("POST", URL(router.url), json={**CHAT, "stream": True},
                                 headers=ACME) as response:
            async for _chunk in response.aiter_bytes():
                break
        await until(lambda: held() == 0)
        stub.chunk_gap_s = 0.0
        assert (await client.post(URL(router.url), json=CHAT, headers=ACME)).status_code == 200


async def test_a_tenants_session_churn_evicts_only_its_own_and_is_counted(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        response = await client.post(URL(router.url), json={**CHAT, "session_id": "keep"},
                                     headers=BETA)
        assert response.status_code == 200
        for n in range(5):
            response = await client.post(URL(router.url), json={**CHAT, "session_id": f"a{n}"},
                                         headers=ACME)
            assert response.status_code == 200
        sessions = router.runtime.sessions
        assert sessions.count("acme") == 2 and sessions.get("beta", "keep") is not None
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_sessions_evicted_total", tenant="acme") == 3
        assert sample(samples, "kvhint_router_sessions_evicted_total", tenant="beta") == 0
        # An evicted session stays in the store: its next turn continues its history.
        assert sessions.get("acme", "a0") is None
        await router.runtime.writer.flush()
        response = await client.post(URL(router.url), json={**CHAT, "session_id": "a0"},
                                     headers=ACME)
        assert response.status_code == 200
        assert sessions.get("acme", "a0").turns == 2


class ChoicesStub(StubWorker):
    """Answers a whole (not streamed) request with ``n`` choices, as vLLM does: one usage,
    its completion_tokens the sum of every choice's (5 each)."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        n = body.get("n", 1)
        return web.json_response({
            "id": "x", "object": "chat.completion", "model": "stub",
            "choices": [{"index": i, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"} for i in range(n)],
            "usage": usage(self.prompt_tokens, 0, 5 * n)})


async def test_n_is_bounded_and_an_n_choice_answer_counts_one_completion(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """``n`` over routing.max_n is a 400 naming it, sent nowhere. Within it, the session
    and the trace take one completion's tokens (usage sums all n)."""
    stub = ChoicesStub(model_root=str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)],
                                   routing={"max_n": 4}, trace_dir=str(tmp_path / "traces"))
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            refused = await client.post(URL(router.url), json={**CHAT, "n": 5})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
            assert "routing.max_n" in refused.json()["error"]["message"]
            assert stub.received == []
            answered = await client.post(URL(router.url),
                                         json={**CHAT, "n": 4, "session_id": "s"})
            assert answered.status_code == 200 and len(answered.json()["choices"]) == 4
            record = router.runtime.sessions.get("default", "s")
            assert record.plan.context_tokens == stub.prompt_tokens + 5  # not + 20
            recorder = router.runtime.recorder
            await until(lambda: recorder.written == 1)
            line = json.loads(recorder.path.read_text().splitlines()[0])
            assert line["output_length"] == 5
    finally:
        await stub.stop()
