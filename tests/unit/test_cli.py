from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvhint.router.cli import main
from kvhint.schemas.export import MESSAGES


def test_schemas_export_writes_json_schema_per_message(tmp_path: Path) -> None:
    assert main(["schemas", "export", str(tmp_path / "out")]) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted(f"{name}.schema.json" for name in MESSAGES)
    envelope = json.loads((tmp_path / "out" / "KvHintsEnvelope.schema.json").read_text())
    required = envelope["$defs"]["KvHintsEnvelope"]["required"]
    assert set(required) == {"protocol_version", "message_id", "actions"}


def test_console_script_runs() -> None:
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / "kvhint"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("up", "schemas", "router", "sim"):
        assert command in out


def test_kvhint_up_refuses_ports_in_use_and_bad_worker_counts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second `make run` while one runs (its ports answer) stops at once with a clear
    message, before building or starting anything; before, it reported ready against
    the first run's servers, then printed a line a second forever."""
    import socket

    from kvhint.router.devstack.up import DevStackOptions, run_dev_stack

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        options = DevStackOptions(state_dir=tmp_path / "state", router_port=port,
                                  worker_base_port=port + 1, workers=1)
        before = signal.getsignal(signal.SIGINT)
        assert run_dev_stack(options) == 1
        # Its handlers go with it: before, pytest's Ctrl-C was replaced for the rest of
        # the run.
        assert signal.getsignal(signal.SIGINT) is before
    out = capsys.readouterr().out
    assert f"port(s) {port}" in out and "already in use" in out
    assert not (tmp_path / "state" / "models").exists()
    with pytest.raises(SystemExit):
        main(["up", "--workers", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_waiting_for_a_worker_ends_when_asked_to_stop(tmp_path: Path) -> None:
    """Ctrl-C while a worker starts (up to 300 s with vLLM) stops the wait at once.
    The worker here is a process that never answers, standing in for a vLLM server
    still loading."""
    import threading
    import time

    from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec

    server = VllmServer(VllmWorkerSpec(model_dir=tmp_path, port=9), tmp_path / "w.log")
    server._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop = threading.Event()
    try:
        threading.Timer(0.5, stop.set).start()
        started = time.monotonic()
        server.wait_ready(timeout_s=60, stop=stop)
        assert time.monotonic() - started < 5
    finally:
        server._proc.kill()
        server._proc.wait()


def test_a_nats_server_without_jetstream_is_told_apart() -> None:
    """kvhint up uses a NATS it finds running; one started without -js is now reported
    on the console (before, only router.log said that replay was off)."""
    from kvhint.router.devstack.nats_server import (
        NatsServerProcess,
        nats_has_jetstream,
        nats_server_binary,
        running_nats,
        start_nats_on_free_port,
    )

    bare, port = start_nats_on_free_port(
        lambda port: [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)])
    with_js = NatsServerProcess()
    try:
        with running_nats(f"nats://127.0.0.1:{port}") as found:
            assert not found.started_here and not found.jetstream
        with_js.start()
        assert nats_has_jetstream(with_js.url)
    finally:
        bare.terminate()
        bare.wait()
        with_js.close()
