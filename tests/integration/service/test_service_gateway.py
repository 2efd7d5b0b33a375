"""The gateway against stub workers: streaming passthrough, retries, clean mid-stream
errors, error passthrough, tenancy and the admin API (sessions:
test_service_gateway_sessions.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import StubWorker, router_settings, running_router

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}


async def test_streaming_passes_each_event_as_it_comes(tmp_path: Path,
                                                       stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    stub.chunk_gap_s = 0.5
    settings = router_settings(tmp_path, [("w0", stub.url)])
    gc.unfreeze()
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        # What start-up built is out of the collector's way (no full collection under
        # load walks the tokenizer's and torch's objects again).
        assert gc.get_freeze_count() > 0
        started = time.monotonic()
        arrivals: list[tuple[float, str]] = []
        async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                 json={**CHAT, "stream": True, "session_id": "s1"}) as response:
            assert response.status_code == 200
            assert response.headers["x-kvhint-worker"] == "w0"
            async for line in response.aiter_lines():
                if line:
                    arrivals.append((time.monotonic() - started, line))
        # The first event reached the client long before the worker sent the second one.
        assert arrivals[0][0] < 0.4 <= arrivals[1][0]
        payloads = [line for _t, line in arrivals]
        assert payloads[-1] == "data: [DONE]"
        # The usage chunk the router asked for is not shown to the client.
        assert not any('"usage"' in p for p in payloads)
        assert stub.received[0]["stream_options"] == {"include_usage": True}
        # ... but the router counted it.
        metrics = (await client.get(f"{router.url}/metrics")).text
        assert ('kvhint_router_cached_tokens_actual_total{predicted="true",worker="w0"} 32.0'
                in metrics)


async def test_retry_once_on_the_next_worker_before_the_response_starts(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    alive = stub_workers[1]
    dead_url = "http://127.0.0.1:9"  # nothing listens: connection refused
    settings = router_settings(tmp_path, [("dead", dead_url), ("w1", alive.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for number in range(4):
            response = await client.post(f"{router.url}/v1/chat/completions",
                                         json={**CHAT, "session_id": f"s{number}"})
            assert response.status_code == 200
            assert response.headers["x-kvhint-worker"] == "w1"
        workers = (await client.get(f"{router.url}/admin/workers")).json()["workers"]
        dead = next(w for w in workers if w["worker_id"] == "dead")
        assert dead["http_up"] is False and dead["http_failures"] >= 1
        # A 503 from the only other choice is passed through after the one retry.
        alive.mode = "status:503"
        response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert "stub says 503" in response.text


async def test_connections_idle_past_the_workers_keep_alive_are_not_reused(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A worker closes an idle keep-alive connection (vLLM's server after 5 s); a request
    the router writes to it just then fails before any answer, and the worker was counted
    down for it (a live bench lost 17 turns so). The stub drops a request on a connection
    idle over 0.5 s; the router's pool gives connections up after 0.3 s idle
    (``upstream_keepalive_s``, below the worker's), so turns after a pause get a fresh
    one. With the pool keeping them longer than the worker does, the stub's race loses."""
    stub = stub_workers[0]
    stub.drop_requests_idle_over_s = 0.5
    for keepalive_s, expected in ((0.3, [200, 200, 200]), (60.0, [200, 502])):
        settings = router_settings(tmp_path, [("w0", stub.url)],
                                   upstream_keepalive_s=keepalive_s)
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            statuses = []
            for _ in expected:
                response = await client.post(f"{router.url}/v1/chat/completions",
                                             json={**CHAT, "session_id": "s1"})
                statuses.append(response.status_code)
                await asyncio.sleep(0.8)
            assert statuses == expected, keepalive_s
            (worker,) = (await client.get(f"{router.url}/admin/workers")).json()["workers"]
            assert (worker["http_failures"] == 0) == (keepalive_s < 0.5)


