"""End to end: the plugin inside vLLM's MultiConnector on a real vLLM CPU server.

A MultiConnector is how an operator runs the plugin beside vLLM's OffloadingConnector
(Demote, CUDA only). The OffloadingConnector's worker refuses the CPU backend, so here the
MultiConnector holds the plugin alone; what it proves is the wrapping itself. vLLM's API
server rebuilds a MultiConnector's per-connector stats by class name, which failed for a
connector loaded by module path and killed the server's output handler on the first
request. kvhint registers its connector by name (entry point and import), and this test
fails without that.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from kvhint.router.devstack.nats_server import delete_stream_if_any
from kvhint.router.devstack.up import plugin_transfer_config
from kvhint.router.devstack.vllm_server import VllmServer
from kvhint.schemas import (
    KvHintsEnvelope,
    RetainPayload,
    Subjects,
    Target,
    decode_outcome,
    encode_hints,
    make_action,
)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"kvhintmulti.{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def multi_server(vllm_pool: Any, nats_url: str, prefix: str) -> Iterator[VllmServer]:
    plugin = plugin_transfer_config("w0", nats_url)
    plugin["kv_connector_extra_config"] = {**plugin["kv_connector_extra_config"],
                                           "subject_prefix": prefix}
    transfer = {"kv_connector": "MultiConnector", "kv_role": plugin["kv_role"],
                "kv_connector_extra_config": {"connectors": [plugin]}}
    spec = replace(vllm_pool.base_spec, kv_cache_tokens=1600, max_model_len=1024,
                   kv_transfer_config=transfer)
    server = vllm_pool.start("plugin-multiconnector", spec)
    try:
        yield server
    finally:
        server.stop()
        asyncio.run(delete_stream_if_any(nats_url, Subjects(prefix).events_stream))


async def test_requests_metrics_and_hints_work_inside_a_multiconnector(
        multi_server: VllmServer, nats_url: str, prefix: str) -> None:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0.0, "session_id": "multi/s1",
            "messages": [{"role": "user", "content": "cache block session " * 40}]}
    async with httpx.AsyncClient(base_url=multi_server.url, timeout=60) as client:
        for _ in range(2):  # stats reach the API server after the first steps
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        await asyncio.sleep(1.5)  # the plugin ships stats at most once a second
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        metrics = (await client.get("/metrics")).text
    assert "kvhint:index_blocks" in metrics

    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        reply = asyncio.get_running_loop().create_future()

        async def on_outcome(msg: Any) -> None:
            outcome = decode_outcome(msg.data)
            if outcome.action_id == "multi-retain" and outcome.status.is_terminal \
                    and not reply.done():
                reply.set_result(outcome)

        await nc.subscribe(subjects.outcomes("w0"), cb=on_outcome)
        envelope = KvHintsEnvelope(protocol_version="1", message_id="m-multi", actions=[
            make_action("multi-retain", RetainPayload(target=Target(session_id="multi/s1"),
                                                      priority=50))])
        await nc.publish(subjects.hints("w0"), encode_hints(envelope))
        outcome = await asyncio.wait_for(reply, timeout=10)
    finally:
        await nc.drain()
    assert outcome.status.value == "accepted"

    log = Path(multi_server.log_path).read_text(errors="replace")
    assert "no host tier (no KV connector with an offloading manager" in log
    assert "Traceback" not in log
