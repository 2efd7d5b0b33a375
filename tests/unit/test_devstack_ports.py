"""Servers started on a port picked here survive that port being taken before they bind
it (EADDRINUSE: free_port() only finds a port free when it looks; a clean-clone CI run
failed a set-up on it). The race cannot be lost on cue, so each test takes the port
itself, in the window between the pick and the bind, as the other process did."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvhint.router.devstack import ports
from kvhint.router.devstack.nats_server import (
    NatsServerProcess,
    nats_answers,
    nats_server_binary,
    start_nats_on_free_port,
)
from kvhint.router.devstack.ports import PortTaken, on_free_port, reserved_socket


@contextmanager
def _taken(port: int) -> Iterator[None]:
    """``port`` held by a listener of this process: another process's server there."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        yield


def test_a_picked_port_taken_before_the_first_start_moves_and_a_restart_keeps_its_own(
        tmp_path: Path) -> None:
    """Before, nats-server exited on the taken port and start() raised."""
    server = NatsServerProcess(store_dir=tmp_path / "store", log_path=tmp_path / "nats.log")
    picked = server.port
    try:
        with _taken(picked):
            server.start()
            assert server.port != picked and nats_answers(server.url)
        started_on = server.port
        server.stop()
        server.start()  # its URL is out now: the same port again
        assert server.port == started_on and nats_answers(server.url)
    finally:
        server.close()


def test_a_port_given_is_never_changed_for_another(tmp_path: Path) -> None:
    """A port a user chose: the start fails, saying so, rather than serve elsewhere."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = NatsServerProcess(port=port, store_dir=tmp_path / "store")
    try:
        with _taken(port), pytest.raises(PortTaken):
            server.start()
        assert server.port == port
    finally:
        server.close()


def test_a_nats_started_on_a_picked_port_taken_by_another_nats_is_not_mistaken_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port picker's first answer is a port another NATS serves (monkeypatched, here
    only: no real pick can be made to collide on cue). The NATS started here runs on a
    port of its own; the other one answering at the first port is not taken for it."""
    other, other_port = start_nats_on_free_port(
        lambda port: [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)])
    picks = iter([other_port])
    real_pick = ports.free_port
    monkeypatch.setattr(ports, "free_port", lambda: next(picks, None) or real_pick())
    try:
        proc, port = start_nats_on_free_port(
            lambda port: [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
            tmp_path / "nats.log")
        try:
            assert port != other_port and proc.poll() is None
            assert "address already in use" in (tmp_path / "nats.log").read_text()
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        other.terminate()
        other.wait(10)


def test_on_free_port_gives_up_after_its_tries() -> None:
    tried: list[int] = []

    def start(port: int) -> int:
        tried.append(port)
        raise PortTaken("taken")

    with pytest.raises(PortTaken):
        on_free_port(start)
    assert len(tried) == ports.START_TRIES


def test_a_reserved_port_refuses_connections_and_no_one_else_can_bind_it() -> None:
    """What lets a test give out a worker's URL before the worker serves it."""
    with reserved_socket() as sock:
        port = sock.getsockname()[1]
        with socket.socket() as client:
            assert client.connect_ex(("127.0.0.1", port)) != 0  # refused
        clash = subprocess.run([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                               capture_output=True, text=True, timeout=30)
        assert clash.returncode != 0 and "address already in use" in clash.stderr
