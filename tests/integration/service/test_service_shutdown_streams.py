"""The router stopping (SIGTERM: uvicorn's should_exit, the path its signal handler takes)
with traffic: what a stream still open past ``http_shutdown_grace_s`` gets, and what the
store holds afterwards. The server is the one ``kvhint router`` runs (server_cli's
uvicorn_config), in-process so the test can flip should_exit at a chosen point."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import uvicorn

from conftest import StubWorker, router_settings, serving
from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.server_cli import uvicorn_config
from kvhint.router.service.app import create_app

pytestmark = pytest.mark.integration


async def test_a_stream_open_past_the_grace_ends_with_an_error_event_and_the_store_has_every_turn(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    async with serving([StubWorker(model_root=str(tiny_model_dir))]) as (worker,):
        # A flush interval far past the test: what the store holds is the stop's flush.
        listener = reserved_socket()  # bound now: a port found free may be taken before a bind
        settings = router_settings(tmp_path, [("w0", worker.url)],
                                   port=listener.getsockname()[1],
                                   http_shutdown_grace_s=0.5, store_flush_interval_s=60)
        server = uvicorn.Server(uvicorn_config(create_app(settings), settings))
        serve = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            assert not serve.done()
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{settings.port}"
        async with httpx.AsyncClient(timeout=30) as client:
            for turn in range(2):  # finished turns, queued in the writer only
                answer = await client.post(
                    f"{url}/v1/chat/completions", headers={"x-session-id": "done"},
                    json={"model": "stub", "messages": [{"role": "user", "content": f"t{turn}"}]})
                assert answer.status_code == 200
            worker.chunk_gap_s = 3.0  # the stream's first event, then a worker busy past the grace
            events: list[bytes] = []
            async with client.stream("POST", f"{url}/v1/chat/completions",
                                     headers={"x-session-id": "open"},
                                     json={"model": "stub", "stream": True, "messages": [
                                         {"role": "user", "content": "go"}]}) as stream:
                assert stream.status_code == 200
                chunks = stream.aiter_raw()
                events.append(await chunks.__anext__())
                stopped_at = time.monotonic()
                server.should_exit = True  # what SIGTERM does
                # Before: httpx.RemoteProtocolError (the body cut, no terminal event).
                async for chunk in chunks:
                    events.append(chunk)
        await asyncio.wait_for(serve, 20)
        assert time.monotonic() - stopped_at < 10
    body = b"".join(events)
    assert body.startswith(b'data: {"choices"')
    last = body.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: "), body
    error = json.loads(last.removeprefix(b"data: "))["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            rows = dict(conn.execute(sa.text("SELECT session_id, turns FROM sessions")).all())
    finally:
        engine.dispose()
    assert rows == {"done": 2, "open": 0}
