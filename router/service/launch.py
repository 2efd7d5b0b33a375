"""Child processes for tests, benchmarks and scripts: the router itself
(:class:`RouterProcess`: start, wait until ``/health`` answers, stop with SIGTERM so the
store is flushed and NATS drained, start again on the same port and database) and the
common part every such process needs (:class:`ChildProcess`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from kvhint.router.devstack.ports import PortTaken, free_port, on_free_port, log_says_port_taken

# How long the router's own stop (runtime.RouterRuntime.stop, the app's lifespan end) may
# take after its HTTP server's grace for open connections (``http_shutdown_grace_s``,
# 30 s by default) has run out: the cancel notices kept unsent (up to 2 s, with a NATS
# link only: responses_cancel_notices.py); NATS's drain (up to 5 s, nats_link.NatsLink);
# the store's flush in progress (a lock waited for up to 5 s, store.database.WRITE_LOCK_WAIT_S, or a
# PostgreSQL that does not answer, up to store_connect_timeout_s, 10 s) and its last
# flush retried while the store is away (10 s, StoreWriter.close); and a margin for the
# rest (the trace file, the HTTP pool, the hashing threads). Whatever stops the router
# (kvhint up, RouterProcess.stop, compose's stop_grace_period, Kubernetes'
# terminationGracePeriodSeconds) must wait at least :func:`router_stop_grace_s` after
# SIGTERM before it kills it: killed sooner (a stream still open through the grace), the
# router never reaches its stop: the session and hint records queued since the last
# flush, the learned statistics and the cursors are lost, NATS is not drained.
STOP_AFTER_GRACE_S = 30.0
# The router's http_shutdown_grace_s default (settings.py), for a supervisor that sets none.
DEFAULT_SHUTDOWN_GRACE_S = 30.0
SHUTDOWN_GRACE_ENV = "KVHINT_ROUTER_HTTP_SHUTDOWN_GRACE_S"


def router_stop_grace_s(http_shutdown_grace_s: float) -> float:
    """The least a supervisor must wait between SIGTERM and SIGKILL for a router whose
    ``http_shutdown_grace_s`` is this (:data:`STOP_AFTER_GRACE_S`)."""
    return http_shutdown_grace_s + STOP_AFTER_GRACE_S


class ChildProcess:
    """A command in its own process group with its output in a log file."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_from = 0  # where the last start's part of the log begins

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _spawn(self, command: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_from = log.tell()
            self._proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(env) if env is not None else None,
                                          start_new_session=True)

    def _wait_http(self, url: str, timeout_s: float) -> None:
        """Until ``url`` answers 200; raises with the log's tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = self._proc.returncode if self._proc is not None else None
                raise RuntimeError(f"{self.log_path.name}: exited ({code}):\n" + self.log_tail())
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{url} did not answer in {timeout_s:.0f}s:\n" + self.log_tail())

    def port_taken(self) -> bool:
        """Whether the process exited because its port was taken (its last start's log
        says so)."""
        if self._proc is None or self._proc.poll() is None:
            return False
        return log_says_port_taken(self.log_path, self._log_from)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the process group, then SIGKILL what is left."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc is not None else None
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class RouterProcess(ChildProcess):
    """``kvhint router`` with ``env`` (KVHINT_ROUTER_*) on ``port``. Without ``port``, one
    is picked here, and replaced by another if taken before the first start binds it; a
    ``port`` given, or one a start has bound, never changes."""

    def __init__(self, env: Mapping[str, str], log_path: Path, port: int | None = None,
                 config_file: Path | None = None) -> None:
        super().__init__(log_path)
        self.env = dict(env)
        self.port = port or free_port()
        self._port_may_move = port is None  # until its first start
        self.config_file = config_file

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL once the router's whole stop had its time
        (:func:`router_stop_grace_s` of its ``http_shutdown_grace_s``) unless
        ``timeout_s`` says otherwise. Before, 20 s: a stream open through the router's
        30 s grace had it killed before its store's last flush."""
        if timeout_s is None:
            grace = self.env.get(SHUTDOWN_GRACE_ENV, os.environ.get(SHUTDOWN_GRACE_ENV))
            timeout_s = router_stop_grace_s(float(grace) if grace else DEFAULT_SHUTDOWN_GRACE_S)
        return super().stop(timeout_s)

    def start(self, timeout_s: float = 90.0) -> None:
        if self._port_may_move:
            on_free_port(lambda port: self._start_on(port, timeout_s), first=self.port)
            self._port_may_move = False
        else:
            self._start_on(self.port, timeout_s)

    def _start_on(self, port: int, timeout_s: float) -> None:
        self.port = port
        env = dict(os.environ)
        env.update(self.env)
        env["KVHINT_ROUTER_PORT"] = str(self.port)
        env["PYTHONUNBUFFERED"] = "1"
        command = [sys.executable, "-m", "kvhint.router.cli", "router"]
        if self.config_file is not None:
            command += ["--config", str(self.config_file)]
        self._spawn(command, env)
        try:
            self._wait_http(f"{self.url}/health", timeout_s)
        except RuntimeError:
            if self.port_taken():
                raise PortTaken(f"the router could not listen on port {port}") from None
            raise
