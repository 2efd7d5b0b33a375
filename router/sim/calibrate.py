"""Fit the simulator's time model to the times a recording was served with.

A recording (the router's session JSONL) says how long each streamed answer took to its
first token (``ttft_ms``) and between tokens (``itl_ms``). The prefill rate is not in the
file, so it is found by simulating: the rate at which the simulated median TTFT equals
the served one. A time model faster than the fleet keeps queues short, so the router
balances less and the simulator is optimistic under cache pressure (BENCHMARKS.md, "The
simulator against a live run").

The decode time needs no search with the fast engine, whose decode runs beside prefill
at ``decode_s_per_token`` (the served median ``itl_ms`` is the default). The scheduler
engine's steps are stretched by the prompt chunks they carry, so a served ITL is a decode
step plus its share of other requests' prefill: there the decode step is searched too,
until the simulated median ITL meets the served one, the rate refitted to the TTFT around
its last value after each move.

The rate search is a bisection on its logarithm: the simulated median TTFT falls as the
rate rises (queueing and prefill both shrink), though not strictly (a routing decision
can flip between two rates), so the result is the best rate seen, not a root.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.results import PolicyResult, percentile
from kvhint.router.sim.trace import Trace

LOWEST_RATE = 500.0
HIGHEST_RATE = 2_000_000.0
RATE_RUNS = 8
# The scheduler engine: decode-step corrections (each by at most a factor MAX_DECODE_MOVE,
# along a secant no flatter than MIN_SLOPE), each followed by a refit of the rate within
# a factor REFIT_SPAN of the last one, in REFIT_RUNS runs.
DECODE_ROUNDS = 3
MAX_DECODE_MOVE = 4.0
MIN_SLOPE = 0.05
REFIT_SPAN = 4.0
REFIT_RUNS = 6

RunFn = Callable[[float, float, PolicyResult], None]


@dataclass(frozen=True, slots=True)
class TimeFit:
    tokens_per_s: float
    decode_s_per_token: float
    simulated_ttft_p50_s: float
    served_ttft_p50_s: float
    simulated_itl_p50_s: float
    served_itl_p50_s: float | None  # None: the trace has no itl_ms, decode not fitted
    runs: int


def fit_time_model(trace: Trace, config: SimConfig, policy: str, *, fit_decode: bool = True,
                   on_run: RunFn | None = None) -> TimeFit:
    """The prefill rate (and, with the scheduler engine, the decode step when
    ``fit_decode`` and the trace has ``itl_ms``) whose simulated medians under ``policy``
    come closest to the trace's served ones. ``on_run(rate, decode_s, result)`` after each
    simulation. Raises ValueError when the trace has no served TTFTs."""
    served_ttft = trace.served_ttfts_s()
    if not served_ttft:
        raise ValueError("the trace has no ttft_ms (a router recording of streamed "
                         "answers has them): give --prefill-tokens-per-s a number")
    target = percentile(served_ttft, 50)
    decoded = trace.served_decode_s_per_token()
    served_itl = decoded[0] if decoded else None
    runs = 0

    def fit_rate(decode_s: float, low: float, high: float,
                 count: int) -> tuple[float, PolicyResult]:
        nonlocal runs
        low_log, high_log = math.log(low), math.log(high)
        best: tuple[float, float, PolicyResult] | None = None  # (|log error|, rate, result)
        for _ in range(count):
            rate = math.exp((low_log + high_log) / 2)
            timing = replace(config.timing, prefill_tokens_per_s=rate,
                             decode_s_per_token=decode_s)
            result = Simulation(trace, replace(config, timing=timing), policy).run()
            runs += 1
            if on_run is not None:
                on_run(rate, decode_s, result)
            simulated = _ttft(result)
            error = _log_error(simulated, target)
            if best is None or error < best[0]:
                best = (error, rate, result)
            if simulated > target:
                low_log = math.log(rate)  # too slow: faster prefill
            else:
                high_log = math.log(rate)
        assert best is not None
        return best[1], best[2]

    decode_s = config.timing.decode_s_per_token
    rate, result = fit_rate(decode_s, LOWEST_RATE, HIGHEST_RATE, RATE_RUNS)
    if fit_decode and served_itl and config.engine == "scheduler":
        # Along the curve of TTFT-matched rates the ITL moves less than the decode step
        # (a shorter step lets the refitted rate fall, and the chunks stretch steps more):
        # a secant over the last two points; the first step taken as if one to one.
        fits = [(decode_s, rate, result)]
        for _ in range(DECODE_ROUNDS):
            slope = 1.0
            if len(fits) > 1:
                (d0, _, r0), (d1, _, r1) = fits[-2], fits[-1]
                moved = _itl(r1) - _itl(r0)
                if d1 != d0 and moved:
                    slope = max(moved / (d1 - d0), MIN_SLOPE)
            last = fits[-1][0]
            decode_s = min(max(last + (served_itl - _itl(fits[-1][2])) / slope,
                               last / MAX_DECODE_MOVE), last * MAX_DECODE_MOVE)
            rate, result = fit_rate(decode_s, rate / REFIT_SPAN, rate * REFIT_SPAN, REFIT_RUNS)
            fits.append((decode_s, rate, result))
        decode_s, rate, result = min(fits, key=lambda fit: max(
            _log_error(_itl(fit[2]), served_itl),
            _log_error(_ttft(fit[2]), target)))
    else:
        served_itl = None
    return TimeFit(rate, decode_s, _ttft(result), target, _itl(result), served_itl, runs)


def _ttft(result: PolicyResult) -> float:
    """The simulated median TTFT; infinite when nothing got a first token (too slow)."""
    return percentile(result.ttfts_s, 50) if result.ttfts_s else math.inf


def _itl(result: PolicyResult) -> float:
    return percentile(result.itls_s, 50)


def _log_error(simulated: float, served: float) -> float:
    return abs(math.log(simulated / served)) if simulated > 0 and served > 0 else math.inf
