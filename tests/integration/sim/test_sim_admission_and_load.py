"""The simulator against the live system, on hand-made traces (found by the simulator
review): a prompt that a pin keeps out waits for the pin's end instead of being dropped;
the pin ends at its TTL, as the plugin ends it at every engine step, not at the
simulation's next tick; and ``route()`` sees the router's own ``active_blocks`` (prompt
blocks of every in-flight request, queued ones included, no decode blocks), kept as the
live RoutingService keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint.router.sim import engine as sim_engine
from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace


def _write(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pin_rows() -> list[dict]:
    """30 sessions teach the planner that a tool gap returns after 2 s (so it pins); then
    ``a`` (4 blocks) ends on a tool call and is pinned, and ``b`` (9 blocks of a 10-block
    pool, nothing else running) arrives while the pin holds."""
    rows = []
    for i in range(30):
        base = 1000 + 10 * i
        rows.append({"timestamp": 10_000 * i, "session_id": f"w{i}", "input_length": 64,
                     "output_length": 2, "hash_ids": [base, base + 1],
                     "finish_reason": "tool_calls", "tool_names": ["search"]})
        rows.append({"timestamp": 10_000 * i + 2_000, "session_id": f"w{i}",
                     "input_length": 74, "output_length": 2,
                     "hash_ids": [base, base + 1, base + 15], "end": True})
    rows.append({"timestamp": 400_000, "session_id": "a", "input_length": 128,
                 "output_length": 2, "hash_ids": [1, 2, 3, 4], "finish_reason": "tool_calls",
                 "tool_names": ["search"]})
    rows.append({"timestamp": 401_000, "session_id": "b", "input_length": 264,
                 "output_length": 2, "hash_ids": list(range(100, 109))})
    rows.append({"timestamp": 403_000, "session_id": "a", "input_length": 165,
                 "output_length": 2, "hash_ids": [1, 2, 3, 4, 5, 6]})
    return rows


class _PinWatch(Simulation):
    """Notes when each Pin the planner sends ends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pin_expiries: dict[str, float] = {}

    def _send(self, actions) -> None:
        for planned in actions:
            if planned.action_type == "kv.pin":
                self.pin_expiries[planned.scope] = planned.expires_at
        super()._send(actions)


def _pin_run(tmp_path: Path):
    trace = load_trace(_write(tmp_path, _pin_rows()), block_size=32)
    sim = _PinWatch(trace, SimConfig(workers=1, gpu_blocks=10, block_size=32, keep_records=True,
                                     plugin={"pin_budget_fraction": 0.5}), "kvhint")
    return sim, sim.run()


def test_a_prompt_a_pin_keeps_out_waits_instead_of_being_dropped(tmp_path: Path) -> None:
    sim, result = _pin_run(tmp_path)
    assert result.dropped_requests == 0
    assert result.admission_waits >= 1
    b = next(r for r in result.records if r.session_id == "b")
    assert b.start_s > b.arrival_s  # it waited for a's pin
    assert result.prompt_tokens == sum(r["input_length"] for r in _pin_rows())


def test_a_pin_ends_at_its_ttl_not_at_the_next_tick(tmp_path: Path) -> None:
    sim, result = _pin_run(tmp_path)
    pin_end = sim.pin_expiries["default/a"]
    tick_s = sim.config.tick_s
    assert pin_end % tick_s > 1e-6  # off the tick grid, so the two cases differ
    b = next(r for r in result.records if r.session_id == "b")
    assert b.start_s == pytest.approx(pin_end)


class _LedgerWatch(_PinWatch):
    """Notes, at each hold deadline, what the router's ledger counts pinned on w0."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pinned_after_deadline: list[tuple[float, int]] = []

    def _on_hold_deadline(self, worker_id: str) -> None:
        super()._on_hold_deadline(worker_id)
        self.pinned_after_deadline.append((self.now, self.ledger.worker("w0").pinned_blocks))


def test_the_routers_ledger_lets_go_of_a_pin_when_it_ends_not_at_the_next_tick(
        tmp_path: Path) -> None:
    """The plugin ends a's pin at its TTL; before, the router's ledger (what the planner
    counts of the worker's pin budget) kept it until the simulation's next tick, up to
    tick_s (5 s) later; live, the router's 1 s tick lets it go."""
    trace = load_trace(_write(tmp_path, _pin_rows()), block_size=32)
    sim = _LedgerWatch(trace, SimConfig(workers=1, gpu_blocks=10, block_size=32,
                                        plugin={"pin_budget_fraction": 0.5}), "kvhint")
    sim.run()
    pin_end = sim.pin_expiries["default/a"]
    assert pin_end % sim.config.tick_s > 1e-6  # off the tick grid
    at_end = [pinned for at, pinned in sim.pinned_after_deadline if at == pin_end]
    assert at_end == [0]


@pytest.mark.parametrize("engine", ["fast", "scheduler"])
def test_route_sees_the_routers_active_blocks(tmp_path: Path, monkeypatch,
                                              engine: str) -> None:
    """r1 decodes (3 prompt blocks, 2 more of decode), r2 prefills, r3 and r4 wait: the
    router counts 3 blocks per request routed and not ended, nothing for decode."""
    rows = [{"timestamp": t, "session_id": f"s{i}", "input_length": 65, "output_length": 64,
             "hash_ids": [10 * i, 10 * i + 1, 10 * i + 2]}
            for i, t in enumerate([0, 100, 101, 102, 103])]
    # Longer than the pool: refused, and its blocks leave the router's count.
    rows.append({"timestamp": 104, "session_id": "big", "input_length": 700,
                 "output_length": 2, "hash_ids": list(range(500, 522))})
    trace = load_trace(_write(tmp_path, rows), block_size=32)
    seen: list[int] = []
    real_route = sim_engine.route

    def spy(ctx, features, rng):
        seen.append(ctx.workers[0].active_blocks)
        return real_route(ctx, features, rng)

    monkeypatch.setattr(sim_engine, "route", spy)
    sim = Simulation(trace, SimConfig(workers=1, gpu_blocks=20, block_size=32, engine=engine),
                     "kv_aware")
    result = sim.run()
    assert seen == [0, 3, 6, 9, 12, 15]
    assert result.dropped_requests == 1
    settled = sim.loads.get("w0")
    assert (settled.active_blocks, settled.pending_prefill) == (0, 0)


def test_scheduler_engine_runs_a_host_load_at_once_not_at_the_next_tick(
        tmp_path: Path) -> None:
    """``a`` is stored to the host tier, ``b`` evicts it from the 8-block pool; ``a``'s
    next turn loads it from the host: vLLM's schedule() starts the load and schedules
    nothing, the load is done at that step's end, and the request runs at once."""
    rows = [
        {"timestamp": 0, "session_id": "a", "input_length": 192, "output_length": 2,
         "hash_ids": [1, 2, 3, 4, 5, 6]},
        {"timestamp": 1000, "session_id": "b", "input_length": 224, "output_length": 2,
         "hash_ids": list(range(100, 107))},
        {"timestamp": 2000, "session_id": "a", "input_length": 251, "output_length": 2,
         "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8]},
    ]
    trace = load_trace(_write(tmp_path, rows), block_size=32)
    config = SimConfig(workers=1, gpu_blocks=8, host_blocks=100, block_size=32,
                       engine="scheduler", keep_records=True)
    result = Simulation(trace, config, "kv_aware").run()
    last = result.records[-1]
    assert last.g2_hit_tokens == 192  # loaded from the host tier
    assert result.ttfts_s[-1] < 0.1  # not the ~3 s until the tick at 5 s
    assert result.admission_waits == 0
