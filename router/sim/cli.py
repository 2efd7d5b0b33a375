"""``kvhint sim``: replay traces through simulated vLLM workers; write agent workloads.

    kvhint sim run --trace FILE --workers N --gpu-blocks B [--host-blocks H]
                   --router POLICY[,POLICY...|all] [--json] [--plot FILE.png] ...
    kvhint sim gen-agents --out FILE [--sessions N] [--seed S] ...

Bad input (an unknown policy, a malformed trace line, a non-monotonic timestamp) stops
before anything runs, naming the line and the problem; outputs are written whole at the
end or not at all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator's modules import vLLM: only once the input is good
    from kvhint.router.sim.engine import SimConfig
    from kvhint.router.sim.trace import Trace

POLICY_NAMES = ("round_robin", "session_affinity", "kv_aware", "kvhint")


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser("sim", help="simulate routing and KV hints on a trace",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    _add_run(sim_sub)
    _add_gen_agents(sim_sub)


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="replay a trace under one or more policies")
    run.add_argument("--trace", required=True, type=Path,
                     help="Mooncake JSONL or kvhint session JSONL (see docs in README)")
    run.add_argument("--workers", type=int, default=1)
    run.add_argument("--gpu-blocks", type=int, required=True, help="G1 blocks per worker")
    run.add_argument("--host-blocks", type=int, default=0,
                     help="G2 (host) blocks per worker, vLLM's CPU offloading bookkeeping")
    run.add_argument("--router", default="all",
                     help=f"one of {', '.join(POLICY_NAMES)}, a comma-separated list, or all")
    run.add_argument("--block-size", type=int, default=512,
                     help="tokens per simulated block (the trace's, unless "
                          "--trace-block-size); a multiple of 32 (vLLM on the CPU)")
    run.add_argument("--trace-block-size", type=int, default=None,
                     help="tokens each of the trace's hash_ids names, when it divides "
                          "--block-size (a router recording at vLLM's GPU block size 16: "
                          "the file name says -bs16)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--limit", type=int, default=None, help="only the first N requests")
    run.add_argument("--json", action="store_true",
                     help="one JSON object per line per policy (and reference line)")
    run.add_argument("--plot", type=Path, default=None, help="hit rate over time (PNG)")
    run.add_argument("--jobs", type=int, default=2, help="policies simulated in parallel")
    run.add_argument("--no-reference", action="store_true",
                     help="skip the oracle and unbounded reference lines")
    run.add_argument("--no-progress", action="store_true")
    engine = run.add_argument_group("engine")
    engine.add_argument("--engine", choices=("fast", "scheduler"), default="fast",
                        help="fast: one prefill at a time over vLLM's KVCacheManager (an "
                             "hour-long trace in under a minute); scheduler: vLLM's real "
                             "Scheduler, step by step (chunked prefill, admission, "
                             "preemption as a server does; 1-2 ms per step)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="scheduler engine: vLLM's token budget per step (its server "
                             "default: 8,192 on H100-class GPUs, 2,048 on the CPU)")
    engine.add_argument("--max-num-seqs", type=int, default=1024,
                        help="scheduler engine: vLLM's running-request cap (server "
                             "default: 1,024 on H100-class GPUs, 128 on the CPU)")
    timing = run.add_argument_group("time model")
    timing.add_argument("--prefill-tokens-per-s", type=_rate_or_fit, default=100_000.0,
                        help="a number, or fit: the rate at which the simulated median "
                             "TTFT matches the trace's served one (ttft_ms; found by "
                             "simulating kvhint, or the first policy, 8 times; with the "
                             "scheduler engine the decode step is fitted to the served "
                             "itl_ms too, unless --decode-s-per-token is given)")
    timing.add_argument("--prefill-overhead-s", type=float, default=0.010)
    timing.add_argument("--decode-s-per-token", type=float, default=None,
                        help="default: the trace's median itl_ms where it has them (a "
                             "router recording), else 0.020")
    timing.add_argument("--host-load-tokens-per-s", type=float, default=1_000_000.0)
    plugin = run.add_argument_group("worker plugin (its kv_connector_extra_config)")
    plugin.add_argument("--retain-budget-fraction", type=float, default=None)
    plugin.add_argument("--pin-budget-fraction", type=float, default=None)
    run.set_defaults(func=_run)


def _add_gen_agents(sub: argparse._SubParsersAction) -> None:
    from kvhint.router.sim.agents import AgentWorkloadSpec

    defaults = AgentWorkloadSpec()
    gen = sub.add_parser("gen-agents", help="write a synthetic agent workload (session JSONL)")
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--seed", type=int, default=0)
    for name, value in vars(defaults).items():
        if name == "seed":
            continue
        gen.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    gen.set_defaults(func=_gen_agents)


def _rate_or_fit(text: str) -> float | str:
    if text == "fit":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of tokens/s or fit, got {text!r}") from None


def parse_policies(text: str) -> list[str]:
    """``all`` or a comma-separated list; raises ValueError naming an unknown policy."""
    if text.strip() == "all":
        return list(POLICY_NAMES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError("--router: give a policy, a comma-separated list, or all")
    for name in names:
        if name not in POLICY_NAMES:
            raise ValueError(f"--router: unknown policy {name!r} (known: "
                             f"{', '.join(POLICY_NAMES)}, or all)")
    return list(dict.fromkeys(names))


def _fail(message: str) -> int:
    print(f"kvhint sim: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    try:
        policies = parse_policies(args.router)
    except ValueError as exc:
        return _fail(str(exc))
    if args.limit is not None and args.limit < 1:
        return _fail(f"--limit must be >= 1, got {args.limit}")
    if args.jobs < 1:
        return _fail(f"--jobs must be >= 1, got {args.jobs}")
    if problem := _time_flag_problem(args):
        return _fail(problem)
    if args.plot is not None:
        from kvhint.router.sim.report import plot_target_problem

        if problem := plot_target_problem(args.plot):
            return _fail(f"--plot: {problem}")
    from kvhint.router.sim.trace import TraceError, load_trace

    try:
        trace = load_trace(args.trace, args.block_size, args.limit, args.trace_block_size)
    except TraceError as exc:
        return _fail(str(exc))
    # Heavy imports (vLLM) only once the input is known good.
    from pydantic import ValidationError

    from kvhint.router.sim.engine import SimConfig
    from kvhint.router.sim.reference import oracle, unbounded
    from kvhint.router.sim.report import json_lines, plot, table
    from kvhint.router.sim.results import percentile
    from kvhint.router.sim.runner import run_policies
    from kvhint.router.sim.timing import TimeModel

    plugin = {k: v for k, v in (("retain_budget_fraction", args.retain_budget_fraction),
                                ("pin_budget_fraction", args.pin_budget_fraction))
              if v is not None}
    decode_s = args.decode_s_per_token
    if decode_s is None:
        served = trace.served_decode_s_per_token()
        if served is None:
            decode_s = TimeModel().decode_s_per_token
        else:
            decode_s, timed = served
            print(f"[sim] decode {decode_s * 1000:.2f} ms per output token: the median of "
                  f"the {timed} served responses the trace times (itl_ms)", file=sys.stderr)
    fit = args.prefill_tokens_per_s == "fit"
    if fit and not trace.served_ttfts_s():
        return _fail("--prefill-tokens-per-s fit: the trace has no ttft_ms (a router "
                     "recording of streamed answers has them)")
    try:
        timing = TimeModel(TimeModel().prefill_tokens_per_s if fit else args.prefill_tokens_per_s,
                           args.prefill_overhead_s, decode_s, args.host_load_tokens_per_s)
        config = SimConfig(workers=args.workers, gpu_blocks=args.gpu_blocks,
                           host_blocks=args.host_blocks, block_size=args.block_size,
                           timing=timing, seed=args.seed, plugin=plugin,
                           engine=args.engine,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_num_seqs=args.max_num_seqs)
    except ValidationError as exc:  # the plugin's config model (a ValueError too)
        return _fail("; ".join(
            f"--{'-'.join(map(str, error['loc'])).replace('_', '-')}: {error['msg']} "
            f"(got {error['input']!r})" for error in exc.errors()))
    except ValueError as exc:
        return _fail(str(exc))
    progress = None if args.no_progress else sys.stderr
    if progress is not None:
        print(f"[sim] {trace.path}: {len(trace.requests)} requests, {trace.sessions} sessions "
              f"({trace.format}); {args.workers} worker(s) x {args.gpu_blocks} G1 blocks"
              + (f" + {args.host_blocks} G2" if args.host_blocks else "")
              + f"; policies: {', '.join(policies)}", file=progress)
    if fit:
        config = _fit_time_model(trace, config,
                                 "kvhint" if "kvhint" in policies else policies[0],
                                 fit_decode=args.decode_s_per_token is None)
    references = []
    if not args.no_reference:
        capacity = args.workers * (args.gpu_blocks + args.host_blocks)
        references = [oracle(trace, capacity), unbounded(trace)]
    results = run_policies(trace, config, policies, jobs=args.jobs, progress=progress)
    # The results first: a plot that still fails (a full disk) must not lose them.
    if args.json:
        sys.stdout.write(json_lines(results, references))
    else:
        print(table(results, references))
    sys.stdout.flush()
    code = 0
    if args.plot is not None:
        title = (f"{Path(trace.path).name}: {args.workers} x {args.gpu_blocks} G1"
                 + (f" + {args.host_blocks} G2" if args.host_blocks else "") + " blocks")
        try:
            plot(args.plot, results, references, title)
        except (OSError, ValueError, RuntimeError) as exc:  # disk, format, LaTeX (pgf)
            code = _fail(f"--plot: cannot write {args.plot}: {exc}")
    if served_ttfts := trace.served_ttfts_s():
        # Beside the simulated TTFTs: one far below says the time model runs faster than
        # the fleet did (BENCHMARKS.md: that makes the simulator optimistic under pressure).
        print(f"[sim] served (as recorded): TTFT p50 {percentile(served_ttfts, 50):.3f}s "
              f"p99 {percentile(served_ttfts, 99):.3f}s over {len(served_ttfts)} streamed "
              "responses; a simulated TTFT far below it: --prefill-tokens-per-s fit",
              file=sys.stderr)
    return code


# The time model's flags (nan and inf parse as floats): checked by the time model's own
# rule before the trace is read.
_TIME_MODEL_FLAGS = ("prefill_tokens_per_s", "host_load_tokens_per_s", "prefill_overhead_s",
                     "decode_s_per_token")


def _time_flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the time model's flags, or None (unset and ``fit`` are fine)."""
    from kvhint.router.sim.timing import time_model_problem

    for name in _TIME_MODEL_FLAGS:
        value = getattr(args, name)
        if value is not None and value != "fit" and (
                problem := time_model_problem(name, value)):
            return f"--{name.replace('_', '-')} {problem}"
    return None


