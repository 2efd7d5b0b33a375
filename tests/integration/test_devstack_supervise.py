"""``kvhint up`` while it serves: a worker that exits is started again while the router
routes around it (before, one worker's exit stopped the whole stack), one that cannot
start again stops the stack, and the router's exit stops it too (before, unnoticed); the
dev workers take an agent's tool-calling requests.

Starting real vLLM takes a minute, too slow for a test: a stand-in server plays each
worker (Python's http.server answering ``/v1/models`` from a folder), started, watched
and stopped by the real VllmServer and ``supervise``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvhint.router.devstack.ports import PortTaken, on_free_port
from kvhint.router.devstack.up import (
    CRASH_LOOP_EXITS,
    DEV_WORKER_ARGS,
    DevStackOptions,
    supervise,
    worker_spec,
)
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec, stop_servers


class StandInServer(VllmServer):
    """Serves ``root`` over HTTP in a process group of its own, as vLLM's server runs;
    ``fail_after`` starts: every later start exits at once (a worker that cannot start)."""

    def __init__(self, root: Path, port: int, log: Path, fail_after: int = 99) -> None:
        super().__init__(VllmWorkerSpec(model_dir=root, port=port), log)
        self.root, self.starts, self.fail_after = root, 0, fail_after

    def start(self) -> None:
        self.starts += 1
        command = ([sys.executable, "-m", "http.server", str(self.spec.port), "--bind",
                    "127.0.0.1", "--directory", str(self.root)]
                   if self.starts <= self.fail_after else [sys.executable, "-c", "exit(5)"])
        with open(self.log_path, "ab") as log:
            self._log_from = log.tell()
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid


def _stand_in(tmp_path: Path, name: str, fail_after: int = 99) -> StandInServer:
    root = tmp_path / name
    (root / "v1").mkdir(parents=True)
    (root / "v1" / "models").write_text('{"data": [{"id": "tiny"}]}')

    def start(port: int) -> StandInServer:  # again on another port if this one was taken
        server = StandInServer(root, port, tmp_path / f"{name}.log", fail_after)
        server.start()
        try:
            server.wait_ready(timeout_s=30)
        except RuntimeError:
            if server.port_taken():
                raise PortTaken(f"port {port} taken") from None
            raise
        return server

    return on_free_port(start)


def _supervising(servers: list[tuple[str, VllmServer]],
                 router: subprocess.Popen[bytes] | None, tmp_path: Path,
                 stop: threading.Event) -> tuple[list[int], threading.Thread]:
    """``supervise`` in a thread, as ``kvhint up``'s main thread runs it: (the exit code
    once it returns, the thread)."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(
        supervise(servers, router, tmp_path, stop, threading.Event(), poll_s=0.1)))
    thread.start()
    return codes, thread


def test_a_killed_worker_is_started_again_while_the_other_serves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What an operator does in the first hour: kill one worker and watch the router
    route around it. Before, ``kvhint up`` stopped everything (router, every worker) at
    the first worker's exit."""
    w0, w1 = _stand_in(tmp_path, "w0"), _stand_in(tmp_path, "w1")
    stop = threading.Event()
    codes, thread = _supervising([("w0", w0), ("w1", w1)], None, tmp_path, stop)
    try:
        first_pid = w1.pid
        os.killpg(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while " is back on " not in capsys.readouterr().out and time.monotonic() < deadline:
            time.sleep(0.1)
        assert w1.running and w1.pid != first_pid and w1.starts == 2
        assert httpx.get(f"{w1.url}/v1/models", timeout=5).status_code == 200
        assert w0.running and w0.starts == 1  # the other one was left alone
        assert not codes  # still supervising
    finally:
        stop.set()
        thread.join(10)
        stop_servers([w0, w1], timeout_s=5)
    assert codes == [0]


def test_a_worker_that_cannot_start_again_stops_the_stack(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w0 = _stand_in(tmp_path, "w0", fail_after=1)
    stop = threading.Event()
    codes, thread = _supervising([("w0", w0)], None, tmp_path, stop)
    try:
        os.killpg(w0.pid, signal.SIGKILL)
        thread.join(30)
        assert codes == [1]
        out = capsys.readouterr().out
        assert "worker w0 exited with code -9" in out
        assert "worker w0 failed to start again" in out
    finally:
        stop.set()
        thread.join(10)
        stop_servers([w0], timeout_s=5)


def test_the_routers_exit_stops_the_stack(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Before, ``kvhint up`` watched the workers only: with its router gone it went on
    printing nothing, the entry point it had printed refusing every connection."""
    w0 = _stand_in(tmp_path, "w0")
    router = subprocess.Popen([sys.executable, "-c", "exit(3)"])
    stop = threading.Event()
    codes, thread = _supervising([("w0", w0)], router, tmp_path, stop)
    try:
        thread.join(30)
        assert codes == [1]
        assert "the router exited with code 3" in capsys.readouterr().out
        assert w0.starts == 1
    finally:
        stop.set()
        thread.join(10)
        stop_servers([w0], timeout_s=5)


def test_the_dev_workers_take_tool_calls(tmp_path: Path, tiny_model_dir: Path) -> None:
    """An agent's request with ``tools`` (tool_choice "auto", the OpenAI SDKs' default)
    was answered 400 by every dev worker: vLLM needs --enable-auto-tool-choice and a
    --tool-call-parser for it. vLLM's own serve parser and checks take the command."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = worker_spec(DevStackOptions(state_dir=tmp_path), tiny_model_dir, 1,
                       "nats://127.0.0.1:4222", cores=2)
    command = spec.command()
    assert command[command.index("--port") + 1] == "8002"
    assert all(arg in command for arg in DEV_WORKER_ARGS)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        command[command.index("--model"):])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    validate_parsed_serve_args(args)  # raises for an unknown parser


def test_a_crash_looping_worker_stops_the_stack(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A worker that comes up and exits again, three times within the window (out of
    memory at its first request, say), stops the stack with its log named. Before, it
    was started again forever, the stack printing "is back" each time."""
    w0 = _stand_in(tmp_path, "w0")
    stop = threading.Event()
    codes, thread = _supervising([("w0", w0)], None, tmp_path, stop)
    try:
        out = ""
        for number in range(CRASH_LOOP_EXITS):
            os.killpg(w0.pid, signal.SIGKILL)
            if number == CRASH_LOOP_EXITS - 1:
                break
            deadline = time.monotonic() + 30
            while out.count(" is back on ") <= number and time.monotonic() < deadline:
                out += capsys.readouterr().out
                time.sleep(0.05)
        thread.join(30)
        assert codes == [1]
        assert w0.starts == CRASH_LOOP_EXITS  # started again twice, not a third time
        assert "it is crash-looping; stopping" in out + capsys.readouterr().out
    finally:
        stop.set()
        thread.join(10)
        stop_servers([w0], timeout_s=5)
