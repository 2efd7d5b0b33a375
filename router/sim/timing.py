"""How long a simulated worker spends on a request, from token counts.

The ``fast`` engine (:mod:`.worker`) prefills one request at a time (FIFO): ``prefill_s =
overhead + computed / prefill_rate + host_loaded / host_load_rate``. Decode runs batched
beside it, each request taking ``(output_tokens - 1) * decode_s_per_token`` after its
first token (the prefill produces the first). Time to first token is queueing for the
prefill slot (and for KV space) plus the prefill itself.

The ``scheduler`` engine (:mod:`.scheduler_worker`) times each of vLLM's steps instead:
``step_s = decode_s_per_token + prefill_tokens / prefill_rate + host_loaded /
host_load_rate``, where ``prefill_tokens`` are the prompt tokens the step computes
(vLLM's chunks, several prompts at once) and ``host_loaded`` the host-tier tokens of the
prompts it starts. A step with no prompt work is one decode step; prompt chunks stretch
the step for every request in it, as they do on a server. The prefill overhead is the
fast engine's only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


RATE_FIELDS = ("prefill_tokens_per_s", "host_load_tokens_per_s")


def time_model_problem(name: str, value: float) -> str | None:
    """What is wrong with ``value`` for the :class:`TimeModel` field ``name``, or None:
    rates must be > 0, times >= 0, all finite (nan compares false with everything, so
    "<= 0" alone let it through, and every time computed from it, and the event heap's
    order, became nan)."""
    positive = name in RATE_FIELDS
    if math.isfinite(value) and (value > 0 if positive else value >= 0):
        return None
    return f"must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}"


@dataclass(frozen=True, slots=True)
class TimeModel:
    prefill_tokens_per_s: float = 100_000.0
    prefill_overhead_s: float = 0.010
    decode_s_per_token: float = 0.020
    # Host (G2) -> GPU copy rate, in tokens/s (PCIe-class for a mid-size model).
    host_load_tokens_per_s: float = 1_000_000.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if problem := time_model_problem(f.name, getattr(self, f.name)):
                raise ValueError(f"{f.name} {problem}")

    def prefill_s(self, computed_tokens: int, host_tokens: int = 0) -> float:
        return (
            self.prefill_overhead_s
            + computed_tokens / self.prefill_tokens_per_s
            + host_tokens / self.host_load_tokens_per_s
        )

    def decode_s(self, output_tokens: int) -> float:
        """From the first output token to the last: the prefill produced the first, so
        ``output_tokens - 1`` decode steps follow it (none for 0 or 1 tokens)."""
        return max(output_tokens - 1, 0) * self.decode_s_per_token

    def step_s(self, prefill_tokens: int, host_tokens: int = 0) -> float:
        """One step of the scheduler engine (module docstring). The decode tokens are in
        the base time: at the batch sizes simulated a decode step's time barely moves
        with the number of running requests."""
        return (self.decode_s_per_token + prefill_tokens / self.prefill_tokens_per_s
                + host_tokens / self.host_load_tokens_per_s)