def _fit_time_model(trace: Trace, config: SimConfig, policy: str,
                    fit_decode: bool) -> SimConfig:
    from dataclasses import replace

    from kvhint.router.sim.calibrate import fit_time_model
    from kvhint.router.sim.results import PolicyResult, percentile

    def on_run(rate: float, decode_s: float, result: PolicyResult) -> None:
        print(f"[sim] fit: {rate:,.0f} prefill tokens/s, decode {decode_s * 1000:.2f} ms -> "
              f"TTFT p50 {percentile(result.ttfts_s, 50):.3f}s, ITL p50 "
              f"{percentile(result.itls_s, 50) * 1000:.2f} ms ({policy})", file=sys.stderr)

    found = fit_time_model(trace, config, policy, fit_decode=fit_decode, on_run=on_run)
    itl = (f"; decode step {found.decode_s_per_token * 1000:.2f} ms: ITL p50 "
           f"{found.simulated_itl_p50_s * 1000:.2f} ms against "
           f"{found.served_itl_p50_s * 1000:.2f} ms" if found.served_itl_p50_s else "")
    print(f"[sim] prefill {found.tokens_per_s:,.0f} tokens/s: simulated TTFT p50 "
          f"{found.simulated_ttft_p50_s:.3f}s against {found.served_ttft_p50_s:.3f}s served"
          f"{itl} ({found.runs} runs of {policy}; --prefill-tokens-per-s "
          f"{found.tokens_per_s:.0f} --decode-s-per-token {found.decode_s_per_token:.5f} "
          "skip the fit)", file=sys.stderr)
    return replace(config, timing=replace(config.timing, prefill_tokens_per_s=found.tokens_per_s,
                                          decode_s_per_token=found.decode_s_per_token))


def _gen_agents(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from kvhint.router.sim.agents import AgentWorkloadSpec, write_agent_trace

    values = {f.name: getattr(args, f.name) for f in fields(AgentWorkloadSpec)}
    try:
        spec = AgentWorkloadSpec(**values)
    except ValueError as exc:
        return _fail(str(exc))
    if not (args.out.parent or Path(".")).is_dir():
        return _fail(f"--out: folder {args.out.parent} does not exist")
    if args.out.is_dir():
        return _fail(f"--out: {args.out} is a directory; give a file name")
    summary = write_agent_trace(args.out, spec)
    print(f"wrote {args.out}: {summary}")
    return 0
