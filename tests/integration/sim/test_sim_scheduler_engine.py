"""The simulator's ``scheduler`` engine: vLLM's real Scheduler, with the kvhint plugin
loaded as its KV connector, stepped in virtual time (router/sim/scheduler_worker.py).

Where scheduling cannot matter (one request at a time, prompts in one chunk) it gives
the fast engine's exact hits and evictions (test_sim_exact.py's hand-computed trace).
Where it does, the times are vLLM's steps: each step lasts ``decode_s_per_token`` plus its
prompt tokens at the prefill rate, so a prompt admitted beside a decoding request waits
for the step in flight and stretches that request's next step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.report import table
from kvhint.router.sim.timing import TimeModel
from kvhint.router.sim.trace import load_trace

from test_sim_exact import ROWS

TIMING = TimeModel(prefill_tokens_per_s=100_000.0, prefill_overhead_s=0.010,
                   decode_s_per_token=0.020)


def _trace(tmp_path: Path, rows: list[dict]):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_trace(path, block_size=32)


def _config(**overrides) -> SimConfig:
    values = dict(workers=1, gpu_blocks=6, block_size=32, keep_records=True,
                  engine="scheduler", timing=TIMING)
    values.update(overrides)
    return SimConfig(**values)


def test_one_request_at_a_time_gives_the_fast_engines_exact_hits(tmp_path: Path) -> None:
    trace = _trace(tmp_path, ROWS)
    for policy, last_hit, removed in (("round_robin", 32, 3), ("kvhint", 64, 2)):
        sim = Simulation(trace, _config(), policy)
        result = sim.run()
        assert [(r.line, r.g1_hit_tokens) for r in result.records] == [
            (1, 0), (2, 0), (3, 0), (4, last_hit)], policy
        assert sim.index.stats().removed_blocks == removed, policy
        assert result.prompt_tokens == 65 * 3 + 97
        assert result.preemptions == 0 and result.dropped_requests == 0
    hints = result.hints_by_action()
    # The plugin inside vLLM's connector answered every Retain the planner sent.
    assert sum(n for s, n in hints["kv.retain"].items() if s != "sent") == \
        hints["kv.retain"]["sent"] >= 3


def test_a_prompt_admitted_beside_a_decode_waits_for_the_step_and_stretches_it(
        tmp_path: Path) -> None:
    """r1 (64-token prompt, 5 output tokens) arrives at 0; r2 (1,024 tokens, 1 output)
    at 50 ms, while r1 decodes. Steps: 0 -> 20.64 ms (r1's prompt, its first token),
    -> 40.64, -> 60.64 (decodes), -> 60.64 + 20 + 10.24 = 90.88 ms (r1's decode and r2's
    whole prompt: r2's first token, TTFT 40.88 ms), -> 110.88 (r1's fifth token). The
    fast engine prefills each prompt alone, at its arrival: TTFTs 10 + 0.64 and
    10 + 10.24 ms."""
    rows = [
        {"timestamp": 0, "session_id": "a", "input_length": 64, "output_length": 5,
         "hash_ids": [1, 2]},
        {"timestamp": 50, "session_id": "b", "input_length": 1024, "output_length": 1,
         "hash_ids": list(range(100, 132))},
    ]
    trace = _trace(tmp_path, rows)
    sim = Simulation(trace, _config(gpu_blocks=64), "round_robin")
    result = sim.run()
    assert result.ttfts_s == pytest.approx([0.02064, 0.04088])
    assert sim.now == pytest.approx(0.11088)
    assert [r.start_s for r in result.records] == pytest.approx([0.0, 0.06064])

    fast = Simulation(trace, _config(gpu_blocks=64, engine="fast"), "round_robin").run()
    assert fast.ttfts_s == pytest.approx([0.01064, 0.02024])


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget(tmp_path: Path) -> None:
    """4,096 prompt tokens under a 2,048-token budget: two steps of 20 + 20.48 ms."""
    rows = [{"timestamp": 0, "session_id": "a", "input_length": 4096, "output_length": 1,
             "hash_ids": list(range(1, 129))}]
    result = Simulation(_trace(tmp_path, rows),
                        _config(gpu_blocks=160, max_num_batched_tokens=2048),
                        "round_robin").run()
    assert result.ttfts_s == pytest.approx([2 * (0.020 + 0.02048)])


def test_running_out_of_blocks_preempts_and_every_request_still_finishes(
        tmp_path: Path) -> None:
    """Two 64-token prompts with 120 output tokens each (6 blocks apiece at the end) in a
    pool of 8: vLLM preempts one to let the other decode, and recomputes it later."""
    rows = [
        {"timestamp": 0, "session_id": s, "input_length": 64, "output_length": 120,
         "hash_ids": [base, base + 1]}
        for s, base in (("a", 1), ("b", 10))
    ]
    sim = Simulation(_trace(tmp_path, rows), _config(gpu_blocks=8), "round_robin")
    result = sim.run()
    assert result.preemptions >= 1
    assert result.requests == 2 and len(result.ttfts_s) == 2
    assert not any(w.active_requests for w in sim.workers.values())
    assert result.to_json()["preemptions"] == result.preemptions
    assert f"round_robin: vLLM preempted {result.preemptions} running requests" in table(
        [result], [])


@pytest.mark.parametrize("overrides, message", [
    ({"engine": "turbo"}, "unknown engine 'turbo'"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
])
def test_bad_engine_settings_are_refused_before_anything_runs(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_the_command_line_runs_the_scheduler_engine(
        tmp_path: Path, capsys) -> None:
    from kvhint.router.cli import main

    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["sim", "run", "--trace", str(path), "--gpu-blocks", "6", "--block-size", "32",
            "--router", "round_robin,kvhint", "--no-reference", "--no-progress", "--json",
            "--engine", "scheduler", "--max-num-batched-tokens", "64", "--max-num-seqs", "2"]
    assert main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in rows] == ["round_robin", "kvhint"]
    # 65-token prompts in chunks of 64: each takes two steps, hits as the fast engine's.
    assert [r["recomputed_tokens"] for r in rows] == [65 * 3 + 97 - 32, 65 * 3 + 97 - 64]
    assert all(r["preemptions"] == 0 and "itl_p50_s" in r for r in rows)
    assert main([*args, "--host-blocks", "6"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["g2_token_hit_rate"] == pytest.approx(32 / (65 * 3 + 97))
