"""Stop child processes that each lead a process group of their own.

The dev stack starts every part (vLLM servers, the router, nats-server) with
``start_new_session=True``: a terminal's Ctrl-C then reaches only ``kvhint up``, which
stops the parts itself, in order. Stopping them is this module's job, and so is having
them stopped when ``kvhint up`` itself is killed outright (:func:`die_with_parent`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

_POLL_S = 0.05


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone already


def stop_process_groups(procs: Sequence[subprocess.Popen[bytes]], grace_s: float,
                        hurry: threading.Event | None = None) -> None:
    """SIGTERM every group at once, wait for all of them within one shared ``grace_s``
    (cut short when ``hurry`` is set: a second Ctrl-C), then SIGKILL each group, which
    also takes children a leader left behind. Returns when every leader is reaped.

    Contract: each process leads its own group (started with ``start_new_session``).
    One grace for all, not one each: a vLLM server interrupted while its engine starts
    ignores SIGTERM, and two such servers stopped one after the other made Ctrl-C take
    a minute."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    live = list(procs)
    while live and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
        live = [proc for proc in live if proc.poll() is None]
        if live:
            time.sleep(_POLL_S)
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when the process that
    started it dies (Linux ``PR_SET_PDEATHSIG``), or None where there is no ``prctl``.

    Each part runs in a session of its own, so a ``kill -9`` of ``kvhint up`` (no handler
    runs) left the router, the vLLM servers and NATS running, holding their ports: the
    next ``make run`` said "another make run?". SIGTERM stops each part as a Ctrl-C
    would. Contract: the caller starts the child from the thread that lives as long as
    the process (the kernel signals when the starting *thread* ends); ``kvhint up``
    starts every part from its main thread."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return hook