async def test_failure_after_bytes_is_a_clean_error_event(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    from openai import APIError, AsyncOpenAI

    stub = stub_workers[0]
    stub.mode = "die_mid_stream"
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router:
        client = AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model="stub", messages=CHAT["messages"], stream=True)
        received = []
        with pytest.raises(APIError) as exc:
            async for chunk in stream:
                received.append(chunk)
        assert len(received) == 1  # the event sent before the worker died
        assert "worker failed mid-stream" in str(exc.value)
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{router.url}/metrics")).text
        assert 'kvhint_router_broken_responses_total{worker="w0"} 1.0' in metrics


async def test_worker_errors_pass_through_with_status_and_body(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for code in (400, 404, 422, 500):
            stub.mode = f"status:{code}"
            response = await client.post(f"{router.url}/v1/completions",
                                         json={"model": "stub", "prompt": "x"})
            assert response.status_code == code
            assert response.json()["error"]["message"] == f"stub says {code}"
        stub.mode = "ok"
        json_type = {"content-type": "application/json"}
        bad = await client.post(f"{router.url}/v1/chat/completions", content=b"{oops",
                                headers=json_type)
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        # A body not declared JSON is refused as vLLM refuses it: what a form or a
        # no-cors fetch on another site sends (cross_site.py). Before, it was served.
        chat = b'{"model": "stub", "messages": [{"role": "user", "content": "x"}]}'
        for content_type in (None, "text/plain", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", "application/jsonx"):
            refused = await client.post(f"{router.url}/v1/chat/completions", content=chat,
                                        headers={"content-type": content_type}
                                        if content_type else {})
            assert refused.status_code == 400, (content_type, refused.text)
            assert "Content-Type: application/json" in refused.json()["error"]["message"]
        for content_type in ("application/json; charset=utf-8", "application/vnd.x+json"):
            served = await client.post(f"{router.url}/v1/chat/completions", content=chat,
                                       headers={"content-type": content_type})
            assert served.status_code == 200, (content_type, served.text)
        assert len(stub.received) == 6  # no refused body reached a worker


async def test_tenancy_keys_salts_and_admin(tmp_path: Path,
                                            stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    settings = router_settings(
        tmp_path, [("w0", stub.url)], admin_keys=["root"],
        tenants=[{"name": "acme", "api_keys": ["k-acme"], "admin_keys": ["adm-acme"]},
                 {"name": "beta", "api_keys": ["k-beta"]}])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = f"{router.url}/v1/chat/completions"
        assert (await client.post(url, json=CHAT)).status_code == 401
        assert (await client.post(url, json=CHAT, headers={"authorization": "Bearer no"})
                ).status_code == 401
        for key in ("k-acme", "k-beta"):
            body = {**CHAT, "session_id": "same", "cache_salt": "client-salt",
                    "kv_transfer_params": {"x": 1}}
            response = await client.post(url, json=body,
                                         headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200
        acme, beta = stub.received
        assert acme["session_id"] == "acme/same" and beta["session_id"] == "beta/same"
        assert acme["cache_salt"] != beta["cache_salt"] != "client-salt"
        assert "kv_transfer_params" not in acme
        admin = f"{router.url}/admin/sessions"
        assert (await client.get(admin, headers={"authorization": "Bearer k-acme"})
                ).status_code == 403
        mine = (await client.get(admin, headers={"authorization": "Bearer adm-acme"})).json()
        assert [s["tenant"] for s in mine["sessions"]] == ["acme"]
        assert (await client.get(admin, params={"tenant": "beta"},
                                 headers={"authorization": "Bearer adm-acme"})).status_code == 403
        everyone = (await client.get(admin, headers={"authorization": "Bearer root"})).json()
        assert sorted(s["tenant"] for s in everyone["sessions"]) == ["acme", "beta"]
        # A tenant ends its own session; it cannot reach another tenant's.
        gone = await client.delete(f"{router.url}/v1/sessions/same",
                                   headers={"authorization": "Bearer k-beta"})
        assert gone.status_code == 200 and gone.json()["state"] == "ended"
        assert router.runtime.sessions.get("acme", "same").state == "active"


async def test_hints_api_refuses_without_a_plugin_and_validates(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = f"{router.url}/v1/sessions/s9/hints"
        pin = {"actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 10}}]}
        assert (await client.post(url, json=pin)).status_code == 404  # unknown session
        await client.post(f"{router.url}/v1/chat/completions", json={**CHAT, "session_id": "s9"})
        response = await client.post(url, json=pin)
        assert response.status_code == 503 and "no kvhint plugin" in response.text
        # Sent as JSON: a body without a JSON type is a cross-site form's (cross_site.py).
        assert (await client.post(url, content=b"[1,2]", headers={
            "content-type": "application/json"})).status_code == 400


async def test_models_health_metrics_dashboard(tmp_path: Path,
                                               stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url),
                                          ("w1", stub_workers[1].url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        models = (await client.get(f"{router.url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["stub"]
        health = (await client.get(f"{router.url}/health")).json()
        assert health["routable_workers"] == 2 and health["dev_mode"] is True
        page = await client.get(f"{router.url}/dashboard")
        assert page.status_code == 200 and "/admin/overview" in page.text
        overview = (await client.get(f"{router.url}/admin/overview")).json()
        assert {w["worker_id"] for w in overview["workers"]} == {"w0", "w1"}
        text = (await client.get(f"{router.url}/metrics")).text
        for name in ("kvhint_router_routing_decision_seconds", "kvhint_router_index_blocks",
                     "kvhint_router_hints_pending", "kvhint_router_index_ingest",
                     "kvhint_router_completion_read_probability"):
            assert name in text
        json.loads(json.dumps(overview))


async def _requests_with_code(client: httpx.AsyncClient, url: str, code: int) -> float:
    text = (await client.get(f"{url}/metrics")).text
    wanted = f'kvhint_router_requests_total{{code="{code}",endpoint="chat",worker='
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(wanted))


async def test_a_client_leaving_a_silent_worker_is_noticed_at_once(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """The client leaves while its worker sends nothing (a stalled stream; a request not
    answered yet): the router closes the worker's response at once, counts a 499 and
    frees the worker's in-flight slot. Before, it noticed only at the worker's next
    chunk or answer (up to request_timeout_s), the worker generating for nobody."""
    stub = stub_workers[0]
    stub.chunk_gap_s = 6.0  # silent after the first event
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        worker = router.runtime.workers.get("w0")
        async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                 json={**CHAT, "stream": True}) as response:
            async for _line in response.aiter_lines():
                break  # the first event, then the client hangs up
        started = time.monotonic()
        while worker.inflight and time.monotonic() - started < 2.0:
            await asyncio.sleep(0.05)
        assert worker.inflight == 0
        assert await _requests_with_code(client, router.url, 499) == 1
        # Not streamed: the worker has not answered yet when the client gives up.
        stub.chunk_gap_s, stub.answer_delay_s = 0.0, 6.0
        with pytest.raises(httpx.TimeoutException):
            await client.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=1.0)
        started = time.monotonic()
        while worker.inflight and time.monotonic() - started < 2.0:
            await asyncio.sleep(0.05)
        assert worker.inflight == 0
        assert await _requests_with_code(client, router.url, 499) == 2


async def test_client_leaving_mid_stream_is_counted_and_frees_the_worker(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    stub = stub_workers[0]
    stub.chunk_gap_s = 0.5
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                 json={**CHAT, "stream": True}) as response:
            async for _line in response.aiter_lines():
                break  # the first event, then the client hangs up
        # The router notices at the worker's next event (0.5 s later) at the latest.
        wanted = 'kvhint_router_requests_total{code="499",endpoint="chat",worker="w0"} 1.0'
        for _ in range(100):
            text = (await client.get(f"{router.url}/metrics")).text
            if wanted in text:
                break
            await asyncio.sleep(0.1)
        assert wanted in text
        assert router.runtime.workers.get("w0").inflight == 0


async def _send_until_answered(url: str, path: str, headers: str, chunk: bytes,
                               cap_bytes: int) -> tuple[bytes, int]:
    """Writes the request head, then ``chunk`` after ``chunk`` (up to ``cap_bytes``) while
    reading, the way a client that keeps sending would; returns what the server answered
    and how many body bytes were sent by then. A raw socket: httpx reads only after it
    sent the whole body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nhost: {host}\r\n"
                 f"content-type: application/json\r\n{headers}\r\n".encode())
    answer = asyncio.ensure_future(reader.read(65536))
    sent = 0
    try:
        while not answer.done() and sent < cap_bytes:
            writer.write(chunk)
            sent += len(chunk)
            await writer.drain()
            await asyncio.sleep(0.001)
        return await asyncio.wait_for(answer, 10), sent
    except ConnectionError:  # the server closed while we wrote: its answer came first
        return await asyncio.wait_for(answer, 10), sent
    finally:
        writer.close()


async def test_a_body_over_the_limit_is_refused_while_it_is_still_coming(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """``max_body_bytes`` bounds what the router holds of one body: a chunked body gets
    its 413 once the limit is passed, while the client is still sending (before, the
    router read the whole body first), and the connection is closed so the client stops;
    a declared length over the limit gets it before the body is read. The hints API has
    the same bound."""
    stub = stub_workers[0]
    limit = 64 * 1024
    settings = router_settings(tmp_path, [("w0", stub.url)], max_body_bytes=limit)
    piece = b" " * 8192
    chunked = b"%x\r\n%s\r\n" % (len(piece), piece)
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for path in ("/v1/chat/completions", "/v1/sessions/s1/hints"):
            answer, sent = await _send_until_answered(
                router.url, path, "transfer-encoding: chunked\r\n", chunked, 64 << 20)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert b"larger than 65536 bytes" in answer
            assert b"connection: close" in answer.lower()
            assert sent < 8 << 20  # answered long before the 64 MiB the client had
        answer, sent = await _send_until_answered(
            router.url, "/v1/chat/completions", f"content-length: {limit + 1}\r\n",
            b" " * 1024, limit + 1)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        # The router goes on serving; nothing reached the worker.
        ok = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200 and len(stub.received) == 1


async def test_bodies_the_hasher_cannot_read_are_still_routed_and_adapters_not_hashed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A content part whose type is not a string, or tool-call arguments nested past
    Python's recursion limit, are routed (the worker validates them); before, the
    router's hashing raised and answered 500. A LoRA adapter the workers list (vLLM
    names its parent) gets no prompt hashes: vLLM hashes its blocks with the adapter as
    an extra key, so the base model's hashes would predict hits it never has."""
    for stub in stub_workers:  # two workers: the router hashes to choose between them
        stub.adapters = ["sql-lora"]
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url),
                                          ("w1", stub_workers[1].url)])
    deep = "[" * 5000 + "]" * 5000
    bodies = [
        {**CHAT, "messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]},
        {**CHAT, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]},
    ]
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        assert set(router.runtime.models) == {"stub"}
        for body in bodies:
            response = await client.post(f"{router.url}/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        adapter = await client.post(f"{router.url}/v1/chat/completions",
                                    json={**CHAT, "model": "sql-lora"})
        assert adapter.status_code == 200
        metrics = (await client.get(f"{router.url}/metrics")).text
        assert 'what="internal_error"' not in metrics
        assert 'kvhint_router_drops_total{what="prompt_hashing:UnknownModel"} 1.0' in metrics


async def test_requests_go_only_to_workers_that_serve_their_model(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A fleet serving two models (one with a LoRA adapter): each request goes to a
    worker whose /v1/models lists its model. Before, routing ignored the model, and half
    of them got vLLM's 404 from a worker serving the other one. A model no worker lists
    is still routed (a list may be out of date; the worker answers for it)."""
    base, other = stub_workers
    other.model, other.adapters = "other", ["sql-lora"]
    settings = router_settings(tmp_path, [("w0", base.url), ("w1", other.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        assert {w.worker_id: w.served_models for w in router.runtime.workers.all()} == {
            "w0": frozenset({"stub"}), "w1": frozenset({"other", "sql-lora"})}
        for model in ("stub", "other", "sql-lora") * 4:
            response = await client.post(f"{router.url}/v1/chat/completions",
                                         json={**CHAT, "model": model})
            assert response.status_code == 200, (model, response.text)
        assert [b["model"] for b in base.received] == ["stub"] * 4
        assert sorted(b["model"] for b in other.received) == ["other"] * 4 + ["sql-lora"] * 4
        unknown = await client.post(f"{router.url}/v1/chat/completions",
                                    json={**CHAT, "model": "nope"})
        assert unknown.status_code == 404
        # The worker serving "other" is down: its requests are refused, not sent to w0.
        await other.stop()
        refused = await client.post(f"{router.url}/v1/chat/completions",
                                    json={**CHAT, "model": "other"})
        assert refused.status_code in (502, 503), refused.text
        assert "other" not in [b["model"] for b in base.received]


async def test_the_router_renders_prompts_with_the_workers_chat_template(
        tmp_path: Path, stub_workers: list[StubWorker], tiny_model_dir: Path) -> None:
    """Workers started with --chat-template render other tokens than the tokenizer's own
    template; configured as model_prompts, the router hashes what they render. Before,
    the flag could not be given to the router, and every predicted hit on such a fleet
    missed."""
    from kvhint.router.hashing import HashConfig, PromptRenderer

    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               model_prompts={"*": {"chat_template": str(tmp_path / "t.jinja")}})
    body = {"model": "stub", "messages": [{"role": "user", "content": "hello there " * 20}]}
    async with running_router(settings) as router:
        hashed = router.runtime.routing.hasher.hash_chat(body, HashConfig(block_size=16))
    worker_render = PromptRenderer.from_pretrained(tiny_model_dir, chat_template=template)
    default_render = PromptRenderer.from_pretrained(tiny_model_dir)
    assert list(hashed.token_ids) == worker_render.chat_token_ids(body)
    assert list(hashed.token_ids) != default_render.chat_token_ids(body)


async def test_a_client_that_leaves_right_after_done_was_served(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """The OpenAI SDK closes its connection as soon as it reads [DONE]; the worker ends
    the stream a moment later. That turn was served: it counts as 200 with its usage,
    and the session is planned from it. Before, the disconnect watcher took it for a
    client gone early (499), its usage was dropped and nothing protected the session
    (an e2e run saw a session's cached tokens at 0)."""
    stub = stub_workers[0]
    stub.linger_after_done_s = 0.5
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for _turn in range(2):
            async with client.stream("POST", f"{router.url}/v1/chat/completions", json={
                    **CHAT, "stream": True, "session_id": "sdk",
                    "stream_options": {"include_usage": True}}) as response:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        break  # leave now, as the SDK does
        await asyncio.sleep(1.0)
        record = router.runtime.sessions.get("default", "sdk")
        assert record is not None and record.turns == 2
        assert record.cached_tokens == 64 and record.prompt_tokens == 80
        metrics = (await client.get(f"{router.url}/metrics")).text
        assert 'code="499"' not in metrics


async def test_a_tenant_sees_and_uses_only_its_models(tmp_path: Path,
                                                      stub_workers: list[StubWorker]) -> None:
    """``tenants[].models``: a tenant's key lists and uses only those (a private LoRA
    adapter of one tenant is not another's); /v1/models needs a client key, as inference
    does. Before, anyone reaching the router listed, and every tenant used, every model."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"],
                               tenants=[{"name": "a", "api_keys": ["ka"], "models": ["stub"]},
                                        {"name": "b", "api_keys": ["kb"], "models": ["x"]},
                                        {"name": "c", "api_keys": ["kc"]}])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        def listed(key: str) -> Any:
            return client.get(f"{router.url}/v1/models",
                              headers={"authorization": f"Bearer {key}"})

        assert (await client.get(f"{router.url}/v1/models")).status_code == 401
        for key, ids in (("ka", ["stub"]), ("kb", []), ("kc", ["stub"])):
            response = await listed(key)
            assert response.status_code == 200
            assert [m["id"] for m in response.json()["data"]] == ids
        url = f"{router.url}/v1/chat/completions"
        refused = await client.post(url, json=CHAT, headers={"authorization": "Bearer kb"})
        assert refused.status_code == 404
        assert refused.json()["error"] == {"message": "The model `stub` does not exist.",
                                           "type": "NotFoundError", "param": "model",
                                           "code": 404}
        for key in ("ka", "kc"):
            served = await client.post(url, json=CHAT, headers={"authorization": f"Bearer {key}"})
            assert served.status_code == 200
        assert len(stub_workers[0].received) == 2
