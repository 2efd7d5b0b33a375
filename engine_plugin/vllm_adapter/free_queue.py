"""Where blocks the plugin gives up (a Demote's) go in vLLM's free block queue
(``BlockPool.free_block_queue``, a doubly linked list between a fake head and tail):
first among the cached free blocks, behind the empty ones (:func:`evict_first`, which
``VllmCacheAdapter.evict_first`` of the block cache port calls)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvhint.engine_plugin.block_cache import BlockHandle


def evict_first(queue: Any, handles: Sequence[BlockHandle]) -> int:
    """Put the free ones of these blocks first among the *cached* free blocks of vLLM's
    free queue (``BlockPool.free_block_queue``), and return how many moved: behind
    the free blocks that hold nothing (never filled, or emptied), which vLLM hands out
    from the same queue and which cost no hit when taken. Before, they went to the
    very head and the next allocation evicted them while empty blocks waited behind
    (at low pressure kvhint then lost hits plain LRU kept). With more than
    :data:`EMPTY_LEAD_LIMIT` empty blocks at the head there is no pressure: the blocks
    stay where they are (LRU), as the walk would cost more than it saves."""
    head = getattr(queue, "fake_free_list_head", None)
    if head is None or not hasattr(queue, "remove"):
        return 0
    # Deepest first: the head of the queue is evicted first, and a chain is worth
    # most from its root.
    ordered = sorted(handles, key=lambda h: h.depth, reverse=True)
    free = [b for h in ordered for b in h.blocks if b.ref_cnt == 0]
    if not free:
        return 0
    lead = _empty_lead(head, {id(b) for b in free})
    if lead is None:
        return 0
    for block in free:
        queue.remove(block)
    anchor = head
    for _ in range(lead):
        anchor = anchor.next_free_block
    after = anchor.next_free_block
    for block in free:
        block.prev_free_block, anchor.next_free_block = anchor, block
        anchor = block
    anchor.next_free_block, after.prev_free_block = after, anchor
    queue.num_free_blocks += len(free)
    return len(free)


# The most empty free blocks evict_first walks past at the head of vLLM's free queue.
EMPTY_LEAD_LIMIT = 1024


def _empty_lead(head: Any, moving: set[int]) -> int | None:
    """How many free blocks holding no cache entry lead vLLM's free queue (from its fake
    ``head``), passing over the blocks about to move (``moving``, by id): all of them
    when nothing cached follows; None when more than :data:`EMPTY_LEAD_LIMIT` do."""
    lead, block = 0, head.next_free_block
    while block is not None and block.next_free_block is not None:  # not the fake tail
        if id(block) not in moving:
            if block.block_hash is not None:
                return lead
            lead += 1
            if lead > EMPTY_LEAD_LIMIT:
                return None
        block = block.next_free_block
    return lead
