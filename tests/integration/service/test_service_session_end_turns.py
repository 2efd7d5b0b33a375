"""``X-Session-End`` on a turn that fails, against stub workers (the fault on cue: a worker's
error status, a stream that breaks after its first event; tests/e2e/service runs real
vLLM): an agent whose last turn failed retries it, so the session must still be open."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from conftest import StubWorker, router_settings, running_router, sample, scrape
from kvhint.router.service.metric_labels import SESSION_END_SKIPS

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
END = {"x-session-id": "agent-1", "x-session-end": "true"}
SKIPS = "kvhint_router_session_end_skips_total"
BROKEN = "kvhint_router_broken_responses_total"


async def test_a_failed_turn_does_not_end_its_session_and_the_retry_does(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A turn with ``X-Session-End`` that the worker refuses (4xx), fails (5xx), or whose
    stream breaks mid-way (the client gets an error event) leaves the session open,
    counted in session_end_skips_total by reason; the retry that succeeds ends it.
    Before, every one of them ended the session. None of them counts in the session's
    ``turns`` (before, each did: a refused prompt retried counted twice), nor in the
    planner's depth (before, each deepened the session's later turns)."""
    stub = stub_workers[0]
    async with _session_on(tmp_path, stub) as (router, client, url, record):
        for mode, stream, code, reason in (("status:400", False, 400, "refused"),
                                           ("status:500", False, 500, "failed"),
                                           ("die_mid_stream", True, 200, "failed")):
            stub.mode = mode
            before = sample(await scrape(client, router.url), SKIPS, reason=reason)
            answer = await client.post(url, json={**CHAT, "stream": stream}, headers=END)
            assert answer.status_code == code, (mode, answer.text)
            if stream:
                assert "worker failed mid-stream" in answer.text
            assert record.state == "active", mode
            after = sample(await scrape(client, router.url), SKIPS, reason=reason)
            assert after == before + 1, (mode, before, after)
            assert record.turns == 1 and record.plan.turns == 1, mode
        # What an operator reads: the answered turns, not the attempts.
        admin = f"{router.url}/admin/sessions/default/agent-1"
        assert (await client.get(admin)).json()["turns"] == 1
        stub.mode = "ok"
        skipped = _skips(await scrape(client, router.url))
        retried = await client.post(url, json={**CHAT, "stream": True}, headers=END)
        assert retried.status_code == 200 and "[DONE]" in retried.text
        assert record.state == "ended" and record.turns == record.plan.turns == 2
        assert (await client.get(admin)).json()["turns"] == 2
        assert _skips(await scrape(client, router.url)) == skipped


