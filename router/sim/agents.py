"""``kvhint sim gen-agents``: synthetic agent workloads in kvhint's session JSONL.

Sessions of a few agent types. Every prompt starts with its type's system prompt and tool
schemas (shared by all sessions of the type), then the session's own history, which grows
each turn by the previous output and a new message (a tool result or a user message), so
turn k+1's blocks extend turn k's full blocks, like the Mooncake trace. After each
response the agent calls a tool (``finish_reason: tool_calls``, with the tool's name) or
waits for its user (``stop``); the gap before the next turn is log-normal (heavy-tailed)
with a median per tool: fast tools (search) come back in seconds, slow ones (a build, a
human approval) in minutes. The last turn ends the session explicitly (``end: true``) with
``explicit_end_probability``, else the session is abandoned.

Deterministic: one ``random.Random(seed)``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass, fields
from pathlib import Path

from kvhint.router.sim.report import write_atomic

# Tool medians relative to tool_gap_median_s: fast lookups to slow builds and approvals.
_TOOL_SCALES = (0.25, 1.0, 4.0, 16.0)
_TOOL_NAMES = ("search", "read_file", "run_tests", "ask_human", "browse", "edit_file",
               "shell", "deploy")


@dataclass(frozen=True)
class AgentWorkloadSpec:
    sessions: int = 400
    duration_s: float = 1800.0
    block_size: int = 512
    agent_types: int = 4
    system_prompt_tokens: int = 2048
    tool_schema_tokens: int = 1536
    tools_per_agent: int = 4
    first_user_tokens: int = 1024
    turn_tokens: int = 700
    output_tokens: int = 200
    mean_turns: float = 8.0
    max_turns: int = 40
    tool_call_probability: float = 0.75
    tool_gap_median_s: float = 8.0
    tool_gap_sigma: float = 1.0
    user_gap_median_s: float = 45.0
    user_gap_sigma: float = 1.2
    explicit_end_probability: float = 0.5
    decode_s_per_token: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "seed":
                _check_spec_value(f.name, getattr(self, f.name))
        if self.block_size % 32:
            raise ValueError("block_size must be a multiple of 32")
        if self.mean_turns < 1:
            raise ValueError("mean_turns must be >= 1")


# Must be > 0: counts the workload cannot do without, and what the generator divides by
# or takes the log of (a gap median of 0 is log(0)); the rest must be >= 0.
_POSITIVE = frozenset({"sessions", "block_size", "agent_types", "tools_per_agent",
                       "mean_turns", "max_turns", "duration_s", "tool_gap_median_s",
                       "user_gap_median_s"})


def _check_spec_value(name: str, value: float) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is finite and in its range
    (nan compares false with everything, so each range is stated as what must hold)."""
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if name.endswith("probability"):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be within 0..1, got {value}")
    elif name in _POSITIVE:
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    elif not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def generate(spec: AgentWorkloadSpec) -> list[dict[str, object]]:
    """The workload as session-JSONL rows, sorted by timestamp (ms)."""
    rng = random.Random(spec.seed)
    ids = itertools.count()
    bs = spec.block_size
    prefix_tokens = spec.system_prompt_tokens + spec.tool_schema_tokens
    # Shared prefix blocks per agent type (only whole blocks can be shared; the partial
    # block at the seam belongs to each session).
    shared_blocks = [[next(ids) for _ in range(prefix_tokens // bs)]
                     for _ in range(spec.agent_types)]
    # A tool's gap scale goes with its name, whichever agent type calls it.
    tools = [[_tool(a * spec.tools_per_agent + t) for t in range(spec.tools_per_agent)]
             for a in range(spec.agent_types)]
    rows: list[tuple[float, int, dict[str, object]]] = []
    order = itertools.count()
    for s in range(spec.sessions):
        agent = rng.randrange(spec.agent_types)
        start = rng.uniform(0.0, spec.duration_s)
        turns = min(spec.max_turns, 1 + int(rng.expovariate(1.0 / (spec.mean_turns - 1)))
                    if spec.mean_turns > 1 else 1)
        ends = rng.random() < spec.explicit_end_probability
        tokens = prefix_tokens + _around(rng, spec.first_user_tokens)
        blocks = list(shared_blocks[agent])
        at = start
        for turn in range(1, turns + 1):
            needed = -(-tokens // bs)
            full_kept = min(len(blocks), tokens // bs)
            # Keep the previous turn's full blocks; new ids for everything after them.
            blocks = blocks[:full_kept] + [next(ids) for _ in range(needed - full_kept)]
            output = max(1, _around(rng, spec.output_tokens))
            last = turn == turns
            if last or rng.random() >= spec.tool_call_probability:
                finish, tool_names = "stop", []
                gap = rng.lognormvariate(math.log(spec.user_gap_median_s), spec.user_gap_sigma)
                new_tokens = _around(rng, spec.turn_tokens)
            else:
                name, scale = tools[agent][rng.randrange(len(tools[agent]))]
                finish, tool_names = "tool_calls", [name]
                gap = rng.lognormvariate(math.log(spec.tool_gap_median_s * scale),
                                         spec.tool_gap_sigma)
                new_tokens = _around(rng, spec.turn_tokens)
            row: dict[str, object] = {
                "timestamp": int(round(at * 1000)),
                "session_id": f"a{agent}-s{s:05d}",
                "turn": turn,
                "input_length": tokens,
                "output_length": output,
                "hash_ids": blocks,
                "finish_reason": finish,
            }
            if tool_names:
                row["tool_names"] = tool_names
            if last and ends:
                row["end"] = True
            rows.append((at, next(order), row))
            # The next turn's prompt: this prompt + the output + the new message.
            previous_full = tokens // bs
            tokens += output + new_tokens
            blocks = blocks[:previous_full]
            at += output * spec.decode_s_per_token + gap
    rows.sort(key=lambda r: (r[0], r[1]))
    return [r[2] for r in rows]


def _tool(index: int) -> tuple[str, float]:
    i = index % len(_TOOL_NAMES)
    return _TOOL_NAMES[i], _TOOL_SCALES[i % len(_TOOL_SCALES)]


def _around(rng: random.Random, mean: int) -> int:
    """A positive integer around ``mean`` (uniform 0.5x..1.5x)."""
    return max(1, int(rng.uniform(0.5, 1.5) * mean))


def write_agent_trace(path: Path, spec: AgentWorkloadSpec) -> str:
    rows = generate(spec)
    data = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
    write_atomic(path, data.encode())
    sessions = len({r["session_id"] for r in rows})
    tools = sum(1 for r in rows if r["finish_reason"] == "tool_calls")
    prompt = sum(int(r["input_length"]) for r in rows)  # type: ignore[arg-type]
    return (f"{len(rows)} requests, {sessions} sessions, {tools} tool calls, "
            f"{prompt:,} prompt tokens")
