"""vLLM's KV events as the plugin's session index takes them (:func:`index_events`, which
is ``VllmCacheAdapter.index_events`` of the block cache port): BlockStored, BlockRemoved
and AllBlocksCleared read into :mod:`kvhint.engine_plugin.index_events`, by the rules the
router reads the same published batches by (:mod:`kvhint.schemas.events`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvhint.engine_plugin.index_events import GPU, Cleared, IndexEvent, Removed, Stored
from kvhint.schemas import external_hash_to_int
from kvhint.schemas.events import cleared_medium, follows_group


def index_events(events: Iterable[Any], group: int = 0,
                 re_reports: frozenset[int] = frozenset()) -> list[IndexEvent]:
    """vLLM KV events -> the index's domain events (unknown kinds are skipped, and so
    are the block events of KV-cache groups other than ``group``, as the router skips
    and counts them: ``schemas.events.follows_group``, and the re-announcements of
    cached blocks, by id in ``re_reports``: the hit that caused them is a ``Hit``).

    vLLM's AllBlocksCleared names no medium: its tier is read by the rule the router
    reads the same batch by (``schemas.events.cleared_medium``), so the plugin's index
    and the router's view of this worker stay one function of the published stream.
    The plugin publishes a pair itself when vLLM's connector reset drops the host tier
    (:mod:`.connector_reset`)."""
    out: list[IndexEvent] = []
    for event in events:
        name = type(event).__name__
        if name != "AllBlocksCleared" and not follows_group(
                getattr(event, "group_idx", None), group) or id(event) in re_reports:
            continue
        if name == "BlockStored":
            parent = event.parent_block_hash
            out.append(Stored(
                tuple(external_hash_to_int(h) for h in event.block_hashes),
                None if parent is None else external_hash_to_int(parent),
                getattr(event, "session_id", None), event.medium or GPU))
        elif name == "BlockRemoved":
            out.append(Removed(tuple(external_hash_to_int(h) for h in event.block_hashes),
                               event.medium or GPU))
        elif name == "AllBlocksCleared":
            medium = getattr(event, "medium", None)
            if medium is None:
                medium = cleared_medium(bool(out) and isinstance(out[-1], Cleared))
            out.append(Cleared(medium))
    return out


def removed_in_groups(events: Iterable[Any], groups: frozenset[int]) -> list[int]:
    """The hashes vLLM's GPU BlockRemoved events of these KV-cache groups name: a hybrid
    model's other groups, whose blocks a hold may take beside the followed group's
    (:mod:`kvhint.engine_plugin.group_holds`), so one vLLM drops from its cache by another
    path (``evict_blocks``) is given back as the followed group's are."""
    if not groups:
        return []
    return [external_hash_to_int(h) for event in events
            if type(event).__name__ == "BlockRemoved"
            and getattr(event, "group_idx", None) in groups
            and (event.medium or GPU) == GPU for h in event.block_hashes]
