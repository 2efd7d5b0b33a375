"""The gateway's limits on a worker's answer: a slow worker is neither a dead one nor one to
run the request again on (``request_timeout_s`` bounds its silence, not its answer's
length), and a client that leaves before its worker answers is noticed at once, streamed
or not. Stub workers: the timings are exact here, a real worker's are not."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from aiohttp import web

from conftest import StubWorker, router_settings, running_router

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}


@dataclass
class PacedWorker(StubWorker):
    """Answers once its headers are out: a stream of ``events`` content events
    ``event_gap_s`` apart, the first ``first_event_after_s`` after the headers; a
    non-streamed answer in two halves ``event_gap_s`` apart."""

    events: int = 5
    event_gap_s: float = 0.0
    first_event_after_s: float = 0.0

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        if self.answer_delay_s:
            await asyncio.sleep(self.answer_delay_s)
        response = web.StreamResponse(headers={"Content-Type": (
            "text/event-stream" if body.get("stream") else "application/json")})
        await response.prepare(request)
        await asyncio.sleep(self.first_event_after_s)
        if not body.get("stream"):
            whole = json.dumps({"id": "x", "object": "chat.completion", "model": "stub",
                                "choices": [{"index": 0, "message": self._message(),
                                             "finish_reason": "stop"}]}).encode()
            await response.write(whole[:10])
            await asyncio.sleep(self.event_gap_s)
            await response.write(whole[10:])
            await response.write_eof()
            return response
        for number in range(self.events):
            if number:
                await asyncio.sleep(self.event_gap_s)
            event = {"choices": [{"index": 0, "delta": {"content": f"t{number}"},
                                  "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _metric(client: httpx.AsyncClient, url: str, prefix: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def _requests(code: int, worker: str | None = None) -> str:
    prefix = f'kvhint_router_requests_total{{code="{code}",endpoint="chat",worker='
    return prefix + (f'"{worker}"}}' if worker is not None else "")


async def _until_idle(router, worker_ids: list[str], within_s: float) -> float:  # noqa: ANN001
    started = time.monotonic()
    workers = [router.runtime.workers.get(w) for w in worker_ids]
    while any(w.inflight for w in workers) and time.monotonic() - started < within_s:
        await asyncio.sleep(0.02)
    assert not any(w.inflight for w in workers)
    return time.monotonic() - started


async def test_a_worker_slower_than_the_request_timeout_is_a_504_not_a_worker_down(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """vLLM sends a non-streamed answer's headers only once the whole completion is done
    (a stream's once its prefill is). A worker that has the request but takes longer than
    ``request_timeout_s`` to start answering is busy, not dead, and may still be running
    it: the client gets a 504, the worker stays up, and the request is not run a second
    time on another worker. Before, it was marked down, the request was rerun on the
    next worker (which timed out too), the client got a 502 and the fleet was
    unroutable until the health probe."""
    for stub in stub_workers:
        stub.answer_delay_s = 0.8
    settings = router_settings(tmp_path, [("wa", stub_workers[0].url),
                                          ("wb", stub_workers[1].url)],
                               request_timeout_s=0.4, health_probe_s=30.0)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
        for stream in (False, True):
            response = await client.post(f"{router.url}/v1/chat/completions",
                                         json={**CHAT, "stream": stream})
            assert response.status_code == 504, response.text
            error = response.json()["error"]
            assert error["code"] == 504 and "request_timeout_s" in error["message"]
        # Each request reached one worker, once.
        assert len(stub_workers[0].received) + len(stub_workers[1].received) == 2
        await _until_idle(router, ["wa", "wb"], within_s=2.0)
        for worker in router.runtime.workers.all():
            assert worker.http_up and worker.http_failures == 0, worker.worker_id
        assert await _metric(client, router.url, _requests(504)) == 2
        assert await _metric(client, router.url, _requests(502)) == 0
        assert await _metric(client, router.url, "kvhint_router_retries_total") == 0
        # The fleet is still routable: a prompt answer goes through at once.
        for stub in stub_workers:
            stub.answer_delay_s = 0.0
        response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert response.status_code == 200


async def test_a_stream_longer_than_the_request_timeout_is_not_cut(tmp_path: Path) -> None:
    """``request_timeout_s`` bounds a worker's silence, not its answer's length: a healthy
    stream whose events come well within it runs to its end however long it lasts in all.
    Before, one total timeout covered the whole response and cut the stream with a 502
    error event."""
    stub = PacedWorker(events=6, event_gap_s=0.2)
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)], request_timeout_s=0.5)
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=10) as client:
            started = time.monotonic()
            async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                     json={**CHAT, "stream": True}) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line]
            assert time.monotonic() - started > 0.9  # longer than the timeout, twice over
            assert lines[-1] == "data: [DONE]"
            assert not any('"error"' in line for line in lines)
            assert sum('"content": "t' in line for line in lines) == 6
            await _until_idle(router, ["w0"], within_s=1.0)
            assert await _metric(client, router.url, _requests(200, "w0")) == 1
    finally:
        await stub.stop()


async def test_a_worker_silent_past_the_request_timeout_mid_answer_is_a_504(
        tmp_path: Path) -> None:
    """A worker that started its answer and then sends nothing for ``request_timeout_s``:
    a stream ends with an OpenAI-style error event, a non-streamed answer is an error
    response, both code 504 (a timeout, not a broken worker), counted as 504 and as a
    broken response; the worker stays up."""
    stub = PacedWorker(events=3, event_gap_s=1.0)
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)], request_timeout_s=0.4)
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=10) as client:
            async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                     json={**CHAT, "stream": True}) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line]
            assert '"t0"' in lines[0]
            error = json.loads(lines[-1].removeprefix("data: "))["error"]
            assert error["code"] == 504 and "request_timeout_s" in error["message"]
            response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 504
            assert response.json()["error"]["code"] == 504
            await _until_idle(router, ["w0"], within_s=1.0)
            assert await _metric(client, router.url, _requests(504, "w0")) == 2
            assert await _metric(
                client, router.url, 'kvhint_router_broken_responses_total{worker="w0"}') == 2
            worker = router.runtime.workers.get("w0")
            assert worker.http_up and worker.http_failures == 0
    finally:
        await stub.stop()


async def test_a_worker_that_does_not_accept_in_time_is_still_down_and_skipped(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A connect timeout sends nothing, so it stays a worker down and a retry on the
    next one. The listener below never accepts and its backlog is full: the kernel
    drops further connection attempts, which then time out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):  # fill the accept queue (its length is backlog + 1)
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        await asyncio.sleep(0.1)
        alive = stub_workers[1]
        settings = router_settings(tmp_path, [("stuck", f"http://127.0.0.1:{port}"),
                                              ("w1", alive.url)],
                                   connect_timeout_s=0.3, health_probe_s=30.0)
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=10) as client:
            for number in range(2):
                response = await client.post(f"{router.url}/v1/chat/completions",
                                             json={**CHAT, "session_id": f"s{number}"})
                assert response.status_code == 200
                assert response.headers["x-kvhint-worker"] == "w1"
            stuck = router.runtime.workers.get("stuck")
            assert not stuck.http_up and stuck.http_failures >= 1
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_a_streaming_client_that_leaves_before_its_worker_answers_is_noticed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A streaming client gives up while its worker has not sent its headers yet (a
    queue, a long prefill): the request to the worker is closed at once (vLLM aborts
    it), the worker's in-flight slot freed and the request counted as 499. Before, a
    stream had no watcher until its response started: the router waited for the worker,
    then relayed to nobody and counted a 200."""
    stub = stub_workers[0]
    stub.answer_delay_s = 3.0
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        try:
            await client.post(f"{router.url}/v1/chat/completions",
                              json={**CHAT, "stream": True}, timeout=0.5)
        except httpx.TimeoutException:
            pass
        assert await _until_idle(router, ["w0"], within_s=1.0) < 1.0
        await asyncio.sleep(0.1)  # let the worker's side settle
        assert await _metric(client, router.url, _requests(499)) == 1
        assert await _metric(client, router.url, _requests(200)) == 0


async def test_a_streaming_client_that_leaves_before_the_first_event_is_a_499(
        tmp_path: Path) -> None:
    """The worker has sent its headers (the router its own) but no event yet when the
    client leaves: the worker's response is closed at once and the request counted as
    499, never as the 200 the worker's status line said."""
    stub = PacedWorker(first_event_after_s=3.0)
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            for _ in range(3):
                async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                         json={**CHAT, "stream": True}) as response:
                    assert response.status_code == 200  # headers only, then leave
                assert await _until_idle(router, ["w0"], within_s=1.0) < 1.0
            await asyncio.sleep(0.1)
            assert await _metric(client, router.url, _requests(499, "w0")) == 3
            assert await _metric(client, router.url, _requests(200)) == 0
    finally:
        await stub.stop()
