"""The simulator on hand-computed traces: vLLM's real KVCacheManager, exact hits/evictions.

Block size 32, a pool of 6 usable blocks, prompts of 2 full blocks + 1 token (3 blocks) and
no decode tokens. vLLM 0.32's free queue: allocation pops from the head; ``free`` puts a
request's uncached (partial) block at the head and appends its cached blocks leaf first.

    r1 s1 [10,11,12]  pops 1,2,3           free -> [3,4,5,6,2,1]
    r2 s2 [20,21,22]  pops 3,4,5           free -> [5,6,2,1,4,3]
    r3 s3 [30,31,32]  pops 5,6,2 (evicts 11)    -> [2,1,4,3,6,5]
    r4 s1 [10,11,13,14] (97 tokens): 10 is cached, 11 is not -> 32 tokens hit;
                      pops 2,4,3 (evicts 21, 20): 3 removals in all.

With ``kvhint`` the planner retains s1 (a tool gap, priority ~82) and s2, s3 (first user
turns, ~26): r3 finds 2 free blocks, the plugin releases s2's leaf (21) under pressure; r4
hits both of s1's blocks (64 tokens) and costs s2's root (20): 2 removals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace

ROWS = [
    {"timestamp": 0, "session_id": "s1", "input_length": 65, "output_length": 0,
     "hash_ids": [10, 11, 12], "finish_reason": "tool_calls", "tool_names": ["search"]},
    {"timestamp": 10_000, "session_id": "s2", "input_length": 65, "output_length": 0,
     "hash_ids": [20, 21, 22]},
    {"timestamp": 20_000, "session_id": "s3", "input_length": 65, "output_length": 0,
     "hash_ids": [30, 31, 32]},
    {"timestamp": 30_000, "session_id": "s1", "input_length": 97, "output_length": 0,
     "hash_ids": [10, 11, 13, 14]},
]


@pytest.fixture()
def tiny_trace(tmp_path: Path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return load_trace(path, block_size=32)


def _run(trace, policy: str):
    sim = Simulation(trace, SimConfig(workers=1, gpu_blocks=6, block_size=32,
                                      keep_records=True), policy)
    result = sim.run()
    return result, sim.index.stats()


def test_plain_vllm_lru_hits_and_evictions_are_exact(tiny_trace) -> None:
    result, index = _run(tiny_trace, "round_robin")
    assert [(r.line, r.g1_hit_tokens) for r in result.records] == [(1, 0), (2, 0), (3, 0),
                                                                   (4, 32)]
    assert index.removed_blocks == 3
    assert result.prompt_tokens == 65 * 3 + 97
    assert result.recomputed_tokens == result.prompt_tokens - 32
    assert result.hints == {}


def test_kvhint_retains_the_tool_gap_session_through_the_pressure(tiny_trace) -> None:
    result, index = _run(tiny_trace, "kvhint")
    assert [(r.line, r.g1_hit_tokens) for r in result.records] == [(1, 0), (2, 0), (3, 0),
                                                                   (4, 64)]
    assert index.removed_blocks == 2
    hints = result.hints_by_action()
    assert hints["kv.retain"]["sent"] >= 3  # one per finished response at least
    assert sum(n for s, n in hints["kv.retain"].items() if s != "sent") == \
        hints["kv.retain"]["sent"]  # every action answered


@pytest.mark.parametrize(("end_ms", "ended_at"), [(15_000, 15.0), (25_000, 25.0),
                                                  (10_000, None)])
def test_a_session_ended_through_the_api_ends_when_the_end_came(
        tmp_path: Path, end_ms: int, ended_at: float | None) -> None:
    """An end line (the recorder's for ``DELETE /v1/sessions/{id}``): the planner ends
    s2 at that time, or when its response ends if the end came while it ran (10 s)."""
    end = {"timestamp": end_ms, "session_id": "s2", "end": True}
    rows = sorted([*ROWS, end], key=lambda r: r["timestamp"])  # stable: after s2's turn
    path = tmp_path / "ended.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sim = Simulation(load_trace(path, block_size=32),
                     SimConfig(workers=1, gpu_blocks=6, block_size=32), "kvhint")
    sim.run()
    s2 = sim.sessions["default/s2"]
    assert s2.ended and not s2.awaiting_return
    if ended_at is None:  # s2's response ended after 10 s: the end waited for it
        assert 10.0 < s2.last_activity < 10.5
    else:
        assert s2.last_activity == ended_at
    assert not sim.sessions["default/s3"].ended


@pytest.mark.parametrize("engine", ["fast", "scheduler"])
def test_host_tier_serves_the_continuation_of_a_g1_hit(tiny_trace, engine: str) -> None:
    """With 6 host blocks (vLLM's CPU offloading manager, LRU) every computed block is also
    stored in G2; r4 finds block 10 in G1 and its child 11 (evicted from G1 by r3) in G2.
    The scheduler engine runs vLLM's OffloadingConnector itself, beside the plugin."""
    sim = Simulation(tiny_trace, SimConfig(workers=1, gpu_blocks=6, host_blocks=6,
                                           block_size=32, keep_records=True, engine=engine),
                     "round_robin")
    result = sim.run()
    assert [(r.line, r.g1_hit_tokens, r.g2_hit_tokens, r.computed_tokens)
            for r in result.records] == [
        (1, 0, 0, 65), (2, 0, 0, 65), (3, 0, 0, 65), (4, 32, 32, 33)]
    host = sim.workers["w0"].host
    assert host is not None
    if engine == "fast":
        assert host.counters.loaded_blocks == 1
    # The router's index saw the host copies as tier CPU.
    assert sim.index.stats().entries_by_tier["CPU"] == 6
    assert result.to_json()["g2_token_hit_rate"] == pytest.approx(32 / result.prompt_tokens)


@pytest.mark.parametrize("engine", ["fast", "scheduler"])
def test_same_seed_same_result_on_two_workers(tmp_path: Path, engine: str) -> None:
    from kvhint.router.sim.agents import AgentWorkloadSpec, write_agent_trace

    path = tmp_path / "agents.jsonl"
    write_agent_trace(path, AgentWorkloadSpec(sessions=30, duration_s=120.0, seed=3,
                                              block_size=32, system_prompt_tokens=96,
                                              tool_schema_tokens=64, first_user_tokens=64,
                                              turn_tokens=48, output_tokens=16, max_turns=6))
    trace = load_trace(path, block_size=32)

    def run(policy: str, seed: int) -> dict:
        config = SimConfig(workers=2, gpu_blocks=40, block_size=32, seed=seed, engine=engine)
        out = Simulation(trace, config, policy).run().to_json()
        out.pop("wall_s")
        return out

    for policy in ("kv_aware", "kvhint"):
        first = run(policy, 1)
        assert first == run(policy, 1)
        assert first["requests"] == len(trace.requests) and first["dropped_requests"] == 0
    hints = run("kvhint", 1)["hints"]
    assert hints and all(counts.get("sent", 0) > 0 for counts in hints.values())


def test_forked_parallel_runs_equal_serial_runs_with_a_host_tier(tmp_path: Path) -> None:
    """``kvhint sim run --jobs 2`` (forked processes) gives exactly the serial results,
    hints and host tier included: each policy's run depends only on its seed."""
    from kvhint.router.sim.agents import AgentWorkloadSpec, write_agent_trace
    from kvhint.router.sim.runner import run_policies

    path = tmp_path / "agents.jsonl"
    write_agent_trace(path, AgentWorkloadSpec(sessions=20, duration_s=90.0, seed=5,
                                              block_size=32, system_prompt_tokens=96,
                                              tool_schema_tokens=64, first_user_tokens=64,
                                              turn_tokens=48, output_tokens=16, max_turns=5))
    trace = load_trace(path, block_size=32)
    config = SimConfig(workers=2, gpu_blocks=30, host_blocks=40, block_size=32, seed=7)
    policies = ["kv_aware", "kvhint"]

    def strip(results):
        rows = [r.to_json() for r in results]
        for row in rows:
            row.pop("wall_s")
        return rows

    serial = strip(run_policies(trace, config, policies, jobs=1, progress=None))
    forked = strip(run_policies(trace, config, policies, jobs=2, progress=None))
    assert serial == forked
    assert serial[1]["g2_token_hit_rate"] > 0 and serial[1]["hints"]


def test_new_sessions_placed_per_worker_reach_the_routing_policy(tmp_path: Path,
                                                               monkeypatch) -> None:
    """The live router feeds ``WorkerLoad.recent_sessions`` (new sessions placed per worker,
    decayed) to ``route()`` for ``new_session_spread``; the simulator must feed the same,
    or its kvhint routing differs from the router it stands for. A spy around the real
    ``route`` records what each decision saw."""
    import kvhint.router.sim.engine as engine

    rows = [{"timestamp": 1000 * i, "session_id": f"s{i}", "input_length": 65,
             "output_length": 0, "hash_ids": [1, 100 + i, 200 + i]} for i in range(3)]
    rows.append({"timestamp": 3000, "session_id": "s0", "input_length": 97,
                 "output_length": 0, "hash_ids": [1, 100, 300, 301]})
    path = tmp_path / "spread.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: list[tuple[dict[str, float], str]] = []
    real_route = engine.route

    def spy(ctx, request, rng):
        decision = real_route(ctx, request, rng)
        seen.append(({w.worker_id: w.recent_sessions for w in ctx.workers}, decision.worker_id))
        return decision

    monkeypatch.setattr(engine, "route", spy)
    config = SimConfig(workers=2, gpu_blocks=40, block_size=32, recent_half_life_s=1e9)
    Simulation(load_trace(path, block_size=32), config, "kvhint").run()
    assert len(seen) == 4
    for k, (sessions, _) in enumerate(seen):
        expected = {"w0": 0.0, "w1": 0.0}
        for _, worker in seen[:k]:  # decisions 0-2 placed new sessions; 3 is s0 returning
            expected[worker] += 1.0
        assert sessions == pytest.approx(expected)


def test_a_prompt_larger_than_the_pool_is_dropped_counted_and_said(tmp_path: Path) -> None:
    from kvhint.router.sim.report import table

    path = tmp_path / "big.jsonl"
    rows = ROWS[:1] + [{"timestamp": 5_000, "session_id": "big", "input_length": 320,
                        "output_length": 0, "hash_ids": list(range(500, 510))}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = Simulation(load_trace(path, block_size=32),
                        SimConfig(workers=1, gpu_blocks=6, block_size=32), "kvhint").run()
    assert (result.requests, result.dropped_requests) == (2, 1)
    assert result.prompt_tokens == 65  # the rates count the admitted request only
    assert "kvhint: 1 of 2 requests dropped" in table([result], [])
    assert result.to_json()["dropped_requests"] == 1


def test_turns_routed_away_from_their_sessions_worker_are_counted(tiny_trace) -> None:
    """On two workers round_robin alternates: r1 (s1) w0, r2 w1, r3 w0, r4 (s1) w1: one
    moved turn. session_affinity keeps s1 on its worker: none."""
    config = SimConfig(workers=2, gpu_blocks=6, block_size=32)
    moved = {policy: Simulation(tiny_trace, config, policy).run().to_json()["moved_turns"]
             for policy in ("round_robin", "session_affinity")}
    assert moved == {"round_robin": 1, "session_affinity": 0}
