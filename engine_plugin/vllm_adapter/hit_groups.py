"""Which blocks of a hybrid model's other KV cache groups vLLM's prefix hit needs, read
from the installed vLLM's cache managers (feature detection: the classes and attributes
are looked up, never a version).

vLLM's HybridKVCacheCoordinator accepts a hit of N blocks only when every group does:
full attention needs its block at each of the N positions; a SlidingWindowManager group
needs its blocks at the last ``_contiguous_blocks_for_hit(sliding_window, block_size,
use_eagle)`` positions before N (``cdiv(sliding_window - 1, block_size)``, one more with
EAGLE), or all of them when N is shorter; a MambaManager group its state block at
position N only, or with EAGLE at N - 1: the full-attention group matches N blocks and
drops the last, and the Mamba state is looked up at N - 1 with no such drop (vLLM's
``HybridKVCacheCoordinator.find_longest_cache_hit``; so a hit of N - 1 blocks needs the
full-attention blocks of 1..N and the state at N - 1, ``GroupNeed.lag``). Before, the
state at N was held: with EAGLE no hit found it, and after other traffic a Pinned
session hit nothing. Groups that opt out of prefix caching take no part in a hit. A group of
another kind (vLLM 0.32: chunked local attention, the host-pool group of HiSparse,
any registered later), or of a block size other than the followed group's (its blocks
are cached under other hashes), cannot be held: such a model's hit may miss whatever the
plugin holds, so it refuses Pins and Retains there (``unheld``; logged once at bind,
:func:`~kvhint.engine_plugin.group_holds.unheld_reason`). Before, it held the other
groups' blocks it could and answered ``accepted``, though no hit was kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvhint.engine_plugin.block_cache import GroupNeed
from kvhint.engine_plugin.config import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


def hit_group_needs(manager: Any, groups: Sequence[Any], lookup_groups: Sequence[int]
                    ) -> tuple[tuple[GroupNeed, ...], tuple[str, ...]]:
    """The groups besides ``lookup_groups[0]`` (the followed one) a hit needs, and how
    much of each; empty for a one-group model. ``lookup_groups``: the groups the
    adapter's lookup reads (full attention's): each needs every position. Second: the
    groups a hit needs that no hold can take, each ``"<id> (<why>)"``."""
    if len(groups) < 2:
        return (), ()
    from vllm.v1.core import single_type_kv_cache_manager as stm

    followed = lookup_groups[0]
    block_size = int(groups[followed].kv_cache_spec.block_size)
    managers = getattr(getattr(manager, "coordinator", None), "single_type_managers", ())
    sliding = getattr(stm, "SlidingWindowManager", None)
    mamba = getattr(stm, "MambaManager", None)
    full = getattr(stm, "FullAttentionManager", None)
    # EAGLE's last-block drop (the flag vLLM's coordinator sets on its managers).
    eagle = followed < len(managers) and bool(getattr(managers[followed], "use_eagle", False))
    needs: list[GroupNeed] = []
    skipped: list[str] = []
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        if gid == followed or not getattr(spec, "prefix_cacheable", True):
            continue
        kind = type(managers[gid]) if gid < len(managers) else None
        if gid in lookup_groups:
            needs.append(GroupNeed(gid, None))
        elif int(spec.block_size) != block_size:
            skipped.append(f"{gid} (block size {spec.block_size})")
        elif full is not None and kind is full:
            needs.append(GroupNeed(gid, None))
        elif sliding is not None and kind is not None and issubclass(kind, sliding):
            needs.append(GroupNeed(gid, _window_blocks(managers[gid], spec, block_size)))
        elif mamba is not None and kind is not None and issubclass(kind, mamba):
            needs.append(GroupNeed(gid, 1, int(eagle)))
        else:
            skipped.append(f"{gid} ({getattr(kind, '__name__', 'unknown')})")
    if skipped:
        logger.warning("kvhint: holds cannot take the blocks of KV cache groups %s, which "
                       "vLLM's prefix hit needs: Pins and Retains on this model are refused",
                       ", ".join(skipped))
    return tuple(needs), tuple(skipped)


def _window_blocks(manager: Any, spec: Any, block_size: int) -> int:
    """The contiguous blocks before a hit point vLLM's SlidingWindowManager needs."""
    window = int(spec.sliding_window)
    contiguous = getattr(type(manager), "_contiguous_blocks_for_hit", None)
    if contiguous is not None:
        return int(contiguous(window, block_size, bool(getattr(manager, "use_eagle", False))))
    return max(1, -(-(window - 1) // block_size))
