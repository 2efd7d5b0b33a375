"""gen-agents workloads and the `kvhint sim` command line (bad input stops, nothing written)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kvhint.router.cli import main
from kvhint.router.sim.agents import AgentWorkloadSpec, generate
from kvhint.router.sim.cli import parse_policies
from kvhint.router.sim.trace import load_trace


def test_gen_agents_is_deterministic_and_a_valid_session_trace(tmp_path):
    spec = AgentWorkloadSpec(sessions=40, duration_s=120.0, seed=5)
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(AgentWorkloadSpec(sessions=40, duration_s=120.0, seed=6))
    out = tmp_path / "agents.jsonl"
    assert main(["sim", "gen-agents", "--out", str(out), "--sessions", "40",
                 "--duration-s", "120", "--seed", "5"]) == 0
    trace = load_trace(out)
    assert trace.format == "session" and trace.sessions == 40
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == generate(spec)
    # Sessions of one agent type share their system prompt + tool schema blocks.
    first_blocks = {}
    for row in rows:
        agent = row["session_id"].split("-")[0]
        first_blocks.setdefault(agent, set()).add(tuple(row["hash_ids"][:6]))
    assert all(len(prefixes) == 1 for prefixes in first_blocks.values())
    # Each turn extends the previous turn's full blocks.
    by_session: dict[str, list[dict]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            full = prev["input_length"] // 512
            assert cur["hash_ids"][:full] == prev["hash_ids"][:full]
    assert any(r.get("end") for r in rows)
    assert all(("tool_names" in r) == (r["finish_reason"] == "tool_calls") for r in rows)


def test_tool_gaps_are_heavy_tailed_and_differ_by_tool():
    rows = generate(AgentWorkloadSpec(sessions=300, seed=1))
    by_session: dict[str, list[dict]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    gaps: dict[str, list[float]] = {}
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            if prev["finish_reason"] == "tool_calls":
                gap = (cur["timestamp"] - prev["timestamp"]) / 1000 - prev["output_length"] * 0.02
                gaps.setdefault(prev["tool_names"][0], []).append(gap)
    medians = {tool: statistics.median(v) for tool, v in gaps.items() if len(v) > 20}
    assert max(medians.values()) > 20 * min(medians.values())
    pooled = sorted(g for v in gaps.values() for g in v)
    assert pooled[int(0.99 * len(pooled))] > 20 * pooled[len(pooled) // 2]


def test_bad_spec_values_are_refused():
    with pytest.raises(ValueError, match="tool_call_probability"):
        AgentWorkloadSpec(tool_call_probability=1.5)
    with pytest.raises(ValueError, match="sessions"):
        AgentWorkloadSpec(sessions=0)


def test_policy_lists():
    assert parse_policies("all") == ["round_robin", "session_affinity", "kv_aware", "kvhint"]
    assert parse_policies("kvhint, kv_aware,kvhint") == ["kvhint", "kv_aware"]
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        parse_policies("kvhint,lru")


def _trace_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_stops_on_bad_input_with_line_and_reason_and_writes_nothing(tmp_path, capsys):
    good = json.dumps({"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [1]})
    earlier = json.dumps({"timestamp": 1, "input_length": 512, "output_length": 1,
                          "hash_ids": [2]})
    plot = tmp_path / "hit.png"
    trace = _trace_file(tmp_path, [good, earlier])
    code = main(["sim", "run", "--trace", str(trace), "--gpu-blocks", "10", "--router",
                 "kvhint", "--plot", str(plot), "--json"])
    err = capsys.readouterr()
    assert code == 2
    assert f"{trace}:2:" in err.err and "timestamps must not decrease" in err.err
    assert err.out == "" and not plot.exists()
    assert list(tmp_path.iterdir()) == [trace]
    code = main(["sim", "run", "--trace", str(_trace_file(tmp_path, [good])), "--gpu-blocks",
                 "10", "--router", "kvhint,fifo"])
    assert code == 2 and "unknown policy 'fifo'" in capsys.readouterr().err
    code = main(["sim", "run", "--trace", str(trace), "--gpu-blocks", "10", "--plot",
                 str(tmp_path / "no" / "such" / "dir.png")])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    one = str(_trace_file(tmp_path, [good]))
    for flags, message in (
            (["--retain-budget-fraction", "1.5"],
             "--retain-budget-fraction: Input should be less than or equal to 1 (got 1.5)"),
            (["--limit", "0"], "--limit must be >= 1"),
            (["--jobs", "0"], "--jobs must be >= 1")):
        code = main(["sim", "run", "--trace", one, "--gpu-blocks", "10", *flags])
        err = capsys.readouterr()
        assert code == 2 and message in err.err and err.out == "", (flags, err)


def test_outputs_written_atomically_get_the_umask_mode_not_0600(tmp_path):
    import os
    import stat

    from kvhint.router.sim.report import write_atomic

    target = tmp_path / "out.png"
    write_atomic(target, b"data")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert target.read_bytes() == b"data" and len(list(tmp_path.iterdir())) == 1


def test_the_plot_gets_the_umask_mode_not_0600(tmp_path):
    import os
    import stat

    from kvhint.router.sim.report import plot
    from kvhint.router.sim.results import PolicyResult, TimelinePoint

    result = PolicyResult("kvhint")
    result.timeline = [TimelinePoint(0.0, prompt_tokens=10, hit_tokens=5),
                       TimelinePoint(60.0, prompt_tokens=10, hit_tokens=2)]
    target = tmp_path / "hits.png"
    plot(target, [result], [], "t")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert target.read_bytes()[:4] == b"\x89PNG"


def test_a_recorded_traces_served_decode_time_is_the_default(tmp_path, capsys):
    rows = [{"timestamp": 100 * n, "session_id": "s", "input_length": 40 + n,
             "output_length": 4, "hash_ids": [1, 100 + n], "itl_ms": 40 + 10 * n,
             "ttft_ms": 200}
            for n in range(3)]
    trace = str(_trace_file(tmp_path, [json.dumps(r) for r in rows]))
    args = ["sim", "run", "--trace", trace, "--gpu-blocks", "64", "--block-size", "32",
            "--router", "kvhint", "--no-reference", "--no-progress", "--json"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "decode 50.00 ms per output token: the median of the 3 served responses" in err
    assert "served (as recorded): TTFT p50 0.200s p99 0.200s over 3 streamed" in err
    assert main([*args, "--decode-s-per-token", "0.02"]) == 0
    assert "decode" not in capsys.readouterr().err  # given: used as it is


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--prefill-tokens-per-s", "nan", "--prefill-tokens-per-s must be a finite number > 0, "
                                      "got nan"),
    ("--prefill-tokens-per-s", "inf", "--prefill-tokens-per-s must be a finite number > 0, "
                                      "got inf"),
    ("--host-load-tokens-per-s", "0", "--host-load-tokens-per-s must be a finite number > 0"),
    ("--decode-s-per-token", "inf", "--decode-s-per-token must be a finite number >= 0, got inf"),
    ("--prefill-overhead-s", "nan", "--prefill-overhead-s must be a finite number >= 0, got nan"),
    ("--prefill-overhead-s", "-1", "--prefill-overhead-s must be a finite number >= 0, got -1"),
])
def test_non_finite_time_model_flags_are_refused(tmp_path, capsys, flag, value, message):
    """nan passed "<= 0" (every comparison with nan is false) and turned each simulated
    time into nan: refused up front, before the trace is read, like other bad flags."""
    missing = tmp_path / "absent.jsonl"  # the flag is checked before the trace is read
    code = main(["sim", "run", "--trace", str(missing), "--gpu-blocks", "10", flag, value])
    err = capsys.readouterr()
    assert code == 2 and message in err.err and err.out == ""


def test_the_time_model_itself_refuses_non_finite_values():
    from kvhint.router.sim.timing import TimeModel

    for field, value in (("prefill_tokens_per_s", float("nan")),
                         ("host_load_tokens_per_s", float("inf")),
                         ("decode_s_per_token", float("nan")),
                         ("prefill_overhead_s", float("inf"))):
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            TimeModel(**{field: value})


def test_the_fast_engines_decode_follows_the_first_token():
    """The prefill produces the first output token; n tokens need n - 1 decode steps."""
    from kvhint.router.sim.timing import TimeModel

    model = TimeModel(decode_s_per_token=0.02)
    assert [model.decode_s(n) for n in (0, 1, 2, 5)] == pytest.approx([0.0, 0.0, 0.02, 0.08])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("tool_gap_median_s", 0.0, "tool_gap_median_s must be > 0, got 0.0"),
    ("user_gap_median_s", 0.0, "user_gap_median_s must be > 0, got 0.0"),
    ("duration_s", float("inf"), "duration_s must be a finite number, got inf"),
    ("tool_gap_sigma", float("nan"), "tool_gap_sigma must be a finite number, got nan"),
    ("mean_turns", float("nan"), "mean_turns must be a finite number, got nan"),
    ("explicit_end_probability", float("nan"), "explicit_end_probability must be a finite"),
    ("decode_s_per_token", -0.5, "decode_s_per_token must be >= 0, got -0.5"),
])
def test_gen_agents_refuses_zero_gap_medians_and_non_finite_numbers(tmp_path, capsys, field,
                                                                    value, message):
    """A gap median of 0 crashed in math.log, and nan or inf went through the range checks
    (nan compares false) to crash later or write nonsense: refused, naming the field."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        AgentWorkloadSpec(**{field: value})
    out = tmp_path / "agents.jsonl"
    code = main(["sim", "gen-agents", "--out", str(out), "--sessions", "3",
                 f"--{field.replace('_', '-')}", str(value)])
    assert code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_percentiles_are_nearest_rank():
    """rank = ceil(q/100 * n): the p50 of two values is the lower (round() rounded 1.5 to
    2, half to even); q * n / 100 keeps 7 / 100 * 100 from ranking 8."""
    from kvhint.router.sim.results import percentile

    assert percentile([2.0, 1.0], 50) == 1.0
    assert percentile([4.0, 3.0, 2.0, 1.0], 50) == 2.0
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, q) for q in (0, 1, 7, 50, 99, 100)] == [1, 1, 7, 50, 99, 100]
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) == 0.0


