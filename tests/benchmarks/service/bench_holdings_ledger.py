"""What one session's re-protection costs the router's holdings ledger, on its event loop.

    .venv/bin/python tests/benchmarks/service/bench_holdings_ledger.py [--sessions 200]
        [--chain 2000] [--growth 40] [--turns 10] [--rounds 5]

Workload: ``--sessions`` sessions on one worker share a 128-block system prompt (2,048
tokens at vLLM's GPU block size 16); each session's chain starts at ``--chain`` blocks
and grows by ``--growth`` blocks a turn. Every turn re-protects every session: a Retain
naming its whole chain replaces the session's previous one, as the planner sends after
each response. Measured side by side, alternating per round, on fresh ledgers:
- ours: ``HoldingsLedger.record`` (the new holding takes over the counts of the common
  prefix it shares with the one it replaces);
- baseline: the same ledger made to count the whole chain out and in again (the old
  holding released first, then the new one recorded): what a per-block count costs
  without that take-over.
Reports microseconds per re-protection (thread CPU time), medians over rounds, the ratio,
and checks that both ledgers end with the same totals.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvhint.router.policy import HoldingsLedger

SYSTEM_BLOCKS = 128


def _chains(sessions: int, chain: int) -> list[list[int]]:
    system = list(range(1, SYSTEM_BLOCKS + 1))
    return [system + [(s + 1) * 10_000_000 + k for k in range(chain - SYSTEM_BLOCKS)]
            for s in range(sessions)]


def run(sessions: int, chain: int, growth: int, turns: int, release_first: bool
        ) -> tuple[float, HoldingsLedger]:
    ledger = HoldingsLedger()
    chains = _chains(sessions, chain)
    ids = 0
    elapsed = 0.0
    for turn in range(turns):
        for s, keys in enumerate(chains):
            keys.extend((s + 1) * 10_000_000 + len(keys) + k for k in range(growth))
            ids += 1
            start = time.thread_time()
            if release_first:
                ledger.release_scope("w0", f"t/s{s}")
            ledger.record(action_id=f"r{ids}", worker_id="w0", tenant="t", scope=f"t/s{s}",
                          action_type="kv.retain", blocks=len(keys), expires_at=1e12,
                          keys=keys)
            elapsed += time.thread_time() - start
    return elapsed / (sessions * turns) * 1e6, ledger


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--chain", type=int, default=2000)
    parser.add_argument("--growth", type=int, default=40)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ours, baseline = [], []
    for _ in range(args.rounds):
        us, fast = run(args.sessions, args.chain, args.growth, args.turns, False)
        ours.append(us)
        us, slow = run(args.sessions, args.chain, args.growth, args.turns, True)
        baseline.append(us)
        assert fast.worker("w0") == slow.worker("w0") and fast.tenant("t") == slow.tenant("t")
    held = fast.worker("w0").retained_blocks
    print(f"{args.sessions} sessions, chains {args.chain} -> "
          f"{args.chain + args.growth * args.turns} blocks, {held:,} distinct blocks held")
    print(f"ours      median {statistics.median(ours):8.1f} us per re-protection  "
          f"rounds {', '.join(f'{u:.1f}' for u in ours)}")
    print(f"baseline  median {statistics.median(baseline):8.1f} us per re-protection  "
          f"rounds {', '.join(f'{u:.1f}' for u in baseline)}")
    print(f"baseline/ours {statistics.median(baseline) / statistics.median(ours):.1f}x")


if __name__ == "__main__":
    main()
