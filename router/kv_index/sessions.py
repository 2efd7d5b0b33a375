"""Session -> worker -> frontier table, shared by every index implementation.

Bounded: at most ``max_sessions`` sessions (least recently stored evicted first) and
``max_frontiers`` branches per (session, worker) (oldest dropped); both counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvhint.router.kv_index.protocol import SessionPlacement


class SessionTable:
    def __init__(self, max_sessions: int = 100_000, max_frontiers: int = 4) -> None:
        if max_sessions <= 0 or max_frontiers <= 0:
            raise ValueError("max_sessions and max_frontiers must be positive")
        self.max_sessions = max_sessions
        self.max_frontiers = max_frontiers
        # session -> {worker -> frontiers}; both orders are recency (most recent last).
        self._sessions: OrderedDict[str, dict[str, tuple[int, ...]]] = OrderedDict()
        self._by_worker: dict[str, set[str]] = {}
        self.evicted = 0
        self.frontiers_dropped = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def stored(self, session_id: str, worker_id: str, parent_hash: int | None,
               last_hash: int) -> None:
        """A run ending in ``last_hash`` (whose first block's parent is ``parent_hash``)
        was stored for the session on the worker."""
        placements = self._touch(session_id)
        frontiers = placements.pop(worker_id, None)
        if frontiers is None:
            placements[worker_id] = (last_hash,)
            self._by_worker.setdefault(worker_id, set()).add(session_id)
            return
        if parent_hash in frontiers or last_hash in frontiers:
            kept = tuple(f for f in frontiers if f != parent_hash and f != last_hash)
        else:  # a new branch
            kept = frontiers
        if len(kept) >= self.max_frontiers:
            self.frontiers_dropped += len(kept) - self.max_frontiers + 1
            kept = kept[len(kept) - self.max_frontiers + 1:]
        placements[worker_id] = (*kept, last_hash)

    def load(self, worker_id: str, sessions: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Placements from a snapshot (the worker's old placements must be dropped first)."""
        for session_id, frontiers in sessions:
            if not frontiers:
                continue
            frontiers = tuple(frontiers)
            if len(frontiers) > self.max_frontiers:
                self.frontiers_dropped += len(frontiers) - self.max_frontiers
                frontiers = frontiers[-self.max_frontiers:]
            placements = self._touch(session_id)
            placements.pop(worker_id, None)
            placements[worker_id] = frontiers
            self._by_worker.setdefault(worker_id, set()).add(session_id)

    def drop_worker(self, worker_id: str) -> None:
        for session_id in self._by_worker.pop(worker_id, ()):
            placements = self._sessions.get(session_id)
            if placements is None:
                continue
            placements.pop(worker_id, None)
            if not placements:
                del self._sessions[session_id]

    def placements(self, session_id: str) -> tuple[SessionPlacement, ...]:
        placements = self._sessions.get(session_id)
        if not placements:
            return ()
        return tuple(SessionPlacement(w, f) for w, f in placements.items())

    def workers(self) -> set[str]:
        return {w for w, sessions in self._by_worker.items() if sessions}

    def export(self) -> dict[str, dict[str, tuple[int, ...]]]:
        return {s: dict(p) for s, p in self._sessions.items() if p}

    def _touch(self, session_id: str) -> dict[str, tuple[int, ...]]:
        placements = self._sessions.get(session_id)
        if placements is not None:
            self._sessions.move_to_end(session_id)
            return placements
        placements = self._sessions[session_id] = {}
        while len(self._sessions) > self.max_sessions:
            old_id, old = self._sessions.popitem(last=False)
            self.evicted += 1
            for worker_id in old:
                self._by_worker.get(worker_id, set()).discard(old_id)
        return placements
