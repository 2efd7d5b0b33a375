"""Chat and completions streams that the worker closes cleanly without ``data: [DONE]``,
which the router ends itself with an OpenAI error event (relay_end.py ``RelayEnd.ended``):
vLLM always ends such a stream with ``[DONE]``, so one that ends without it was cut short
(a proxy, a dying worker). Before, the router passed it on as it was and the client's SDK
read the answer as complete.

A stand-in worker (the service tests' aiohttp StubWorker, ending its stream early): a
real vLLM server cannot be made to end a stream without ``[DONE]`` on demand."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, sample, scrape


class CutShortChat(StubWorker):
    """Streams a content delta and the choice's finish chunk, then ends the HTTP stream
    cleanly (its chunked end sent: no break) with no usage chunk and no ``[DONE]``;
    ``mid_event``: half of one more event first; ``pause_s``: that long before the end
    (a client may leave meanwhile)."""

    mid_event = False
    pause_s = 0.0

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in ({"choices": [{"index": 0, "delta": {"content": "hel"},
                                    "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {"content": "lo"},
                                    "finish_reason": "stop"}]}):
            await response.write(b"data: " + json.dumps({"id": "x", **chunk}).encode()
                                 + b"\n\n")
        if self.mid_event:
            await response.write(b'data: {"cut-here": ')
        if self.pause_s:
            await asyncio.sleep(self.pause_s)
        await response.write_eof()
        return response


def _events(text: str) -> list[str]:
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event.strip()]


@pytest.mark.parametrize(("path", "mid_event"), [("/v1/chat/completions", False),
                                                 ("/v1/chat/completions", True),
                                                 ("/v1/completions", True)])
async def test_a_stream_closed_without_done_ends_with_an_error_event(
        tmp_path: Path, path: str, mid_event: bool) -> None:
    """The client gets the deltas, the finish chunk the router held for the usage
    chunk's fingerprint, then an OpenAI error event (502) saying the stream was cut; an
    unfinished last event is dropped rather than passed on glued to it; the request is
    accounted as a 502 and counted as a broken response."""
    stub = CutShortChat()
    stub.mid_event = mid_event
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    body = ({"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
            if path.endswith("chat/completions") else {"model": "stub", "prompt": "hi"})
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{router.url}{path}",
                                     json={**body, "stream": True}) as streamed:
                assert streamed.status_code == 200
                text = (await asyncio.wait_for(streamed.aread(), 10)).decode()
            relayed = _events(text)
            assert len(relayed) == 3, text
            assert json.loads(relayed[1])["choices"][0]["finish_reason"] == "stop"
            error = json.loads(relayed[2])["error"]
            assert error["code"] == 502, error
            assert "without data: [DONE]" in error["message"]
            assert ("bytes dropped" in error["message"]) == mid_event
            assert "cut-here" not in text and "[DONE]" not in relayed
            # The OpenAI SDK raises at it; before, its stream ended as if complete.
            if path.endswith("chat/completions"):
                sdk = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x")
                seen = []
                with pytest.raises(openai.APIError, match="without data"):
                    async for chunk in await sdk.chat.completions.create(
                            model="stub", messages=body["messages"], stream=True):
                        seen.append(chunk)
                assert [c.choices[0].finish_reason for c in seen] == [None, "stop"]
                await sdk.close()
            calls = 2 if path.endswith("chat/completions") else 1
            endpoint = "chat" if path.endswith("chat/completions") else "completion"
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_broken_responses_total",
                          worker="w0") == calls
            assert sample(samples, "kvhint_router_requests_total", endpoint=endpoint,
                          worker="w0", code="502") == calls
            assert sample(samples, "kvhint_router_requests_total", endpoint=endpoint,
                          worker="w0", code="200") is None
    finally:
        await stub.stop()


async def test_a_client_that_left_before_the_cut_is_not_answered_an_error(
        tmp_path: Path) -> None:
    """A client gone before the worker's stream ended: 499, as before, nothing counted
    as broken (RelayEnd._settled); a stream ended with [DONE] is untouched."""
    stub = CutShortChat()
    stub.pause_s = 1.0
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    body = {"model": "stub", "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                     json=body) as streamed:
                async for _line in streamed.aiter_lines():
                    break  # the first event, then the client leaves
            await asyncio.sleep(stub.pause_s + 0.5)
            stub.pause_s = 0.0
            whole = StubWorker(model="stub")
            await whole.start()
            try:
                settings_whole = router_settings(tmp_path / "whole", [("w0", whole.url)])
                async with running_router(settings_whole) as other:
                    done = await client.post(f"{other.url}/v1/chat/completions", json=body)
                    assert done.status_code == 200
                    assert done.text.rstrip().endswith("data: [DONE]"), done.text
                    assert '"error"' not in done.text
                    other_samples = await scrape(client, other.url)
                    assert sample(other_samples, "kvhint_router_broken_responses_total",
                                  worker="w0") is None
            finally:
                await whole.stop()
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_requests_total", endpoint="chat",
                          worker="w0", code="499") == 1
            assert sample(samples, "kvhint_router_broken_responses_total",
                          worker="w0") is None
    finally:
        await stub.stop()
