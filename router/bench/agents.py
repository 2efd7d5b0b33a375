"""A multi-turn agent workload, for the router's e2e tests and benchmarks.

Each session is an agent: a shared system prompt (one of a few variants, as tool schemas
and instructions are shared in practice), its own task, then turns. A turn sends the whole
history; the response asks for a tool (``tool_choice="required"`` when the server can, so
the response really ends in tool calls), the client "runs" the tool for a while (the tool
gap) and appends its result; the last turn ends the session (``X-Session-End``). All
sessions run at once, so their histories compete for the workers' KV caches.

Every request streams with ``include_usage`` so the client sees the worker's
``prompt_tokens`` and ``cached_tokens`` and measures TTFT itself.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} tool",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string",
                                                             "enum": ["a", "b"]}},
                   "required": ["arg"]}}} for name in ("search", "read_file", "run_tests")]
TOOL_GAP_S = {"search": (0.5, 1.5), "read_file": (0.2, 0.8), "run_tests": (1.5, 3.0)}
# vLLM server flags that let a random-weight model answer tool_choice="required" with a
# real tool call: the tool parser, and JSON without free whitespace (else the grammar lets
# a random model emit blanks until max_tokens).
TOOL_CALL_WORKER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                         "--structured-outputs-config",
                         '{"backend": "xgrammar", "disable_any_whitespace": true}')


@dataclass(frozen=True)
class AgentWorkload:
    sessions: int = 24
    turns: int = 5
    system_words: int = 70        # ~5.5 tokens per word with the tiny tokenizer
    system_variants: int = 3
    task_words: int = 45
    tool_result_words: int = 40
    max_tokens: int = 12
    # Output budget of a turn that must end in a tool call (the call's JSON, ~45 tokens
    # with the tiny model's byte-level tokenizer).
    tool_max_tokens: int = 64
    # Sessions start this far apart (s), so early ones end while late ones run.
    stagger_s: float = 0.25
    # Requests in flight at once (the client's concurrency).
    max_in_flight: int = 8
    # The worker can answer tool_choice="required" (needs --tool-call-parser).
    tool_choice: bool = True
    gap_scale: float = 1.0
    model: str = "tiny"
    seed: int = 0
    # Connection failures (a router restarting) are retried this many times, 0.5 s apart,
    # as an agent runtime would; HTTP errors are not.
    connect_retries: int = 0


@dataclass
class TurnResult:
    session: str
    turn: int
    ok: bool
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    worker: str = ""
    finish_reason: str | None = None
    error: str = ""


@dataclass
class AgentRunResult:
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[TurnResult]:
        return [t for t in self.turns if t.ok]

    @property
    def failures(self) -> list[TurnResult]:
        return [t for t in self.turns if not t.ok]

    @property
    def cached_share(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.ok)
        return sum(t.cached_tokens for t in self.ok) / prompt if prompt else 0.0

    def ttft_quantile(self, q: float) -> float:
        values = sorted(t.ttft_s for t in self.ok)
        if not values:
            return float("nan")
        return values[min(int(q * len(values)), len(values) - 1)]

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.turns), "failed": len(self.failures),
            "prompt_tokens": sum(t.prompt_tokens for t in self.ok),
            "cached_tokens": sum(t.cached_tokens for t in self.ok),
            "cached_share": round(self.cached_share, 4),
            "ttft_p50_s": round(self.ttft_quantile(0.5), 4),
            "ttft_p99_s": round(self.ttft_quantile(0.99), 4),
            "tool_call_responses": sum(1 for t in self.ok if t.finish_reason == "tool_calls"),
            "wall_s": round(self.wall_s, 1),
            "cached_share_by_turn": self.cached_share_by_turn(),
            "moved_turns": self.moved_turns(),
        }

    def cached_share_by_turn(self) -> dict[int, float]:
        prompt: dict[int, int] = {}
        cached: dict[int, int] = {}
        for t in self.ok:
            prompt[t.turn] = prompt.get(t.turn, 0) + t.prompt_tokens
            cached[t.turn] = cached.get(t.turn, 0) + t.cached_tokens
        return {turn: round(cached[turn] / prompt[turn], 4) for turn in sorted(prompt)
                if prompt[turn]}

    def moved_turns(self) -> int | None:
        """Follow-up turns served by another worker than the session's previous turn
        (None when the server does not name the worker, ``x-kvhint-worker``)."""
        if not any(t.worker for t in self.turns):
            return None
        last: dict[str, str] = {}
        moved = 0
        for t in sorted(self.ok, key=lambda t: (t.session, t.turn)):
            if t.session in last and t.worker and last[t.session] != t.worker:
                moved += 1
            last[t.session] = t.worker
        return moved


def pooled_summary(rounds: Sequence[Sequence[TurnResult]], wall_s: float) -> dict[str, Any]:
    """One system over several rounds: shares and TTFT quantiles of all rounds' turns
    pooled; moved turns counted per round and summed (every round reuses the session
    names on newly started workers, so pooled turns would count each round's first turn
    as a move)."""
    summary = AgentRunResult([t for turns in rounds for t in turns], wall_s).summary()
    moves = [AgentRunResult(list(turns)).moved_turns() for turns in rounds]
    summary["moved_turns"] = None if None in moves else sum(m or 0 for m in moves)
    return summary


def _words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                            for _ in range(rng.randint(3, 8))) for _ in range(count))


class AgentClient:
    """Runs an :class:`AgentWorkload` against one OpenAI-compatible base URL."""

    def __init__(self, base_url: str, workload: AgentWorkload,
                 headers: Mapping[str, str] | None = None,
                 on_turn: Callable[[TurnResult], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.workload = workload
        self.headers = dict(headers or {})
        self.on_turn = on_turn
        self._rng = random.Random(workload.seed)
        self._systems = [_words(self._rng, workload.system_words)
                         for _ in range(workload.system_variants)]

    async def run(self) -> AgentRunResult:
        result = AgentRunResult()
        gate = asyncio.Semaphore(self.workload.max_in_flight)
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._session(http, gate, number, result)
                                   for number in range(self.workload.sessions)))
        result.wall_s = time.monotonic() - started
        return result

    async def _session(self, http: aiohttp.ClientSession, gate: asyncio.Semaphore,
                       number: int, result: AgentRunResult) -> None:
        w = self.workload
        rng = random.Random(w.seed * 1000 + number)
        await asyncio.sleep(number * w.stagger_s)
        session = f"agent-{w.seed}-{number}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self._systems[number % len(self._systems)]},
            {"role": "user", "content": "task: " + _words(rng, w.task_words)}]
        for turn in range(1, w.turns + 1):
            last = turn == w.turns
            async with gate:
                for _attempt in range(w.connect_retries + 1):
                    outcome, reply = await self._turn(http, session, turn, messages, last)
                    if outcome.status != 0:
                        break
                    await asyncio.sleep(0.5)
            result.turns.append(outcome)
            if self.on_turn is not None:
                self.on_turn(outcome)
            if last:
                return
            tool = self._tool_of(reply, rng)
            messages.append({"role": "assistant", "content": reply.get("content") or "",
                             "tool_calls": [{"id": f"call{turn}", "type": "function",
                                             "function": {"name": tool,
                                                          "arguments": '{"arg": "a"}'}}]})
            low, high = TOOL_GAP_S[tool]
            await asyncio.sleep(rng.uniform(low, high) * w.gap_scale)
            messages.append({"role": "tool", "tool_call_id": f"call{turn}",
                             "content": f"{tool} result: " + _words(rng, w.tool_result_words)})

    def _tool_of(self, reply: dict[str, Any], rng: random.Random) -> str:
        names = [c for c in reply.get("tools", []) if c in TOOL_GAP_S]
        return names[0] if names else rng.choice(list(TOOL_GAP_S))

    async def _turn(self, http: aiohttp.ClientSession, session: str, turn: int,
                    messages: list[dict[str, Any]], last: bool
                    ) -> tuple[TurnResult, dict[str, Any]]:
        w = self.workload
        body: dict[str, Any] = {"model": w.model, "messages": messages, "max_tokens": w.max_tokens,
                                "stream": True, "stream_options": {"include_usage": True},
                                "session_id": session, "temperature": 0.0}
        if w.tool_choice and not last:
            body["tools"] = TOOLS
            body["tool_choice"] = "required"
            body["max_tokens"] = w.tool_max_tokens
        headers = {**self.headers, "Content-Type": "application/json"}
        if last:
            headers["X-Session-End"] = "true"
        outcome = TurnResult(session, turn, ok=False, status=0)
        reply: dict[str, Any] = {"content": "", "tools": []}
        started = time.monotonic()
        try:
            async with http.post(f"{self.base_url}/v1/chat/completions", data=json.dumps(body),
                                 headers=headers) as response:
                outcome.status = response.status
                outcome.worker = response.headers.get("x-kvhint-worker", "")
                if response.status != 200:
                    outcome.error = (await response.text())[:300]
                    return outcome, reply
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    if not outcome.ttft_s:
                        outcome.ttft_s = time.monotonic() - started
                    self._take_chunk(json.loads(line[5:]), outcome, reply)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            return outcome, reply
        outcome.latency_s = time.monotonic() - started
        outcome.ok = not outcome.error and outcome.prompt_tokens > 0
        return outcome, reply

    @staticmethod
    def _take_chunk(chunk: dict[str, Any], outcome: TurnResult, reply: dict[str, Any]) -> None:
        if "error" in chunk:
            outcome.error = json.dumps(chunk["error"])[:300]
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reply["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name = (call.get("function") or {}).get("name")
                if name:
                    reply["tools"].append(name)
            if choice.get("finish_reason"):
                outcome.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            outcome.prompt_tokens = usage.get("prompt_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            outcome.cached_tokens = details.get("cached_tokens") or 0
