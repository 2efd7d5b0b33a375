"""The simulator against real vLLM: the router's recording of a live agent-bench run
(tests/benchmarks/sim/recorded/agents_2x16k.jsonl: 2 vLLM CPU workers x 16,384 tokens,
120 requests; BENCHMARKS.md, "The simulator against a live run") replays to the hit
rate the live workers reported: 123,360 of 166,845 prompt tokens cached (73.94%)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace

RECORDED = Path(__file__).parents[2] / "benchmarks" / "sim" / "recorded" / "agents_2x16k.jsonl"
LIVE_CACHED, LIVE_PROMPT = 123_360, 166_845


@pytest.mark.parametrize("engine", ["fast", "scheduler"])
def test_a_recorded_live_run_replays_to_the_live_hit_rate(engine: str) -> None:
    """Both engines; the scheduler engine with the CPU server's own scheduler settings."""
    trace = load_trace(RECORDED, block_size=32)
    assert sum(r.input_length for r in trace.requests) == pytest.approx(LIVE_PROMPT, abs=64)
    config = SimConfig(workers=2, gpu_blocks=512, block_size=32, engine=engine,
                       max_num_batched_tokens=2048, max_num_seqs=128)
    result = Simulation(trace, config, "kvhint").run()
    hit = result.g1_hit_tokens + result.g2_hit_tokens
    assert hit == pytest.approx(LIVE_CACHED, abs=3 * 32)  # within three blocks
