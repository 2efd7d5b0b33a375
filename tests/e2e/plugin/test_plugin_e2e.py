"""End to end: a real vLLM OpenAI server on the CPU with the engine plugin and real NATS.

One server for the module (start-ups are the expensive part). The order of the tests
matters and is the story: pin one of two sessions, flood the cache, the pinned session's
next turn is served from cache and the control's is not, with the same greedy output as a
cold run; then NATS dies mid-run and comes back.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from kvhint.router.devstack.nats_server import NatsServerProcess
from kvhint.router.devstack.up import plugin_transfer_config
from kvhint.router.devstack.vllm_server import VllmServer
from kvhint.schemas import (
    EventBatchMeta,
    HintOutcome,
    KvHintsEnvelope,
    PinPayload,
    RetainPayload,
    Subjects,
    Target,
    decode_outcome,
    decode_status,
    encode_hints,
    make_action,
)

WORDS = ("cache block session tool call agent prefix router worker engine hint pin retain "
         "token model batch queue result file search weather paris answer question reply "
         "summary section document chunk vector index event stream").split()


def text(seed: int, words: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServerProcess]:
    """A NATS server this module owns, so a test may stop and restart it."""
    folder = tmp_path_factory.mktemp("plugin-nats")
    server = NatsServerProcess(store_dir=folder / "store", log_path=folder / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"kvhinte2e.{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(vllm_pool: Any, module_nats: NatsServerProcess, prefix: str
           ) -> Iterator[VllmServer]:
    transfer = plugin_transfer_config("w0", module_nats.url)
    transfer["kv_connector_extra_config"] = {
        **transfer["kv_connector_extra_config"], "subject_prefix": prefix,
        "pin_budget_fraction": 0.5, "heartbeat_interval_s": 0.5,
        "http_url": "http://worker-0.example:8000"}
    # 50 blocks of 32 tokens (one is vLLM's null block); max_model_len must fit.
    spec = replace(vllm_pool.base_spec, kv_cache_tokens=1600, max_model_len=1024,
                   kv_transfer_config=transfer)
    server = vllm_pool.start("plugin-e2e", spec)
    try:
        yield server
    finally:
        server.stop()  # one server less held through the rest of the session


async def chat(client: httpx.AsyncClient, messages: list[dict], session: str | None,
               **extra: Any) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0.0,
            **extra}
    if session is not None:
        body["session_id"] = session
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def send_hint(nc: Any, prefix: str, payload: Any, action_id: str) -> HintOutcome:
    subjects = Subjects(prefix)
    envelope = KvHintsEnvelope(protocol_version="1", message_id=f"m-{action_id}",
                               actions=[make_action(action_id, payload)])
    reply = asyncio.get_running_loop().create_future()

    async def on_outcome(msg: Any) -> None:
        outcome = decode_outcome(msg.data)
        # A busy machine may answer `deferred` first; wait for the final outcome.
        if outcome.action_id == action_id and outcome.status.is_terminal and not reply.done():
            reply.set_result(outcome)

    sub = await nc.subscribe(subjects.outcomes("w0"), cb=on_outcome)
    try:
        await nc.publish(subjects.hints("w0"), encode_hints(envelope))
        # The engine is idle here: the plugin wakes it, so this takes milliseconds.
        return await asyncio.wait_for(reply, timeout=10)
    finally:
        await sub.unsubscribe()


async def test_pinned_session_keeps_its_cache_through_a_flood(
        server: VllmServer, module_nats: NatsServerProcess, prefix: str) -> None:
    nc = await nats.connect(module_nats.url)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            first = {}
            for session, seed in (("t/pinned", 1), ("t/control", 2)):  # pinned is older
                messages = [{"role": "user", "content": text(seed)}]
                reply = await chat(client, messages, session)
                first[session] = messages + [
                    {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "and what comes next?"}]
            assert (await chat(client, first["t/control"][:1], None))["usage"][
                "prompt_tokens_details"]["cached_tokens"] > 0  # both are cached now

            outcome = await send_hint(nc, prefix, PinPayload(
                target=Target(session_id="t/pinned"), ttl_s=300), "pin-1")
            assert outcome.status.value == "accepted", outcome
            assert outcome.applied.blocks >= 7

            for i in range(6):  # ~80 blocks of new prompts through a 49-block cache
                await chat(client, [{"role": "user", "content": text(100 + i, 160)}], f"t/f{i}")

            pinned = await chat(client, first["t/pinned"], "t/pinned")
            control = await chat(client, first["t/control"], "t/control")
            assert cached(pinned) >= outcome.applied.tokens - 32
            assert cached(control) == 0
            # The cached turn computes exactly what a cold run computes (greedy).
            cold = await chat(client, first["t/pinned"], "t/pinned",
                              cache_salt=f"cold-{uuid.uuid4().hex}")
            assert cached(cold) == 0
            assert pinned["choices"][0]["message"]["content"] == \
                cold["choices"][0]["message"]["content"]

            # Connector stats travel with a scheduler step at most once a second; an
            # engine that went idle since is woken for one step to ship them.
            # Every series is there at 0 from the start: wait for the count itself.
            wanted = ('kvhint:hints_total{action="kv.pin",engine="0",model_name="tiny",'
                      'status="accepted"} ')

            def accepted_pins(metrics: str) -> float:
                return next((float(line.removeprefix(wanted)) for line in metrics.splitlines()
                             if line.startswith(wanted)), 0.0)

            deadline = time.monotonic() + 10.0
            metrics = (await client.get("/metrics")).text
            while accepted_pins(metrics) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                metrics = (await client.get("/metrics")).text
            assert accepted_pins(metrics) >= 1
            assert "kvhint:pinned_blocks" in metrics
    finally:
        await nc.drain()


async def test_nats_dies_mid_run_requests_complete_and_hints_flow_after(
        server: VllmServer, module_nats: NatsServerProcess, prefix: str) -> None:
    subjects = Subjects(prefix)
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        module_nats.stop()
        started = time.monotonic()
        replies = await asyncio.gather(*(
            chat(client, [{"role": "user", "content": text(300 + i, 60)}], f"t/down{i}")
            for i in range(4)))
        assert all(r["choices"][0]["message"]["content"] is not None for r in replies)
        assert time.monotonic() - started < 60
        module_nats.start()
        nc = await nats.connect(module_nats.url)
        try:
            # The plugin reconnects on its own; heartbeats resume, then a hint flows.
            status = asyncio.Queue()

            async def on_status(msg: Any) -> None:
                await status.put(decode_status(msg.data))

            await nc.subscribe(subjects.status("w0"), cb=on_status)
            beat = await asyncio.wait_for(status.get(), timeout=30)
            assert beat.worker_id == "w0" and beat.http_url == "http://worker-0.example:8000"
            outcome = await send_hint(nc, prefix, RetainPayload(
                target=Target(session_id="t/down0"), priority=40), "after-outage")
            assert outcome.status.value == "accepted"
            # Batches made while NATS was down were buffered and published: the stream
            # holds this engine's batches with sequence numbers 1..n, no gap.
            sub = await nc.jetstream().subscribe(subjects.events("w0"), ordered_consumer=True)
            seqs = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=2)
                except nats.errors.TimeoutError:
                    break
                meta = EventBatchMeta.from_headers(msg.headers)
                assert meta.epoch == beat.epoch
                seqs.append(meta.seq)
            assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 8
        finally:
            await nc.drain()


def test_server_log_mentions_the_plugin(server: VllmServer) -> None:
    log = Path(server.log_path).read_text(errors="replace")
    assert "kvhint: engine plugin up: worker w0" in log
