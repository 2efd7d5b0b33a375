"""The forked runner starts the costliest policy first and still reports in the order
asked (``kvhint sim run --router all --jobs 2``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhint.router.sim import runner
from kvhint.router.sim.engine import SimConfig
from kvhint.router.sim.trace import Trace


def test_kvhint_starts_with_the_first_forked_runs_and_results_keep_their_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started in its place in ``all`` (last), kvhint, 4-5x a baseline's time, ran alone
    once the baselines were done: the whole-trace run took a baseline's time longer than
    the longest policy. The children stand in for simulations (what is checked is only
    the order the parent starts them in); each appends its name to a file when it starts."""
    started = tmp_path / "started"

    def child(trace: Trace, config: SimConfig, policy: str, queue) -> None:  # noqa: ANN001
        with open(started, "a") as f:
            f.write(policy + "\n")
        queue.put(("result", policy, policy))

    monkeypatch.setattr(runner, "_child", child)
    policies = ["round_robin", "session_affinity", "kv_aware", "kvhint"]
    results = runner.run_policies(None, SimConfig(), policies, jobs=2, progress=None)  # type: ignore[arg-type]
    assert results == policies
    order = started.read_text().split()
    assert sorted(order) == sorted(policies)
    # Two start at once; kvhint is one of them (before: the last to start).
    assert "kvhint" in order[:2]
    assert runner.start_order(policies) == ["kvhint", "round_robin", "session_affinity",
                                            "kv_aware"]
    assert runner.start_order(["kv_aware", "round_robin"]) == ["kv_aware", "round_robin"]
