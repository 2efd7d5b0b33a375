"""What the router drops or forgets reaches /metrics: the cluster index's own counters,
responses whose usage never came, clients that leave while sending their body, and the
series of a worker the router forgot (gone with it)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from conftest import StubWorker, router_settings, running_router, sample, scrape
from feed_helpers import router_hearing_nats, status, stored, until
from kvhint.router.kv_index import BlocksRemoved, BlocksStored
from kvhint.router.service import runtime as runtime_module
from kvhint.schemas import EventBatchMeta, Subjects

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
INDEX_DROPS = ("sessions_evicted", "frontiers_dropped", "missing_removes", "duplicate_stores",
               "repeat_stores", "repeat_removes")


async def test_the_cluster_index_counters_are_exported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions the index evicted past its bound, frontiers past a session's cap, removes
    of blocks it did not hold and blocks stored twice: before, only distinct_blocks left
    the index. And the event-batch counter nothing ever counted is gone."""
    monkeypatch.setattr(runtime_module, "MAX_SESSIONS_IN_MEMORY", 2)
    async with running_router(router_settings(tmp_path, [])) as router, \
            httpx.AsyncClient() as client:
        index = router.runtime.index
        index.apply(BlocksStored("w0", [1, 2], None, session_id="default/a"))
        index.apply(BlocksStored("w0", [1, 2], None, session_id="default/a"))  # twice
        index.apply(BlocksRemoved("w0", [99]))  # never held
        for _ in range(2):  # a host block in two offloaded chunks: two references
            index.apply(BlocksStored("w0", [300], None, tier="CPU"))
        index.apply(BlocksRemoved("w0", [300], tier="CPU"))  # one left
        for branch in range(5):  # five branches of one session: past its cap of 4
            index.apply(BlocksStored("w0", [100 + branch], None, session_id="default/b"))
        for n in range(3):  # past the bound of 2 sessions
            index.apply(BlocksStored("w0", [200 + n], None, session_id=f"default/c{n}"))
        stats = index.stats()
        samples = await scrape(client, router.url)
        for name in INDEX_DROPS:
            assert getattr(stats, name) > 0, name
            assert sample(samples, "kvhint_router_index_ingest_total",
                          what=f"index_{name}") == getattr(stats, name), name
        text = (await client.get(f"{router.url}/metrics")).text
        assert "kvhint_router_event_batches" not in text


