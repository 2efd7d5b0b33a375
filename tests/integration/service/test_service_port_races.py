"""The router and stand-in workers served in-process bind their port when they pick it:
a port free_port() found may be taken by another process before a later bind
(EADDRINUSE; a clean-clone CI run failed a set-up on it). A router run as a child
process cannot be handed a bound socket: it is started again on another port."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

import conftest
from conftest import StubWorker, router_settings, running_router
from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.service.launch import RouterProcess


async def test_the_router_serves_though_the_port_free_port_found_was_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port() is made to answer a port another listener holds (monkeypatched, in this
    test only: a real pick cannot be made to collide on cue). Before, uvicorn then failed
    to bind it and the set-up died (uvicorn exits the process on a failed bind)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        monkeypatch.setattr(conftest, "free_port", lambda: taken)
        async with running_router(router_settings(tmp_path, [])) as router, \
                httpx.AsyncClient() as client:
            assert router.url != f"http://127.0.0.1:{taken}"
            assert (await client.get(f"{router.url}/health")).status_code == 200


async def test_a_worker_on_a_reserved_port_refuses_until_it_starts_then_serves_there(
        ) -> None:
    """A URL given out before its worker starts (a worker down, then up): the port is
    bound from the start, so no other process can take it meanwhile."""
    worker = StubWorker(listen_on=reserved_socket())
    url = f"http://127.0.0.1:{worker.port}"
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{url}/health")
        await worker.start()
        try:
            assert worker.url == url
            assert (await client.get(f"{url}/health")).status_code == 200
            await worker.stop()
            await worker.start()  # a restart: the same port, which the router was given
            assert worker.url == url
            assert (await client.get(f"{url}/health")).status_code == 200
        finally:
            await worker.stop()


@pytest.mark.usefixtures("throwaway_streams")
def test_a_router_process_whose_picked_port_was_taken_starts_on_another(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """The port RouterProcess picked is taken (a listener here, as another process would)
    before its first start: the router, exiting on it, is started on another. A restart
    keeps the port it then bound. Before, the start raised (the router exited)."""
    router = RouterProcess({"KVHINT_ROUTER_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}",
                            "KVHINT_ROUTER_NATS_URL": nats_url,
                            "KVHINT_ROUTER_SUBJECT_PREFIX": subject_prefix},
                           tmp_path / "router.log")
    picked = router.port
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", picked))
            holder.listen()
            router.start()
        assert router.port != picked
        assert "address already in use" in (tmp_path / "router.log").read_text()
        started_on = router.port
        router.stop()
        router.start()
        assert router.port == started_on
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
    finally:
        router.stop()
