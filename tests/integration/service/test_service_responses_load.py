"""The load a Responses follow-up (``previous_response_id``) books on its worker: vLLM
prepends the stored conversation to its prompt, which the request's body does not carry,
so the router counts it from the usage of the response it follows (responses_api.py
``follow_up_of``), against the real router app and stand-in workers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningRouter, router_settings, running_router, sample, scrape
from test_service_responses_api import ResponsesStub, create

# What the stand-in worker says each response used.
PROMPT, OUTPUT, REASONING = 3000, 300, 100


@dataclass
class SizedStub(ResponsesStub):
    """A worker whose responses report ``PROMPT`` input tokens (the conversation's) and
    ``OUTPUT`` output tokens, ``REASONING`` of them reasoning."""

    def _response(self, body: dict[str, Any], status: str) -> dict[str, Any]:
        response = super()._response(body, status)
        if response["usage"] is not None:
            response["usage"] = {
                "input_tokens": PROMPT, "output_tokens": OUTPUT,
                "total_tokens": PROMPT + OUTPUT,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": REASONING}}
        return response


def _booked(router: RunningRouter, worker_id: str) -> float:
    """The uncached prompt tokens routed to ``worker_id`` so far (its recent prefill, the
    clock held still: nothing decays)."""
    load = router.runtime.routing._loads.get(worker_id)
    return 0.0 if load is None else load.recent.prefill_tokens


@pytest.mark.parametrize(("streamed", "mode"), [(False, "ok"), (True, "ok"),
                                               (False, "tools")],
                         ids=["whole", "streamed", "tool_call"])
async def test_a_follow_up_books_the_conversation_its_worker_prepends(
        tmp_path: Path, tiny_model_dir: Path, streamed: bool, mode: str) -> None:
    """The follow-up books the conversation so far (the previous response's prompt and
    completion, its reasoning left out, which vLLM does not render again) plus its new
    input, less the previous prompt its worker likely still caches (whole blocks), as
    its uncached prefill: 210 tokens (10 after a tool call), where the body alone booked
    2. The previous response's usage is known whether it came whole or at a stream's
    end (after its id was learnt). A response ending in a tool call counts none of its
    completion (vLLM renders no tool call of it again). The held part is no prediction:
    nothing is reported as predicted for the follow-up, nor added to its session's
    predicted cached tokens."""
    stub = SizedStub(str(tiny_model_dir), mode=mode)
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        async with (running_router(settings) as router,
                    httpx.AsyncClient(timeout=30) as client):
            routing = router.runtime.routing
            routing.clock = lambda: 1000.0  # held still: the recent load does not decay
            url = f"{router.url}/v1/responses"
            if streamed:
                async with client.stream("POST", url, json=create(session_id="s1",
                                                                  stream=True)) as first:
                    assert first.status_code == 200
                    text = (await first.aread()).decode()
                first_id = text.split('"id": "', 1)[1].split('"', 1)[0]
            else:
                answer = await client.post(url, json=create(session_id="s1"))
                assert answer.status_code == 200, answer.text
                first_id = answer.json()["id"]
            samples = await scrape(client, router.url)
            predicted_before = sample(samples, "kvhint_router_cached_tokens_actual_total",
                                      worker="w0", predicted="true") or 0
            session_url = f"{router.url}/admin/sessions/default/s1"
            session_before = (await client.get(session_url)).json()
            before = _booked(router, "w0")
            follow = await client.post(url, json={
                "model": "stub", "input": "and then?", "previous_response_id": first_id})
            assert follow.status_code == 200, follow.text
            block = routing.default_block_size
            completion = 0 if mode == "tools" else OUTPUT - REASONING
            conversation = PROMPT + completion + len("and then?") // 4
            held = PROMPT // block * block
            assert _booked(router, "w0") - before == pytest.approx(conversation - held)
            load = routing._loads.get("w0")
            assert load is not None and (load.pending_prefill, load.active_blocks) == (0, 0)
            samples = await scrape(client, router.url)
            assert (sample(samples, "kvhint_router_cached_tokens_actual_total",
                           worker="w0", predicted="true") or 0) == predicted_before
            session = (await client.get(session_url)).json()
            assert session["turns"] == 2
            assert (session["predicted_cached_tokens"]
                    == session_before["predicted_cached_tokens"])
    finally:
        await stub.stop()


async def test_a_follow_up_of_a_response_without_usage_books_its_body_alone(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A follow-up of a response whose usage the router never read (answered queued, in
    the background) books what its body says, as before: nothing is guessed."""
    stub = SizedStub(str(tiny_model_dir), mode="background")
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        async with (running_router(settings) as router,
                    httpx.AsyncClient(timeout=30) as client):
            router.runtime.routing.clock = lambda: 1000.0
            url = f"{router.url}/v1/responses"
            answer = await client.post(url, json=create(background=True))
            assert answer.status_code == 200, answer.text
            stub.mode = "ok"
            stub.store[answer.json()["id"]]["status"] = "completed"
            before = _booked(router, "w0")
            follow = await client.post(url, json={
                "model": "stub", "input": "and then?",
                "previous_response_id": answer.json()["id"]})
            assert follow.status_code == 200, follow.text
            assert _booked(router, "w0") - before == pytest.approx(len("and then?") // 4)
    finally:
        await stub.stop()
