"""Which prefixes many sessions share (system prompts, tool schemas), per worker and tenant,
from the block hashes of each session's last routed prompt; the planner's
:func:`plan_shared_prefixes` retains them.

A prefix is identified by the hash of its last block (the chain hash covers everything
before it). For every session, prefixes at power-of-two lengths are counted; for each
worker the longest prefix used by at least ``min_sessions`` sessions of one tenant wins
(shorter ones are inside it).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvhint.router.policy import SharedPrefix
from kvhint.router.service.sessions import ENDED, SessionRecord


def shared_prefixes(records: Iterable[SessionRecord], min_sessions: int,
                    protected_until: dict[str, float]) -> list[SharedPrefix]:
    counts: dict[tuple[str, str, int], int] = {}
    chains: dict[tuple[str, str, int], tuple[int, ...]] = {}
    for record in records:
        hashes = record.last_block_hashes
        if record.state == ENDED or record.worker_id is None or not hashes:
            continue
        length = 1
        while length <= len(hashes):
            key = (record.worker_id, record.tenant, hashes[length - 1])
            counts[key] = counts.get(key, 0) + 1
            chains.setdefault(key, hashes[:length])
            length *= 2
    best: dict[tuple[str, str], tuple[int, int]] = {}  # (worker, tenant) -> (blocks, hash)
    for (worker, tenant, last), sessions in counts.items():
        if sessions < min_sessions:
            continue
        blocks = len(chains[(worker, tenant, last)])
        if blocks > best.get((worker, tenant), (0, 0))[0]:
            best[(worker, tenant)] = (blocks, last)
    prefixes = []
    for (worker, tenant), (_blocks, last) in sorted(best.items()):
        key = f"{tenant}:{last:016x}"
        prefixes.append(SharedPrefix(
            worker_id=worker, key=key, block_hashes=chains[(worker, tenant, last)],
            sessions=counts[(worker, tenant, last)], tenant=tenant,
            protected_until=protected_until.get(f"{worker}:{key}")))
    return prefixes
