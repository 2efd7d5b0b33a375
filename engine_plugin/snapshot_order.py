"""Snapshot order: the index's raw nodes as ``(hash, parent, medium)`` rows, parents
before children, so a router replaying a snapshot page by page always knows a block's
parent first. Runs on the NATS thread, off the scheduler thread."""

from __future__ import annotations

from collections.abc import Iterable

from kvhint.engine_plugin.index_events import GPU

# (hash, parent hash, GPU copies, {other medium: copies} | None)
RawNode = tuple[int, int | None, int, dict[str, int] | None]


def ordered_blocks(raw: Iterable[RawNode]) -> list[tuple[int, int | None, str]]:
    """``(hash, parent, medium)`` rows, parents before children (by depth); parent-only
    nodes are left out but still order their children.

    A GPU-resident node is listed once: the router keeps one GPU bit per hash and reads a
    repeat as a duplicate store. A node in another tier is listed once per copy the index
    counts there: those tiers are reference-counted (vLLM's offloading connector announces
    a hash once per chunk holding it, and removes it as often), and the router reads a
    hash listed twice in such a tier as two references (``SnapshotLoaded``), so a router
    resyncing from this snapshot holds the same counts as one that followed the stream,
    and the same later removals leave the block held, or drop it, on both."""
    nodes = {key: (parent, gpu, other) for key, parent, gpu, other in raw}
    depth: dict[int, int] = {}
    for start in nodes:
        path = []
        key: int | None = start
        while key is not None and key not in depth and key in nodes:
            path.append(key)
            key = nodes[key][0]
        base = depth[key] + 1 if key is not None and key in depth else 0
        for offset, k in enumerate(reversed(path)):
            depth[k] = base + offset
    out: list[tuple[int, int | None, str]] = []
    for key in sorted(depth, key=depth.__getitem__):
        parent, gpu, other = nodes[key]
        if gpu:
            out.append((key, parent, GPU))
        for medium, copies in sorted((other or {}).items()):
            out.extend([(key, parent, medium)] * copies)
    return out
