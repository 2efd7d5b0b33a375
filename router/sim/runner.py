"""Run several policies over one trace, in parallel processes, with a progress line."""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.results import PolicyResult
from kvhint.router.sim.trace import Trace


class ProgressLine:
    """One status line for all running policies: redrawn in place on a terminal, printed
    every 10% otherwise (logs stay short)."""

    def __init__(self, stream: TextIO | None, policies: Sequence[str]) -> None:
        self._stream = stream
        self._tty = bool(stream is not None and stream.isatty())
        self._done = {p: 0.0 for p in policies}
        self._last_logged = {p: -1 for p in policies}
        self._started = time.monotonic()

    def update(self, policy: str, done: int, total: int) -> None:
        if self._stream is None:
            return
        fraction = done / total if total else 1.0
        self._done[policy] = fraction
        if self._tty:
            parts = " ".join(f"{p} {int(100 * f):3d}%" for p, f in self._done.items())
            elapsed = time.monotonic() - self._started
            self._stream.write(f"\r[sim {elapsed:5.0f}s] {parts}")
            self._stream.flush()
            return
        decile = int(10 * fraction)
        if decile > self._last_logged[policy]:
            self._last_logged[policy] = decile
            self._stream.write(f"[sim] {policy}: {done}/{total} requests\n")
            self._stream.flush()

    def close(self) -> None:
        if self._stream is not None and self._tty:
            self._stream.write("\n")
            self._stream.flush()


def _child(trace: Trace, config: SimConfig, policy: str, queue: Any) -> None:
    try:
        result = Simulation(trace, config, policy).run(
            lambda done, total: queue.put(("progress", policy, done, total)))
        queue.put(("result", policy, result))
    except Exception as exc:  # reported to the parent, which fails the run
        queue.put(("error", policy, f"{type(exc).__name__}: {exc}"))


def run_policies(
    trace: Trace,
    config: SimConfig,
    policies: Sequence[str],
    jobs: int = 1,
    progress: TextIO | None = sys.stderr,
    on_result: Callable[[PolicyResult], None] | None = None,
) -> list[PolicyResult]:
    """Every policy over ``trace``; ``jobs`` > 1 runs them in forked processes (each
    policy's run is independent and seeded, so the results do not depend on ``jobs``).
    Results come back in ``policies`` order."""
    line = ProgressLine(progress, policies)
    results: dict[str, PolicyResult] = {}
    try:
        if jobs <= 1 or len(policies) == 1 or "fork" not in multiprocessing.get_all_start_methods():
            for policy in policies:
                results[policy] = Simulation(trace, config, policy).run(
                    lambda done, total, p=policy: line.update(p, done, total))
                if on_result is not None:
                    on_result(results[policy])
        else:
            _run_forked(trace, config, policies, jobs, line, results, on_result)
    finally:
        line.close()
    return [results[p] for p in policies]


# The policy that plans and sends hints runs the planner, the plugin's executor and its
# holds on every turn: 4-5x a baseline's time on the Mooncake trace (BENCHMARKS.md).
_COSTLIEST_FIRST = ("kvhint",)


def start_order(policies: Sequence[str]) -> list[str]:
    """The order forked runs start in: the costliest first, the rest as given. Started
    last (its place in ``all``), kvhint ran alone after the baselines had finished, and
    the whole run took a baseline's time longer than it had to (longest first)."""
    return sorted(policies, key=lambda p: p not in _COSTLIEST_FIRST)


def _run_forked(trace: Trace, config: SimConfig, policies: Sequence[str], jobs: int,
                line: ProgressLine, results: dict[str, PolicyResult],
                on_result: Callable[[PolicyResult], None] | None) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    waiting = start_order(policies)
    running: dict[str, Any] = {}
    errors: list[str] = []
    dead_since: dict[str, float] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                policy = waiting.pop(0)
                process = ctx.Process(target=_child, args=(trace, config, policy, queue),
                                      name=f"kvhint-sim-{policy}", daemon=True)
                process.start()
                running[policy] = process
            try:
                kind, policy, *rest = queue.get(timeout=1.0)
            except queue_module.Empty:
                _check_dead(running, dead_since, errors)
                if errors:
                    waiting.clear()
                    break
                continue
            if kind == "progress":
                line.update(policy, rest[0], rest[1])
                continue
            running.pop(policy).join()
            if kind == "error":
                errors.append(f"{policy}: {rest[0]}")
                waiting.clear()
                continue
            results[policy] = rest[0]
            if on_result is not None:
                on_result(rest[0])
    finally:
        for process in running.values():
            process.terminate()
            process.join()
    if errors:
        raise RuntimeError("simulation failed: " + "; ".join(errors))


def _check_dead(running: dict[str, Any], dead_since: dict[str, float],
                errors: list[str]) -> None:
    """A child that exited without reporting (killed, out of memory) fails the run once
    its queue had a few seconds to drain."""
    now = time.monotonic()
    for policy, process in running.items():
        if process.exitcode is None:
            continue
        first = dead_since.setdefault(policy, now)
        if now - first > 5.0:
            errors.append(f"{policy}: its process exited with code {process.exitcode} "
                          "without a result")
