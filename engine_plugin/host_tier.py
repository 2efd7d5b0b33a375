"""The host tier (G2) port: what Demote and Prefetch need from a second KV tier.

Two implementations:
- :class:`kvhint.engine_plugin.vllm_adapter.OffloadingHostTier`: vLLM's OffloadingConnector
  running beside the plugin in a ``MultiConnector`` (CUDA servers; its worker copies with
  CUDA streams, so the CPU backend cannot run it). The plugin finds it at bind time.
- the simulator's, built on the same vLLM offloading bookkeeping with the copies modelled.

Without either (the CPU backend) the plugin runs with no host tier and answers Demote,
Share and the load half of Prefetch honestly (rejected / deferred with that reason).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Why Demote, Share and the load half of Prefetch cannot run on this worker (said in outcomes).
NO_HOST_TIER = ("no host tier on this worker (vLLM's offloading connectors need CUDA; the CPU "
                "backend keeps KV in one tier)")


class HostTier(Protocol):
    def keep(self, block_hashes: Sequence[int]) -> frozenset[int]:
        """Make sure these G1-resident blocks have a host copy that outlives their GPU
        copy, as far as the tier can; returns the ones that have a finished copy now.
        Only those GPU copies may be let go first."""

    def contains(self, block_hash: int) -> bool:
        """Whether the block has a finished host copy."""

    def copying(self, block_hash: int) -> bool:
        """Whether the block's host copy is in flight (stored, not finished yet)."""
