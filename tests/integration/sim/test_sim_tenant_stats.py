"""The simulator keeps each trace tenant's learned statistics apart, as the live router
does (policy.tenant_stats): tenant a's next turns never read their responses (a Mooncake
trace: 16 sessions of two turns, as in test_sim_completion_reads.py), which must not make
tenant b's session, b's first, protect its prompt only."""

from __future__ import annotations

import json
from pathlib import Path

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace


def _rows() -> list[dict]:
    rows = []
    for n in range(16):
        first = [1000 * n + k for k in range(4)]
        rows.append({"timestamp": 10_000 * n, "session_id": f"s{n}", "tenant": "a",
                     "input_length": 128, "output_length": 40, "hash_ids": first})
        rows.append({"timestamp": 10_000 * n + 5000, "session_id": f"s{n}", "tenant": "a",
                     "input_length": 198, "output_length": 40,
                     "hash_ids": first + [1000 * n + 10 + k for k in range(3)]})
    rows.append({"timestamp": 160_000, "session_id": "s0", "tenant": "b", "input_length": 128,
                 "output_length": 40, "hash_ids": [900_000 + k for k in range(4)]})
    return rows


def test_one_tenants_completion_reads_do_not_shape_another_tenants_protection(
        tmp_path: Path) -> None:
    path = tmp_path / "two_tenants.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    sim = Simulation(load_trace(path, block_size=32, limit=None),
                     SimConfig(workers=1, gpu_blocks=400, block_size=32), "kvhint")
    sim.run()
    assert sim.learned.of("a").completion_read_probability() < 0.5
    assert sim.learned.of("b").completion_read_probability() == 1.0  # nothing learnt: prior
    # b's 128-token prompt and 40-token response: 5 full blocks, the response's included
    # (with a's figure it would be the prompt's 4 only).
    protection = sim.sessions["b/s0"].protection
    assert protection is not None and protection.blocks == 5
