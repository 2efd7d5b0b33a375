"""Fitting the simulator's time model to a recording's served TTFT and ITL
(router/sim/calibrate.py, ``kvhint sim run --prefill-tokens-per-s fit``).

The served times here are the simulator's own at a known prefill rate and decode step,
written into the trace as a router recording would carry them: the fit has to find them
again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint.router.cli import main
from kvhint.router.sim.agents import AgentWorkloadSpec, generate
from kvhint.router.sim.calibrate import fit_time_model
from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.results import percentile
from kvhint.router.sim.timing import TimeModel
from kvhint.router.sim.trace import load_trace

KNOWN_RATE = 20_000.0
KNOWN_DECODE_S = 0.005
SPEC = AgentWorkloadSpec(sessions=12, duration_s=40.0, seed=2, block_size=32,
                         system_prompt_tokens=256, tool_schema_tokens=128,
                         first_user_tokens=256, turn_tokens=128, output_tokens=8, max_turns=4)


def _config(engine: str, rate: float = KNOWN_RATE, decode_s: float = KNOWN_DECODE_S
            ) -> SimConfig:
    return SimConfig(workers=2, gpu_blocks=128, block_size=32, engine=engine,
                     timing=TimeModel(prefill_tokens_per_s=rate, prefill_overhead_s=0.002,
                                      decode_s_per_token=decode_s))


# Busier than SPEC (whose sessions spread over minutes of tool and user gaps): a new
# 640-token prompt every 20 ms, answers of 32 tokens, so decodes share steps with prompts.
BUSY = [{"timestamp": 20 * i, "session_id": f"s{i}", "input_length": 640, "output_length": 32,
         "hash_ids": [1000 * i + k for k in range(20)]} for i in range(60)]


def _recording(tmp_path: Path, engine: str, rows: list[dict] | None = None,
               with_itl: bool = False) -> Path:
    """The workload, every line carrying the served medians at the known time model."""
    rows = rows or generate(SPEC)
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps(r) + "\n" for r in rows))
    served = Simulation(load_trace(bare, block_size=32), _config(engine), "kvhint").run()
    times = {"ttft_ms": round(percentile(served.ttfts_s, 50) * 1000, 3)}
    if with_itl:
        times["itl_ms"] = round(percentile(served.itls_s, 50) * 1000, 3)
    path = tmp_path / "recorded.jsonl"
    path.write_text("".join(json.dumps({**r, **times}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("engine", ["fast", "scheduler"])
def test_the_fit_finds_the_rate_the_times_were_served_at(tmp_path: Path, engine: str) -> None:
    trace = load_trace(_recording(tmp_path, engine), block_size=32)
    seen: list[tuple[float, float, float]] = []
    fit = fit_time_model(trace, _config(engine, rate=1.0), "kvhint",
                         on_run=lambda rate, decode_s, result: seen.append(
                             (rate, decode_s, percentile(result.ttfts_s, 50))))
    assert fit.runs == len(seen) == 8
    assert fit.tokens_per_s == pytest.approx(KNOWN_RATE, rel=0.10)
    assert fit.decode_s_per_token == KNOWN_DECODE_S and fit.served_itl_p50_s is None
    assert fit.simulated_ttft_p50_s == pytest.approx(fit.served_ttft_p50_s, rel=0.05)
    assert (fit.tokens_per_s, KNOWN_DECODE_S, fit.simulated_ttft_p50_s) in seen


def test_the_scheduler_engine_fits_its_decode_step_to_the_served_itl(tmp_path: Path) -> None:
    """A served ITL is a decode step stretched by the prompt chunks beside it: starting
    from the ITL itself (the CLI's default decode step), the fit comes back down to the
    step the times were served with."""
    path = _recording(tmp_path, "scheduler", BUSY, with_itl=True)
    trace = load_trace(path, block_size=32)
    served_itl = trace.served_decode_s_per_token()[0]
    assert served_itl > 1.1 * KNOWN_DECODE_S  # the stretch the fit must undo
    fit = fit_time_model(trace, _config("scheduler", rate=1.0, decode_s=served_itl), "kvhint")
    assert fit.runs == 8 + 3 * 6
    assert fit.decode_s_per_token == pytest.approx(KNOWN_DECODE_S, rel=0.10)
    assert fit.tokens_per_s == pytest.approx(KNOWN_RATE, rel=0.15)
    assert fit.simulated_itl_p50_s == pytest.approx(served_itl, rel=0.05)
    assert fit.served_itl_p50_s == pytest.approx(served_itl)
    # Told the decode step, the fit leaves it alone.
    told = fit_time_model(trace, _config("scheduler", rate=1.0), "kvhint", fit_decode=False)
    assert told.runs == 8 and told.decode_s_per_token == KNOWN_DECODE_S


def test_a_trace_without_served_ttfts_cannot_be_fitted(tmp_path: Path, capsys) -> None:
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps(r) + "\n" for r in generate(SPEC)))
    with pytest.raises(ValueError, match="no ttft_ms"):
        fit_time_model(load_trace(bare, block_size=32), _config("fast"), "kvhint")
    args = ["sim", "run", "--trace", str(bare), "--gpu-blocks", "64", "--block-size", "32",
            "--router", "kvhint", "--no-reference", "--no-progress"]
    assert main([*args, "--prefill-tokens-per-s", "fit"]) == 2
    assert "fit: the trace has no ttft_ms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--prefill-tokens-per-s", "fast please"])
    assert "a number of tokens/s or fit, got 'fast please'" in capsys.readouterr().err


def test_the_command_line_fits_then_simulates_at_the_fitted_rate(tmp_path: Path,
                                                                 capsys) -> None:
    path = _recording(tmp_path, "fast")
    assert main(["sim", "run", "--trace", str(path), "--workers", "2", "--gpu-blocks", "128",
                 "--block-size", "32", "--router", "kv_aware,kvhint", "--no-reference",
                 "--no-progress", "--json", "--prefill-overhead-s", "0.002",
                 "--decode-s-per-token", "0.005", "--prefill-tokens-per-s", "fit"]) == 0
    out, err = capsys.readouterr()
    assert err.count("[sim] fit: ") == 8 and "(kvhint)" in err
    fitted = float(err.split("[sim] prefill ")[1].split(" tokens/s")[0].replace(",", ""))
    assert fitted == pytest.approx(KNOWN_RATE, rel=0.10)
    kvhint = [json.loads(line) for line in out.splitlines()][1]
    trace = load_trace(path, block_size=32)
    again = Simulation(trace, _config("fast", rate=fitted), "kvhint").run()
    assert kvhint["ttft_p50_s"] == pytest.approx(percentile(again.ttfts_s, 50), abs=1e-5)