async def test_a_response_without_its_usage_is_counted(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A 200 without usage (streamed or not: the router always asks a stream for it), or
    with a body or event the router cannot read, leaves the request's tokens uncounted
    and its session's turn unplanned: each is a drop now. An error answer has no usage
    to miss: not counted."""
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    url_of = "{}/v1/chat/completions".format

    async def drops(client: httpx.AsyncClient, router_url: str) -> tuple:
        samples = await scrape(client, router_url)
        return tuple(sample(samples, "kvhint_router_drops_total", what=what) or 0
                     for what in ("response_usage_missing", "response_unparsable"))

    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for mode, expected in (("no_usage", (2, 0)), ("unparsable", (2, 2)),
                               ("status:400", (2, 2)), ("ok", (2, 2))):
            stub.mode = mode
            for stream in (False, True):
                response = await client.post(url_of(router.url), json={
                    **CHAT, "stream": stream, "session_id": f"s-{mode}"})
                await response.aread()
            await until(lambda: router.runtime.workers.get("w0").inflight == 0)
            assert await drops(client, router.url) == expected, mode


async def _partial_body_then_close(router_url: str, path: str) -> None:
    """A client that sends its headers and part of its body, then closes the connection."""
    host, port = router_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n"
                 '{"model": "stub", "messages": ['.encode())
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    await writer.wait_closed()


async def test_a_client_gone_while_sending_its_body_is_a_499(
        tmp_path: Path, stub_workers: list[StubWorker],
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: Starlette's ClientDisconnect was an internal error (500, a traceback in the
    log, drops{what="internal_error"}) and no request was counted. Now a 499 like every
    client that leaves; on the hints API, a rejection of its own."""
    caplog.set_level(logging.INFO)
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        await _partial_body_then_close(router.url, "/v1/chat/completions")
        await _partial_body_then_close(router.url, "/v1/sessions/s/hints")

        async def counted() -> dict:
            return await scrape(client, router.url)

        samples = await counted()
        for _ in range(50):
            if sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="client_gone") == 1:
                break
            await asyncio.sleep(0.1)
            samples = await counted()
        assert sample(samples, "kvhint_router_requests_total", endpoint="chat",
                      worker="none", code="499") == 1
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="client_gone") == 1
        assert sample(samples, "kvhint_router_drops_total", what="internal_error") is None
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_forgotten_workers_series_leave_metrics(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A worker learnt from its heartbeats, silent past the time the router remembers
    dead workers, is forgotten; before, its per-worker series (requests, tokens, retries,
    resyncs...) stayed in every scrape for the router's life. Its traffic still counts in
    the fleet's totals."""
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, client, nc):
        runtime = router.runtime
        await nc.publish(subjects.status("w9"), status("w9", "e1", 0, stub_workers[0].url))
        await until(lambda: runtime.workers.get("w9") is not None
                    and runtime.workers.get("w9").plugin_alive)
        await nc.publish(subjects.events("w9"), stored([1, 2], None, "default/s"),
                         headers=EventBatchMeta("w9", "e1", 1).to_headers())
        await until(lambda: bool(runtime.index.worker_block_counts("w9")))
        response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        # Series other paths make (a retry, a broken stream, a resync, a prediction).
        metrics = runtime.metrics
        metrics.retries.labels("w9").inc()
        metrics.broken_streams.labels("w9").inc()
        metrics.resyncs.labels("w9", "gap", "requested").inc()
        metrics.cached_predicted.labels("w9").inc(3)

        def of_w9(samples: dict) -> set[str]:
            return {name for name, labels in samples if ("worker", "w9") in labels}

        before = of_w9(await scrape(client, router.url))
        assert {"kvhint_router_requests_total", "kvhint_router_prompt_tokens_total",
                "kvhint_router_cached_tokens_actual_total", "kvhint_router_retries_total",
                "kvhint_router_broken_responses_total", "kvhint_router_resyncs_total",
                "kvhint_router_cached_tokens_predicted_total", "kvhint_router_worker_up",
                "kvhint_router_worker_inflight", "kvhint_router_index_blocks"} <= before
        # Silent: declared dead (its index entries purged), then long gone.
        await until(lambda: not runtime.workers.get("w9").plugin_alive)
        runtime.workers.get("w9").last_heartbeat -= 100_000
        await until(lambda: runtime.workers.get("w9") is None)
        assert of_w9(await scrape(client, router.url)) == set()
        assert "w9" not in metrics.totals and metrics.retired.requests == 1
        overview = (await client.get(f"{router.url}/admin/overview")).json()
        assert overview["totals"]["requests"] == 1


async def test_metrics_take_the_metrics_token_when_one_is_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With ``metrics_token`` set, /metrics answers its bearer only (not an admin key: a
    scraper must not be able to send hints) and --check-config hides it. Before, /metrics
    was open to anyone who could reach the router, with no way to close it."""
    token = "scrape-0123456789abcdef"
    settings = router_settings(tmp_path, [], metrics_token=token, admin_keys=["admin-key"])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for headers in ({}, {"authorization": "Bearer admin-key"},
                        {"authorization": f"Bearer {token}x"}, {"x-api-key": token}):
            refused = await client.get(f"{router.url}/metrics", headers=headers)
            assert refused.status_code == 401, headers
            assert "metrics token" in refused.json()["error"]["message"]
        answered = await client.get(f"{router.url}/metrics",
                                    headers={"authorization": f"Bearer {token}"})
        assert answered.status_code == 200
        assert "kvhint_router_drops_total" in answered.text
    async with running_router(router_settings(tmp_path, [])) as router, \
            httpx.AsyncClient() as client:  # no token: open, as before
        assert (await client.get(f"{router.url}/metrics")).status_code == 200

    from kvhint.router.cli import main

    config = tmp_path / "router.yaml"
    config.write_text(f"metrics_token: {token}\n")
    assert main(["router", "--config", str(config), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert token not in out and '"metrics_token": "***"' in out
    config.write_text("metrics_token: short\n")  # a guessable token is refused
    assert main(["router", "--config", str(config), "--check-config"]) == 2
