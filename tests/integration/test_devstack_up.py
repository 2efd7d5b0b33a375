"""``kvhint up`` / ``make run`` as an operator meets it: Ctrl-C stops the stack in order
and quickly, and what it prints on ready leads to a cache hit and to the dashboard.

No vLLM server runs here: the parts that stand in for one are named at each test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kvhint.router.devstack.nats_server import nats_answers
from kvhint.router.devstack.up import demo_request_body, ready_lines
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec, stop_servers

# Ignores SIGTERM and starts a child in its process group, as a vLLM API server does
# while its engine is still starting (measured: it outlived SIGTERM until SIGKILL).
# Starting real vLLM is too slow for a test, so a stand-in plays that fault.
_STUCK_SERVER = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(120)
""")


def _stuck_server(tmp_path: Path, port: int) -> tuple[VllmServer, int]:
    """A VllmServer whose process ignores SIGTERM; returns it and its child's pid."""
    server = VllmServer(VllmWorkerSpec(model_dir=tmp_path, port=port), tmp_path / f"{port}.log")
    server._proc = subprocess.Popen([sys.executable, "-c", _STUCK_SERVER],
                                    stdout=subprocess.PIPE, start_new_session=True)
    assert server._proc.stdout is not None
    child_pid = int(server._proc.stdout.readline())
    return server, child_pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie left for init to reap counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_stuck_workers_share_one_grace_and_their_children_are_killed(tmp_path: Path) -> None:
    """Ctrl-C while two workers were starting took 32 s on this machine (each worker was
    given 30 s, one after the other, and ignored SIGTERM meanwhile). Now every worker
    gets SIGTERM at once and one shared grace, then SIGKILL to its whole group."""
    first, first_child = _stuck_server(tmp_path, 1)
    second, second_child = _stuck_server(tmp_path, 2)
    started = time.monotonic()
    stop_servers([first, second], timeout_s=2.0)
    elapsed = time.monotonic() - started
    assert 1.9 < elapsed < 3.5
    assert not first.running and not second.running
    deadline = time.monotonic() + 5
    while (_alive(first_child) or _alive(second_child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(first_child) and not _alive(second_child)


def test_a_second_ctrl_c_kills_what_is_still_stopping(tmp_path: Path) -> None:
    server, child = _stuck_server(tmp_path, 1)
    hurry = threading.Event()
    threading.Timer(0.3, hurry.set).start()
    started = time.monotonic()
    stop_servers([server], timeout_s=60.0, hurry=hurry)
    assert time.monotonic() - started < 3
    assert not server.running


_SIGNALS_SCRIPT = textwrap.dedent("""
    import os, signal, threading
    from kvhint.router.devstack.up import _stop_on_signals
    stop, hurry = threading.Event(), threading.Event()
    _stop_on_signals(stop, hurry)
    os.kill(os.getpid(), signal.SIGINT)
    print(stop.is_set(), hurry.is_set())
    os.kill(os.getpid(), signal.SIGINT)
    print(stop.is_set(), hurry.is_set())
""")


def test_first_signal_stops_and_a_second_hurries() -> None:
    out = subprocess.run([sys.executable, "-c", _SIGNALS_SCRIPT], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split("\n")
    assert out[:2] == ["True False", "True True"]


# Enters running_nats like `kvhint up` (no NATS at the URL: it starts one), takes
# SIGINT like kvhint up, and says whether NATS still answers once the signal is in:
# the router and the workers stop after the signal and still publish meanwhile.
_NATS_SCRIPT = textwrap.dedent("""
    import signal, sys, threading
    from kvhint.router.devstack.nats_server import free_port, nats_answers, running_nats
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with running_nats(f"nats://127.0.0.1:{free_port()}") as nats:
        print(nats.url, nats.started_here, flush=True)
        stop.wait(30)
        print(stop.is_set(), nats_answers(nats.url), flush=True)
""")


def test_ctrl_c_leaves_nats_to_be_stopped_last() -> None:
    """A terminal's Ctrl-C signals the whole foreground process group. nats-server was in
    it, so it died at once, before the router and the workers (the router logged NATS
    disconnects while it drained); now it runs in a session of its own and is stopped
    by whoever started it, after the rest."""
    proc = subprocess.Popen([sys.executable, "-c", _NATS_SCRIPT], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        url, started_here = proc.stdout.readline().split()
        assert started_here == "True"
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal's Ctrl-C does
        assert proc.stdout.readline().split() == ["True", "True"]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not nats_answers(url)


def test_ready_lines_name_the_dashboard_and_metrics() -> None:
    lines = "\n".join(ready_lines("http://127.0.0.1:8080", [("w0", "http://127.0.0.1:8001")],
                                  with_router=True))
    assert "http://127.0.0.1:8080/dashboard" in lines
    assert "http://127.0.0.1:8080/metrics" in lines
    assert "cached_tokens" in lines
    plain = "\n".join(ready_lines("http://127.0.0.1:8001", [("w0", "http://127.0.0.1:8001")],
                                  with_router=False))
    assert "/dashboard" not in plain


def test_the_printed_request_fills_a_whole_kv_block(tiny_model_dir: Path) -> None:
    """vLLM caches (and reports in cached_tokens) whole blocks only, and never the last
    prompt token: the printed request used to be "hi" alone, 6 tokens, so sending it
    again never showed a hit. Its prompt must be over one block (32 tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    body = demo_request_body()
    ids = tokenizer.apply_chat_template(body["messages"], tokenize=True,
                                        add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert len(ids) > VllmWorkerSpec(model_dir=tiny_model_dir, port=0).block_size


def test_make_run_passes_up_args_to_kvhint_up() -> None:
    """The port-in-use message says to pick other ports; `make run` had no way to pass
    them (only `.venv/bin/kvhint up ...` did). A dry run (make -n) starts nothing."""
    import shutil

    import pytest

    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([make, "-n", "-C", str(repo), "run",
                          "UP_ARGS=--router-port 9090 --workers 1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "kvhint up --state-dir .kvhint --router-port 9090 --workers 1" in out


# Starts a part as kvhint up does (its own session, die_with_parent), prints the part's
# pid and waits: the test then kills this parent outright, as `kill -9` of kvhint up.
_PARENT_SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from kvhint.router.devstack.process_groups import die_with_parent
    part = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True, preexec_fn=die_with_parent())
    print(part.pid, flush=True)
    time.sleep(120)
""")


def test_the_parts_end_when_kvhint_up_is_killed_outright() -> None:
    """``kill -9`` of kvhint up runs no handler: its parts (each in a session of its own,
    so no terminal signal reaches them) kept running and holding their ports, and the
    next ``make run`` refused to start. Now the kernel SIGTERMs each when it dies."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_SCRIPT], stdout=subprocess.PIPE,
                              text=True)
    assert parent.stdout is not None
    part = int(parent.stdout.readline())
    assert _alive(part)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(part) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(part)
