"""The host tier (G2) port: what Demote and Prefetch need from a second KV tier.

vLLM's offloading connectors (the real G2) copy with CUDA streams and do not run on the
CPU backend, so the live plugin on the CPU runs with no host tier and answers Demote,
Share and the load half of Prefetch honestly (rejected / deferred with that reason). The
simulator passes its own implementation, built on vLLM's offloading bookkeeping with the
transfers modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class HostTier(Protocol):
    def store(self, block_hashes: Sequence[int]) -> int:
        """Keep a host copy of these (G1-resident) blocks; returns how many now have one."""

    def contains(self, block_hash: int) -> bool:
        """Whether the block has a host copy."""
