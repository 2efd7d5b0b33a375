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
import subprocess
import sys
from pathlib import Path

import pytest

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.timing import TimeModel
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


# Sessions minutes and an hour apart, with tool calls, answers and an API end: hours of
# virtual time in which every worker is idle between a few requests.
GAPPY = [
    {"timestamp": 0, "session_id": "a", "input_length": 65, "output_length": 8,
     "hash_ids": [1, 2, 3], "finish_reason": "tool_calls", "tool_names": ["build"]},
    {"timestamp": 2_000, "session_id": "b", "input_length": 70, "output_length": 4,
     "hash_ids": [1, 4, 5]},
    {"timestamp": 3_000, "session_id": "c", "input_length": 70, "output_length": 4,
     "hash_ids": [1, 6, 7]},
    {"timestamp": 95_000, "session_id": "a", "input_length": 100, "output_length": 8,
     "hash_ids": [1, 2, 8, 9]},
    {"timestamp": 400_000, "session_id": "b", "end": True},
    {"timestamp": 3_600_000, "session_id": "c", "input_length": 110, "output_length": 3,
     "hash_ids": [1, 6, 10, 11]},
    {"timestamp": 3_660_000, "session_id": "d", "input_length": 66, "output_length": 2,
     "hash_ids": [1, 12, 13]},
    {"timestamp": 7_200_000, "session_id": "a", "input_length": 140, "output_length": 5,
     "hash_ids": [1, 2, 8, 14, 15]},
]


@pytest.mark.parametrize(("engine", "host_blocks"), [("fast", 0), ("fast", 8), ("scheduler", 0)])
def test_idle_ticks_are_skipped_and_nothing_measured_changes(tmp_path: Path, monkeypatch,
                                                             engine: str, host_blocks: int):
    """Ticks run every 5 s of virtual time; while every worker is idle most do nothing, and
    a trace with hours between requests (or stamped in epoch ms) spent its run on them.
    The skipping run must give exactly what ticking through every one gives, for every
    policy, hints and host tier included."""
    path = tmp_path / "gappy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GAPPY))
    trace = load_trace(path, block_size=32)
    config = SimConfig(workers=2, gpu_blocks=8, host_blocks=host_blocks, block_size=32,
                       keep_records=True, engine=engine)
    ticks = 0
    on_tick = Simulation._on_tick

    def counted(self) -> None:
        nonlocal ticks
        ticks += 1
        on_tick(self)

    monkeypatch.setattr(Simulation, "_on_tick", counted)

    def run(policy: str, skip: bool) -> tuple[dict, list, int]:
        nonlocal ticks
        ticks = 0
        sim = Simulation(trace, config, policy)
        if not skip:
            sim._next_tick = lambda index: index + 1  # every tick, as before skipping
        result = sim.run()
        out = result.to_json()
        out.pop("wall_s")
        return out, result.records, ticks

    for policy in ("round_robin", "session_affinity", "kv_aware", "kvhint"):
        skipped, every = run(policy, skip=True), run(policy, skip=False)
        assert skipped[:2] == every[:2], policy
        assert every[2] >= 7_200 // 5  # two hours of ticks
        assert skipped[2] < every[2] // 4, (policy, skipped[2], every[2])
    assert skipped[0]["hints"]  # kvhint sent hints across the gaps
    # The hit-rate timeline lists the minutes with admissions, not every minute between.
    timeline = Simulation(trace, config, "round_robin").run().timeline
    assert [(p.start_s, p.prompt_tokens) for p in timeline] == [
        (0.0, 65 + 70 + 70), (60.0, 100), (3600.0, 110), (3660.0, 66), (7200.0, 140)]


def test_a_trace_stamped_in_epoch_ms_runs_in_moments(tmp_path: Path) -> None:
    """Timestamps in epoch ms (a router recording's wall clock): the first request comes
    1.7e9 virtual seconds in. Ticking every 5 s from 0 to it never ended."""
    path = tmp_path / "epoch.jsonl"
    path.write_text(
        '{"timestamp": 1733241600000, "input_length": 1024, "output_length": 10, '
        '"hash_ids": [1, 2]}\n'
        '{"timestamp": 1733241601000, "input_length": 1024, "output_length": 10, '
        '"hash_ids": [1, 3]}\n')
    command = [sys.executable, "-c", "import sys; from kvhint.router.cli import main; "
               "sys.exit(main(sys.argv[1:]))", "sim", "run", "--trace", str(path),
               "--gpu-blocks", "64", "--router", "all", "--jobs", "1", "--json", "--no-progress"]
    # One process (--jobs 1), so a timeout leaves no forked child behind.
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["policy"] for row in rows] == ["round_robin", "session_affinity", "kv_aware",
                                               "kvhint", "oracle", "unbounded"]
    assert all(row["recomputed_tokens"] == 2048 - 512 for row in rows)  # block 1 hits


def test_block_ids_a_token_vocabulary_apart_are_different_blocks(tmp_path: Path) -> None:
    """A block's tokens come from its id modulo 2**30 (the headless token vocabulary):
    ids 5 and 2**30 + 5 named the same block, and a prompt hit a prefix it never shared.
    The simulator interns the trace's ids first."""
    big = 1 << 30
    path = tmp_path / "ids.jsonl"
    rows = [{"timestamp": 0, "input_length": 65, "output_length": 1, "hash_ids": [5, 6, 7]},
            {"timestamp": 1000, "input_length": 65, "output_length": 1,
             "hash_ids": [big + 5, big + 6, 8]},
            {"timestamp": 2000, "input_length": 65, "output_length": 1,
             "hash_ids": [2 ** 70 + 5, 2 ** 70 + 6, 9]},
            {"timestamp": 3000, "input_length": 65, "output_length": 1,
             "hash_ids": [5, 6, 10]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = SimConfig(workers=1, gpu_blocks=32, block_size=32, keep_records=True)
    result = Simulation(load_trace(path, block_size=32), config, "round_robin").run()
    assert [(r.line, r.g1_hit_tokens) for r in result.records] == [
        (1, 0), (2, 0), (3, 0), (4, 64)]


def test_the_fast_engine_streams_one_token_per_decode_step(tmp_path: Path) -> None:
    """The prefill yields the first token, then one decode step per further token: the
    time between tokens is the decode step (it was n/(n-1) of it), and the response ends
    (n - 1) steps after its first token."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 65, "output_length": 5,
                                "hash_ids": [1, 2, 3]}) + "\n")
    config = SimConfig(workers=1, gpu_blocks=8, block_size=32,
                       timing=TimeModel(decode_s_per_token=0.02))
    result = Simulation(load_trace(path, block_size=32), config, "round_robin").run()
    assert result.itls_s == [pytest.approx(0.02)]
    assert result.ttfts_s == [pytest.approx(0.010 + 65 / 100_000)]
