"""What the ``allocate_slots`` wrapper (:mod:`.cache`) reads from a call's arguments:
the request's own prefix-hit blocks, a parameter's position (the signature varies across
vLLM releases), and the free blocks the call needs at least, as vLLM reckons them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def block_ids(computed: Any) -> frozenset[int]:
    """The ids of the blocks of a ``KVCacheBlocks`` (one list per KV-cache group)."""
    groups = getattr(computed, "blocks", None) or ()
    return frozenset(b.block_id for group in groups for b in group)


def need_reader(manager: Any, allocate_slots: Callable[..., Any], block_size: int
                ) -> Callable[[Any, int, tuple[Any, ...], dict[str, Any], frozenset[int]], int]:
    """How many free blocks an ``allocate_slots(request, num_new_tokens, ...)`` call
    vLLM refused needs at least (a partly full last block may make it one fewer), as
    vLLM reckons it: the blocks of its new tokens, plus ``reserved_blocks`` (kept for
    other in-flight sequences) and the manager's ``watermark_blocks`` for a waiting or
    preempted request while others are scheduled (``has_scheduled_reqs``); and with
    ``full_sequence_must_fit`` (vLLM's admission gate, ``scheduler_reserve_full_isl``)
    the blocks of the whole prompt past its prefix hits, plus the watermark. The prompt
    is counted only on one full-attention group (a sliding window caps it lower): a
    floor, never more than vLLM asks, so relief never refuses what would let a request
    in. Relief that counted the new tokens' blocks only released retained blocks for an
    admission the watermark or the prompt's length still refused (every one releasable,
    lost for nothing), and started too small (more retries, the doubling past what was
    needed). ``hits``: the call's prefix-hit block ids."""
    from vllm.v1 import kv_cache_interface
    from vllm.v1.request import RequestStatus

    admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    positions = {name: positional_index(allocate_slots, name) for name in (
        "reserved_blocks", "has_scheduled_reqs", "full_sequence_must_fit")}
    groups = manager.kv_cache_config.kv_cache_groups
    full = getattr(kv_cache_interface, "FullAttentionSpec", None)
    # A vLLM without what the prompt's count reads counts the new tokens' blocks only.
    whole_prompt = (full is not None and len(groups) == 1
                    and isinstance(groups[0].kv_cache_spec, full)
                    and hasattr(manager, "get_block_ids") and hasattr(manager, "max_model_len"))

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str,
                 default: Any) -> Any:
        if name in kwargs:
            return kwargs[name]
        position = positions[name]
        return args[position] if position is not None and len(args) > position else default

    def need(request: Any, num_new_tokens: int, args: tuple[Any, ...],
             kwargs: dict[str, Any], hits: frozenset[int]) -> int:
        watermark = int(getattr(manager, "watermark_blocks", 0) or 0)
        if not (getattr(request, "status", None) in admitting
                and argument(args, kwargs, "has_scheduled_reqs", True)):
            watermark = 0
        reserved = max(int(argument(args, kwargs, "reserved_blocks", 0) or 0), 0)
        step = -(-num_new_tokens // block_size) + watermark + reserved
        if not (whole_prompt and argument(args, kwargs, "full_sequence_must_fit", False)):
            return step
        tokens = min(request.num_tokens, manager.max_model_len)
        held = len(manager.get_block_ids(request.request_id)[0])
        return max(step, max(-(-tokens // block_size) - held - len(hits), 0) + watermark)

    return need


def positional_index(fn: Callable[..., Any], name: str) -> int | None:
    """Position of parameter ``name`` among ``fn``'s positional args after the first two
    (request, num_new_tokens), or None when it has no such parameter."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) - 2 if name in params[2:] else None
