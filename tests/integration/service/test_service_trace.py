"""Recorded traffic replays in the simulator: the router (real tokenizer, a stub worker)
writes what it serves as session JSONL, and ``kvhint sim`` loads and replays that file,
the second turn of a session finding the first turn's blocks cached."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from conftest import StubWorker, router_settings, running_router
from kvhint.router.service.trace_recorder import FILE_PREFIX
from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace

SYSTEM = {"role": "system", "content": "You are an agent. Plan, then call tools. " * 12}


async def _post(client: httpx.AsyncClient, url: str, messages: list[dict[str, Any]],
                session: str | None = None, end: bool = False) -> int:
    headers = {"X-Session-End": "true"} if end else {}
    body: dict[str, Any] = {"model": "stub", "messages": messages}
    if session is not None:
        body["session_id"] = session
    response = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    return response.status_code


async def test_recorded_traffic_replays_in_the_simulator(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    traces = tmp_path / "traces"
    settings = router_settings(tmp_path, [("w0", stub.url)], trace_dir=str(traces))
    first = [SYSTEM, {"role": "user", "content": "Find the failing test in the repo."}]
    call = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c0", "type": "function", "function": {"name": "search", "arguments": "{}"}}]}
    second = [*first, call, {"role": "tool", "tool_call_id": "c0",
                             "content": "tests/test_io.py::test_read fails " * 8}]
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
        assert await _post(client, router.url, first, "a") == 200
        stub.finish_reason, stub.tool_names = "stop", []
        assert await _post(client, router.url, second, "a", end=True) == 200
        assert await _post(client, router.url, [{"role": "user", "content": "hi"}]) == 200
        assert await _post(client, router.url, first, "c") == 200
        assert (await client.delete(f"{router.url}/v1/sessions/c")).status_code == 200
        assert await _post(client, router.url, first, "c") == 200  # the id, reused
        # A streamed answer: 2 tokens, 200 ms apart. The pace is measured where the
        # router relays them, so a loaded machine that delays the first by a few tens of
        # ms shortens it (a clean-clone CI run read 38 ms for a 50 ms gap).
        stub.chunk_gap_s = 0.2
        async with client.stream("POST", f"{router.url}/v1/chat/completions", json={
                "model": "stub", "messages": first, "session_id": "d", "stream": True}) as r:
            assert r.status_code == 200 and b"[DONE]" in await r.aread()
        # Written by the recorder's periodic flush (1 s), counted on /metrics.
        for _ in range(50):
            metrics = (await client.get(f"{router.url}/metrics")).text
            if "kvhint_router_trace_requests_written_total 6.0" in metrics:
                break
            await asyncio.sleep(0.1)
        assert "kvhint_router_trace_requests_written_total 6.0" in metrics
        stub.mode = "status:500"
        assert await _post(client, router.url, first, "b") == 500
        metrics = (await client.get(f"{router.url}/metrics")).text
    assert 'kvhint_router_drops_total{what="trace_failed"} 1.0' in metrics
    (path,) = traces.glob(f"{FILE_PREFIX}*-bs16.jsonl")  # written when the router stopped
    trace = load_trace(path, block_size=16)
    a1, a2, anonymous, c1, again, streamed = trace.requests
    # The streamed answer's pace as served: the simulator's decode time by default.
    assert streamed.session_id == "d" and 0.1 <= streamed.itl_s < 1.0
    assert streamed.ttft_s is not None and 0 < streamed.ttft_s < 5.0
    assert a1.itl_s is None and a1.ttft_s is None  # not streamed: no times to tell
    # Ended through the sessions API (an end line, at the time the DELETE came), then
    # reused: a new session under the old id.
    assert (c1.session_id, again.session_id, again.turn) == ("c", "c~2", 1)
    assert c1.end_at_s is not None and c1.arrival_s <= c1.end_at_s <= again.arrival_s
    assert not c1.end and again.end_at_s is None and a2.end_at_s is None
    assert (a1.session_id, a1.turn, a1.finish_reason, a1.tool_names) == (
        "a", 1, "tool_calls", ("search",))
    assert (a2.session_id, a2.turn, a2.finish_reason, a2.end) == ("a", 2, "stop", True)
    assert anonymous.session_id.startswith("~r") and anonymous.turn == 1
    # The second turn's prompt extends the first's: its hashes start with the first's
    # full blocks (the router's vLLM-compatible hashes, no text in the file).
    full = a1.input_length // 16
    assert full >= 10 and a2.block_ids[:full] == a1.block_ids[:full]
    assert 0 < a1.arrival_s <= a2.arrival_s <= anonymous.arrival_s
    assert "Plan, then call tools" not in path.read_text()
    # Replayed at the CPU build's block size 32 (two recorded blocks per block).
    replayed = load_trace(path, block_size=32, trace_block_size=16)
    sim = Simulation(replayed, SimConfig(workers=1, gpu_blocks=256, block_size=32,
                                         keep_records=True), "kvhint")
    result = sim.run()
    hits = {r.line: r.g1_hit_tokens for r in result.records}
    assert hits[replayed.requests[1].line] == a1.input_length // 32 * 32
