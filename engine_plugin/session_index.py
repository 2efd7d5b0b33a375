"""SessionPrefixIndex: which sessions own which resident KV blocks on one engine.

Pure data structure over 64-bit block hashes (the ints vLLM publishes in KV events); no
vLLM, NATS or msgpack here. It is fed the domain events of ``index_events`` (:class:`Stored`,
:class:`Removed`, :class:`Cleared`, :class:`Hit`) and can be rebuilt by replaying them
(:meth:`apply`).

Model:
- a node per block hash, with its parent (the previous block of the prefix chain) and a
  count of resident physical copies per tier. vLLM keeps duplicate physical copies of a
  hash, each announced by its own BlockStored and retired by its own BlockRemoved, so a
  node is resident while its copy count is positive.
- a session has one or more *frontiers*: the deepest known block of each branch it has
  touched. Its blocks are the ancestors of its frontiers. Shared ancestors are stored once.

Invariants (checked by :meth:`check_invariants`):
- a node exists only while it is resident in some tier, has children, or is a frontier;
  parent-only (non-resident) nodes are kept only while they connect resident descendants
  or anchor a frontier. Memory is therefore bounded by resident blocks times chain depth,
  and in vLLM's leaf-first eviction by resident blocks.
- every frontier is a resident node; when its block is evicted the frontier moves to the
  nearest resident ancestor, or the branch is dropped when none is left.
- ``children`` of a node equals the number of nodes whose parent it is.

Cost: constant amortised work per hash in an event. Moving a frontier walks up
non-resident ancestors, which under leaf-first eviction is one step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvhint.engine_plugin.index_events import GPU, Cleared, Hit, IndexEvent, Removed, Stored
from kvhint.engine_plugin.snapshot_order import RawNode, ordered_blocks


class _Node:
    """One block hash. ``sessions`` is None, one session id, or a set of ids (most
    frontiers belong to one session; a set per node would cost 200 bytes)."""

    __slots__ = ("key", "parent", "gpu", "other", "children", "sessions")

    def __init__(self, key: int, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.gpu = 0
        self.other: dict[str, int] | None = None
        self.children = 0
        self.sessions: str | set[str] | None = None

    @property
    def resident(self) -> bool:
        return self.gpu > 0 or bool(self.other)

    def copies(self, medium: str) -> int:
        if medium == GPU:
            return self.gpu
        return self.other.get(medium, 0) if self.other else 0


def _session_ids(node: _Node) -> tuple[str, ...]:
    s = node.sessions
    if s is None:
        return ()
    if isinstance(s, str):
        return (s,)
    return tuple(s)


def _add_session(node: _Node, session_id: str) -> None:
    s = node.sessions
    if s is None:
        node.sessions = session_id
    elif isinstance(s, str):
        if s != session_id:
            node.sessions = {s, session_id}
    else:
        s.add(session_id)


def _discard_session(node: _Node, session_id: str) -> None:
    s = node.sessions
    if s is None:
        return
    if isinstance(s, str):
        if s == session_id:
            node.sessions = None
        return
    s.discard(session_id)
    if len(s) == 1:
        node.sessions = next(iter(s))
    elif not s:
        node.sessions = None


def _depths(nodes: Iterable[_Node]) -> dict[int, int]:
    """Depth (0 = root) of these nodes and all their ancestors, each chain walked once."""
    depth: dict[int, int] = {}
    for start in nodes:
        path = []
        node: _Node | None = start
        while node is not None and node.key not in depth:
            path.append(node)
            node = node.parent
        base = depth[node.key] + 1 if node is not None else 0
        for offset, n in enumerate(reversed(path)):
            depth[n.key] = base + offset
    return depth


@dataclass(slots=True)
class IndexCounters:
    events: int = 0
    unknown_removed: int = 0
    unknown_hits: int = 0
    sessions_evicted: int = 0
    frontiers_dropped: int = 0


class SessionPrefixIndex:
    """Session -> frontiers, block -> parent and residency per tier. Single-threaded."""

    def __init__(self, max_sessions: int = 100_000, max_frontiers_per_session: int = 8) -> None:
        if max_sessions < 1 or max_frontiers_per_session < 1:
            raise ValueError("max_sessions and max_frontiers_per_session must be >= 1")
        self.max_sessions = max_sessions
        self.max_frontiers = max_frontiers_per_session
        self._nodes: dict[int, _Node] = {}
        # session id -> its frontier nodes, oldest first; LRU order over sessions.
        self._sessions: OrderedDict[str, list[_Node]] = OrderedDict()
        self._resident_gpu = 0
        self._nodes_with_other_tiers = 0
        self.counters = IndexCounters()

    # --- events ---------------------------------------------------------------------------

    def apply(self, event: IndexEvent) -> None:
        if isinstance(event, Stored):
            self.on_stored(event.hashes, event.parent, event.session_id, event.medium)
        elif isinstance(event, Removed):
            self.on_removed(event.hashes, event.medium)
        elif isinstance(event, Hit):
            self.on_hit(event.session_id, event.hashes)
        elif isinstance(event, Cleared):
            self.on_cleared(event.medium)
        else:
            raise TypeError(f"not an index event: {event!r}")

    def replay(self, events: Iterable[IndexEvent]) -> None:
        for event in events:
            self.apply(event)

    def on_stored(self, hashes: Sequence[int], parent: int | None,
                  session_id: str | None = None, medium: str = GPU) -> None:
        self.counters.events += 1
        nodes = self._nodes
        parent_node = None
        if parent is not None:
            parent_node = nodes.get(parent)
            if parent_node is None:
                # Parent not seen (index started late, or it was evicted and its node
                # dropped): keep a parent-only placeholder so the chain stays connected.
                parent_node = nodes[parent] = _Node(parent, None)
        chain_start = parent_node
        node = parent_node
        gpu = medium == GPU
        for key in hashes:
            prev = node
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = _Node(key, prev)
                if prev is not None:
                    prev.children += 1
            elif node.parent is None and prev is not None and prev is not node:
                node.parent = prev  # learnt the parent of a placeholder
                prev.children += 1
            if gpu:  # inlined _add_copy: the hot path
                if node.gpu == 0:
                    self._resident_gpu += 1
                node.gpu += 1
            else:
                self._add_copy(node, medium)
        if session_id is not None and node is not None and node is not chain_start:
            self._advance_frontier(session_id, chain_start, node)

    def on_removed(self, hashes: Iterable[int], medium: str = GPU) -> None:
        self.counters.events += 1
        nodes = self._nodes
        gpu = medium == GPU
        for key in hashes:
            node = nodes.get(key)
            if node is None or (node.gpu == 0 if gpu else node.copies(medium) == 0):
                self.counters.unknown_removed += 1
                continue
            if gpu:  # inlined _remove_copy: the hot path
                node.gpu -= 1
                if node.gpu:
                    continue
                self._resident_gpu -= 1
                if node.other:
                    continue
            else:
                self._remove_copy(node, medium)
                if node.resident:
                    continue
            self._on_gone(node)

    def on_hit(self, session_id: str, hashes: Sequence[int]) -> None:
        """The session reused ``hashes`` (root first) from the cache."""
        self.counters.events += 1
        if not hashes:
            return
        node = self._nodes.get(hashes[-1])
        if node is None or not node.resident:
            self.counters.unknown_hits += 1
            return
        self._advance_frontier(session_id, None, node)

    def on_cleared(self, medium: str = GPU) -> None:
        self.counters.events += 1
        if self._nodes_with_other_tiers == 0 and medium == GPU:
            self._nodes.clear()
            self._sessions.clear()
            self._resident_gpu = 0
            return
        for node in list(self._nodes.values()):
            if node.copies(medium):
                self._remove_copy(node, medium, all_copies=True)
                if not node.resident:
                    self._on_gone(node)

    # --- queries --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_resident_gpu(self) -> int:
        return self._resident_gpu

    def __contains__(self, key: int) -> bool:
        return key in self._nodes

    def is_resident(self, key: int, medium: str | None = GPU) -> bool:
        node = self._nodes.get(key)
        if node is None:
            return False
        return node.resident if medium is None else node.copies(medium) > 0

    def parent_of(self, key: int) -> int | None:
        node = self._nodes.get(key)
        return node.parent.key if node is not None and node.parent is not None else None

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def sessions(self) -> Iterator[str]:
        return iter(self._sessions)

    def frontiers(self, session_id: str) -> list[int]:
        return [n.key for n in self._sessions.get(session_id, ())]

    def chain(self, key: int) -> list[int]:
        """Hashes from the root to ``key`` (inclusive), as far as the index knows them."""
        out = []
        node = self._nodes.get(key)
        while node is not None:
            out.append(node.key)
            node = node.parent
        out.reverse()
        return out

    def session_blocks(self, session_id: str, resident_only: bool = True) -> list[int]:
        """Every block of the session's branches, root-most first (by depth), each once."""
        fronts = self._sessions.get(session_id)
        if not fronts:
            return []
        depth = _depths(fronts)
        keys = sorted(depth, key=depth.__getitem__)
        if resident_only:
            nodes = self._nodes
            keys = [k for k in keys if nodes[k].resident]
        return keys

    def exclusive_blocks(self, session_id: str) -> list[int]:
        """GPU-resident blocks that only this session's branches use, leaf first.

        Walks up from each frontier while no other branch forks off the chain and no other
        session has a frontier on it; a shared system prompt or another session's history
        stops the walk. Cost: the length of those exclusive chains.
        """
        fronts = self._sessions.get(session_id)
        if not fronts:
            return []
        out: list[int] = []
        seen: set[int] = set()
        for front in fronts:
            node: _Node | None = front
            allowed_children = 0
            while node is not None and node.key not in seen:
                if node.children > allowed_children:
                    break
                owners = node.sessions
                if owners is not None and owners != session_id and (
                        isinstance(owners, str) or owners - {session_id}):
                    break
                seen.add(node.key)
                if node.gpu:
                    out.append(node.key)
                node, allowed_children = node.parent, 1
        return out

    def session_prefix(self, session_id: str, num_blocks: int) -> list[int]:
        """The first ``num_blocks`` blocks of the session's most recent branch."""
        fronts = self._sessions.get(session_id)
        if not fronts or num_blocks <= 0:
            return []
        return self.chain(fronts[-1].key)[:num_blocks]

    def copies_in(self, medium: str) -> list[int]:
        """Every hash resident in ``medium`` (not GPU), once per copy the index counts."""
        return [node.key for node in self._nodes.values() if node.other
                for _ in range(node.other.get(medium, 0))]

    def snapshot_blocks(self) -> list[tuple[int, int | None, str]]:
        """``(hash, parent, medium)`` once for GPU residency and once per copy in each
        other tier (:func:`~.snapshot_order.ordered_blocks`), parents listed before
        children. Parent-only (non-resident) nodes are not listed."""
        return ordered_blocks(self.snapshot_raw())

    def snapshot_raw(self) -> list[RawNode]:
        """A copy of every node, cheap enough for the scheduler thread; order it (the
        costly part) elsewhere with :func:`ordered_blocks`."""
        return [(key, node.parent.key if node.parent is not None else None, node.gpu,
                 dict(node.other) if node.other else None)
                for key, node in self._nodes.items()]

    def snapshot_sessions(self) -> list[tuple[str, list[int]]]:
        return [(sid, [n.key for n in fronts]) for sid, fronts in self._sessions.items()]

    def state(self) -> tuple[dict[int, tuple[int | None, int, tuple]], dict[str, frozenset]]:
        """Canonical content, for replay equality checks."""
        blocks = {
            k: (n.parent.key if n.parent else None, n.gpu,
                tuple(sorted((n.other or {}).items())))
            for k, n in self._nodes.items()
        }
        sessions = {sid: frozenset(n.key for n in f) for sid, f in self._sessions.items()}
        return blocks, sessions

    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant in the module docstring is broken."""
        children: dict[int, int] = {}
        for node in self._nodes.values():
            if node.parent is not None:
                assert self._nodes.get(node.parent.key) is node.parent, "dangling parent"
                children[node.parent.key] = children.get(node.parent.key, 0) + 1
        resident = 0
        for key, node in self._nodes.items():
            assert node.children == children.get(key, 0), f"children count of {key}"
            assert node.resident or node.children > 0 or node.sessions is not None, (
                f"orphan non-resident node {key}")
            resident += node.gpu > 0
        assert resident == self._resident_gpu, "resident count"
        for sid, fronts in self._sessions.items():
            assert fronts and len(fronts) <= self.max_frontiers, f"frontiers of {sid}"
            for node in fronts:
                assert node.resident, f"frontier {node.key} of {sid} is not resident"
                assert self._nodes.get(node.key) is node, "frontier not in index"
                assert sid in _session_ids(node), "frontier back-reference"

    # --- internals ------------------------------------------------------------------------

    def _add_copy(self, node: _Node, medium: str) -> None:
        if medium == GPU:
            if node.gpu == 0:
                self._resident_gpu += 1
            node.gpu += 1
            return
        if node.other is None:
            node.other = {}
            self._nodes_with_other_tiers += 1
        node.other[medium] = node.other.get(medium, 0) + 1

    def _remove_copy(self, node: _Node, medium: str, all_copies: bool = False) -> None:
        if medium == GPU:
            node.gpu = 0 if all_copies else node.gpu - 1
            if node.gpu == 0:
                self._resident_gpu -= 1
            return
        assert node.other is not None
        left = 0 if all_copies else node.other[medium] - 1
        if left:
            node.other[medium] = left
        else:
            del node.other[medium]
            if not node.other:
                node.other = None
                self._nodes_with_other_tiers -= 1

    def _advance_frontier(self, session_id: str, replaced: _Node | None, node: _Node) -> None:
        fronts = self._sessions.get(session_id)
        if fronts is None:
            fronts = self._sessions[session_id] = []
            if len(self._sessions) > self.max_sessions:
                self._evict_session()
        else:
            self._sessions.move_to_end(session_id)
        if replaced is not None and replaced in fronts:
            fronts.remove(replaced)
            _discard_session(replaced, session_id)
            self._maybe_delete(replaced)
        if node in fronts:
            fronts.remove(node)  # re-append: most recent branch last
            fronts.append(node)
            return
        fronts.append(node)
        _add_session(node, session_id)
        if len(fronts) > self.max_frontiers:
            oldest = fronts.pop(0)
            _discard_session(oldest, session_id)
            self.counters.frontiers_dropped += 1
            self._maybe_delete(oldest)

    def _evict_session(self) -> None:
        session_id, fronts = self._sessions.popitem(last=False)
        self.counters.sessions_evicted += 1
        for node in fronts:
            _discard_session(node, session_id)
            self._maybe_delete(node)

    def _on_gone(self, node: _Node) -> None:
        """``node`` has no resident copy left: move its frontiers up, then prune."""
        sessions = node.sessions
        if sessions is not None:
            ancestor = node.parent
            while ancestor is not None and not (ancestor.gpu or ancestor.other):
                ancestor = ancestor.parent
            for session_id in ((sessions,) if isinstance(sessions, str) else tuple(sessions)):
                fronts = self._sessions[session_id]
                if ancestor is None or ancestor in fronts:
                    fronts.remove(node)
                    if not fronts:
                        del self._sessions[session_id]
                else:
                    fronts[fronts.index(node)] = ancestor
                    _add_session(ancestor, session_id)
            node.sessions = None
        self._maybe_delete(node)

    def _maybe_delete(self, node: _Node | None) -> None:
        nodes = self._nodes
        while (node is not None and node.children == 0 and node.sessions is None
               and not node.gpu and not node.other):
            del nodes[node.key]
            parent = node.parent
            node.parent = None
            if parent is None:
                return
            parent.children -= 1
            node = parent