async def test_a_stream_carrying_the_workers_error_event_is_a_failed_turn(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """vLLM reports a generation that fails once its stream has begun (the 200 sent) as
    an error event, then ``[DONE]``, the stream ending cleanly. That turn failed: the
    client gets the stream as it came, its ``X-Session-End`` is skipped and counted by
    the error's code (500: failed; 400: refused), as is the request in requests_total,
    the session's ``turns`` leaves it out, and the retry that succeeds ends the session.
    Before, it was a 200 whole: it ended the session, and counted as answered. It is a
    broken response, as a stream that breaks is (before, counted in requests_total
    only)."""
    stub = stub_workers[0]
    async with _session_on(tmp_path, stub) as (router, client, url, record):
        for broken, (code, reason) in enumerate(((500, "failed"), (400, "refused")), 1):
            stub.mode = f"error_event:{code}"
            before = sample(await scrape(client, router.url), SKIPS, reason=reason)
            answer = await client.post(url, json={**CHAT, "stream": True}, headers=END)
            assert answer.status_code == 200
            assert f'"code": {code}' in answer.text, answer.text
            assert answer.text.endswith("data: [DONE]\n\n"), answer.text
            assert record.state == "active" and record.turns == 1, code
            samples = await scrape(client, router.url)
            assert sample(samples, SKIPS, reason=reason) == before + 1, code
            assert sample(samples, "kvhint_router_requests_total", code=str(code),
                          endpoint="chat", worker="w0") == 1
            assert sample(samples, BROKEN, worker="w0") == broken
        stub.mode = "ok"
        retried = await client.post(url, json={**CHAT, "stream": True}, headers=END)
        assert retried.status_code == 200 and "[DONE]" in retried.text
        assert record.state == "ended" and record.turns == 2


async def test_an_error_event_without_done_fails_the_turn_and_nothing_hangs(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A worker that ends its stream at its error event, sending no ``[DONE]``: the client
    gets every byte, the turn fails by the error's code (requests_total, a broken
    response, the end skipped as failed, no turn counted). A client that leaves at the
    error event, as the OpenAI SDKs do (they raise at it), while the worker's stream
    stays open, got its answer, the error: the turn is settled at once, by the error's
    code too, not as a client gone (before, a 499 and a client_gone skip)."""
    stub = stub_workers[0]
    stub.mode = "error_event_no_done:500"
    async with _session_on(tmp_path, stub) as (router, client, url, record):
        answer = await client.post(url, json={**CHAT, "stream": True}, headers=END,
                                   timeout=5.0)
        assert answer.status_code == 200
        assert answer.text.endswith('"code": 500}}\n\n'), answer.text
        assert "[DONE]" not in answer.text
        assert record.inflight == 0 and record.state == "active" and record.turns == 1
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_requests_total", code="500",
                      endpoint="chat", worker="w0") == 1
        assert sample(samples, BROKEN, worker="w0") == 1
        assert sample(samples, SKIPS, reason="failed") == 1

        stub.linger_after_done_s = 6.0  # the worker's stream stays open past the error
        async with client.stream("POST", url, json={**CHAT, "stream": True},
                                 headers=END) as response:
            async for line in response.aiter_lines():
                if line.startswith('data: {"error"'):
                    break  # the SDK raises here, and closes the stream
        started = time.monotonic()
        while record.inflight and time.monotonic() - started < 3.0:
            await asyncio.sleep(0.05)
        assert record.inflight == 0  # settled long before the worker's end
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_requests_total", code="500",
                      endpoint="chat", worker="w0") == 2
        assert sample(samples, "kvhint_router_requests_total", code="499",
                      endpoint="chat", worker="w0") is None
        assert sample(samples, BROKEN, worker="w0") == 2
        assert sample(samples, SKIPS, reason="failed") == 2
        assert record.state == "active" and record.turns == 1


async def test_a_client_gone_mid_stream_does_not_end_its_session(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A client that hangs up mid-stream (httpx closing the response after its first
    event, while the worker is silent) did not get its answer: the router closes the
    worker's response at once, counts a 499, and skips the turn's ``X-Session-End``
    (client_gone); the retry that gets its whole answer ends the session."""
    stub = stub_workers[0]
    async with _session_on(tmp_path, stub) as (router, client, url, record):
        before = sample(await scrape(client, router.url), SKIPS, reason="client_gone")
        stub.chunk_gap_s = 6.0  # silent after the first event: the client leaves then
        async with client.stream("POST", url, json={**CHAT, "stream": True},
                                 headers=END) as response:
            async for _line in response.aiter_lines():
                break  # the first event, then the client hangs up
        started = time.monotonic()
        while record.inflight and time.monotonic() - started < 3.0:
            await asyncio.sleep(0.05)
        assert record.inflight == 0  # settled long before the worker's next event
        samples = await scrape(client, router.url)
        assert sample(samples, SKIPS, reason="client_gone") == before + 1
        assert sample(samples, "kvhint_router_requests_total", code="499",
                      endpoint="chat", worker="w0") == 1
        assert record.state == "active" and record.turns == 1
        stub.chunk_gap_s = 0.0
        retried = await client.post(url, json={**CHAT, "stream": True}, headers=END)
        assert retried.status_code == 200 and "[DONE]" in retried.text
        assert record.state == "ended" and record.turns == 2


def _skips(samples: dict) -> dict[str, float | None]:
    return {reason: sample(samples, SKIPS, reason=reason)
            for reason in SESSION_END_SKIPS}


@asynccontextmanager
async def _session_on(tmp_path: Path, stub: StubWorker
                      ) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str, Any]]:
    """A router over ``stub`` and its session ``agent-1`` after one answered turn:
    (router, client, the chat URL, the session's record)."""
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = f"{router.url}/v1/chat/completions"
        assert (await client.post(url, json=CHAT, headers={"x-session-id": "agent-1"})
                ).status_code == 200
        yield router, client, url, router.runtime.sessions.get("default", "agent-1")