@pytest.mark.parametrize("target", ["hits.xyz", "folder"])
def test_a_bad_plot_target_stops_before_the_trace_is_read(tmp_path, capsys, target):
    """An unsupported suffix or a directory used to fail in savefig/os.replace after the
    whole simulation, losing its results; now it stops first (the trace given does not
    even exist: the plot's problem is what is said)."""
    (tmp_path / "folder").mkdir()
    code = main(["sim", "run", "--trace", str(tmp_path / "absent.jsonl"), "--gpu-blocks",
                 "10", "--plot", str(tmp_path / target)])
    err = capsys.readouterr()
    assert code == 2 and err.out == ""
    assert "--plot:" in err.err and "absent.jsonl" not in err.err
    assert ("cannot write .xyz" in err.err) if target.endswith(".xyz") else (
        "is a directory" in err.err)


def test_the_results_are_printed_before_a_plot_that_fails(tmp_path, capsys, monkeypatch):
    """A plot that fails only when written (a full disk) costs the plot, not the results."""
    import kvhint.router.sim.report as report

    def no_room(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "plot", no_room)
    good = json.dumps({"timestamp": 0, "input_length": 64, "output_length": 1,
                       "hash_ids": [1, 2]})
    trace = str(_trace_file(tmp_path, [good]))
    code = main(["sim", "run", "--trace", trace, "--gpu-blocks", "16", "--block-size", "32",
                 "--router", "kv_aware", "--no-reference", "--no-progress", "--json",
                 "--plot", str(tmp_path / "hits.png")])
    out, err = capsys.readouterr()
    assert code == 2 and "No space left on device" in err
    assert [json.loads(line)["policy"] for line in out.splitlines()] == ["kv_aware"]


def test_gen_agents_out_a_directory_is_refused_before_generating(tmp_path, capsys):
    code = main(["sim", "gen-agents", "--out", str(tmp_path), "--sessions", "3"])
    err = capsys.readouterr().err
    assert code == 2 and f"--out: {tmp_path} is a directory" in err
    assert list(tmp_path.iterdir()) == []


def test_a_trace_block_size_of_zero_stops_the_run(tmp_path, capsys):
    good = json.dumps({"timestamp": 0, "input_length": 64, "output_length": 1,
                       "hash_ids": [1, 2]})
    code = main(["sim", "run", "--trace", str(_trace_file(tmp_path, [good])), "--gpu-blocks",
                 "16", "--block-size", "32", "--trace-block-size", "0"])
    assert code == 2 and "the trace's block size must be > 0, got 0" in capsys.readouterr().err
