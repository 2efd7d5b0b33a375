"""The BlockCache port: what the plugin's hint code needs from the engine's block pool.

The executor and the hold ledger know vLLM only through it; the vLLM adapter
(:class:`~kvhint.engine_plugin.vllm_adapter.VllmCacheAdapter`) implements it over the real
BlockPool, so vLLM internals stay in the ``vllm_adapter`` package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BlockHandle:
    """A resident block as the cache port sees it. ``block_id`` is stable while held;
    ``depth`` is the block's position in its chain (0 = root), for leaf-first release;
    ``blocks`` are the engine's block objects (one per KV cache group). ``side``: on a
    hybrid model, a block of a KV cache group other than the followed one, held beside
    the followed group's so vLLM's hybrid prefix hit finds every group's blocks
    (:mod:`~kvhint.engine_plugin.group_holds`); a claim's ``applied`` and the losses
    reported to the router count only the others (one per target position)."""

    key: int
    block_id: int
    depth: int
    blocks: tuple[object, ...]
    side: bool = False


class BlockCache(Protocol):
    """What the plugin needs from the engine's block pool (scheduler thread only)."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    def lookup(self, key: int) -> BlockHandle | None:
        """The block cached under hash ``key`` now, or None when it is not resident."""

    @property
    def hit_groups(self) -> tuple["GroupNeed", ...]:
        """The other KV cache groups a prefix hit needs blocks of (a hybrid model's);
        empty with one group, where a handle's ``blocks`` are all a hit needs."""

    @property
    def unheld_groups(self) -> tuple[str, ...]:
        """KV cache groups a prefix hit needs whose blocks no hold can take (a kind or
        block size :attr:`hit_groups` cannot describe), each ``"<id> (<why>)"``: a hold
        there keeps no hit. Empty on a one-group model."""

    def side_block(self, handle: BlockHandle, group_id: int) -> BlockHandle | None:
        """Group ``group_id``'s block cached under ``handle.key`` now (``side``), or None."""

    def hold(self, handles: Sequence[BlockHandle]) -> None:
        """Take one reference on each block (it leaves the free queue)."""

    def release(self, handles: Sequence[BlockHandle]) -> None:
        """Give the references back; ``handles`` in eviction order (first evicted first)."""

    def evict_first(self, handles: Sequence[BlockHandle]) -> int:
        """Move these blocks, where free, to the head of the eviction order, deepest
        first (whatever order they come in); returns how many moved."""

    def in_use(self, handle: BlockHandle) -> bool:
        """Whether something besides the plugin's hold references the block now (a running
        request): giving the hold back would not free it."""

    def is_cached(self, handle: BlockHandle) -> bool:
        """Whether the block is still in the prefix cache under ``handle.key``. A hold
        keeps a block's memory, not its cache entry: vLLM can drop the entry while the
        block is referenced (``evict_blocks``), and the hold then protects nothing."""


@dataclass(frozen=True, slots=True)
class GroupNeed:
    """What vLLM's hybrid prefix hit needs of one KV cache group besides the followed one
    (:attr:`BlockCache.hit_groups`): its block at every position before the hit point
    (``tail`` None: full attention), or at the last ``tail`` positions only (a sliding
    window's blocks, one Mamba state), those ending ``lag`` positions before the hit
    point's last (a Mamba state with EAGLE: vLLM's full-attention hit drops its last
    matched block, and the Mamba state is looked up at the shorter length)."""

    group_id: int
    tail: int | None
    lag: int = 0
