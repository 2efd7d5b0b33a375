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
