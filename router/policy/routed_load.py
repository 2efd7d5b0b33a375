"""The router's own load figures per worker, from what it routed: one bookkeeping for the
live router (``RoutingService``) and the simulator, so ``route()`` sees the same figures
from both. Pure: no I/O, no clock of its own (the caller passes ``now``, which never goes
back).

Per worker, as :class:`~kvhint.router.policy.routing.WorkerLoad` carries them:

- ``recent_prefill_tokens`` / ``recent_sessions``: uncached prompt tokens dispatched
  there and new sessions placed there, decayed (:class:`RecentLoad`). Reading them decays
  the accumulator to ``now`` (what the simulator always did; the live router read a
  decayed copy before, the same figure up to float rounding);
- ``pending_prefill_tokens``: uncached prompt tokens dispatched and not yet prefilled
  (cleared at the first token, or by the request's end, whichever comes first);
- ``active_blocks``: the prompt blocks of every request dispatched and not yet ended
  (queued ones included, decode blocks not counted).

A worker nothing was routed to has no entry and reads as all zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhint.router.policy.routing import RecentLoad, WorkerLoad


@dataclass(slots=True)
class RoutedLoad:
    """One worker's figures (read-only for callers: :class:`RoutedLoads` keeps them)."""

    recent: RecentLoad
    pending_prefill: int = 0
    active_blocks: int = 0


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks a prompt of ``prompt_tokens`` takes (its last one partly filled)."""
    return -(-prompt_tokens // max(block_size, 1))


class RoutedLoads:
    """The figures of every worker something was routed to; see the module doc."""

    def __init__(self, half_life_s: float) -> None:
        self._half_life_s = half_life_s
        self._loads: dict[str, RoutedLoad] = {}

    def get(self, worker_id: str) -> RoutedLoad | None:
        return self._loads.get(worker_id)

    def forget(self, worker_id: str) -> None:
        """A worker gone for good: its figures go."""
        self._loads.pop(worker_id, None)

    def _load(self, worker_id: str, now: float) -> RoutedLoad:
        load = self._loads.get(worker_id)
        if load is None:
            load = self._loads[worker_id] = RoutedLoad(RecentLoad(self._half_life_s, at=now))
        return load

    def session_placed(self, worker_id: str, now: float) -> None:
        """A new session's first turn landed on ``worker_id`` (new_session_spread)."""
        self._load(worker_id, now).recent.add_session(now)

    def dispatched(self, worker_id: str, now: float, uncached_tokens: int,
                   prompt_tokens: int, block_size: int) -> None:
        """A request with ``uncached_tokens`` to prefill went to ``worker_id``."""
        load = self._load(worker_id, now)
        load.recent.add_prefill(now, uncached_tokens)
        load.pending_prefill += uncached_tokens
        load.active_blocks += prompt_blocks(prompt_tokens, block_size)

    def first_token(self, worker_id: str, uncached_tokens: int) -> None:
        """The request's prefill is over (its response started)."""
        load = self._loads.get(worker_id)
        if load is not None:
            load.pending_prefill = max(load.pending_prefill - uncached_tokens, 0)

    def finished(self, worker_id: str, prompt_tokens: int, block_size: int,
                 prefill_pending: int) -> None:
        """The request ended (answered, failed, refused); ``prefill_pending``: its
        uncached tokens :meth:`first_token` has not cleared yet."""
        load = self._loads.get(worker_id)
        if load is not None:
            load.pending_prefill = max(load.pending_prefill - prefill_pending, 0)
            load.active_blocks = max(
                load.active_blocks - prompt_blocks(prompt_tokens, block_size), 0)

    def worker_load(self, worker_id: str, now: float, *, healthy: bool,
                    active_requests: int) -> WorkerLoad:
        """What ``route()`` sees of ``worker_id`` at ``now``."""
        load = self._loads.get(worker_id)
        if load is None:
            return WorkerLoad(worker_id=worker_id, healthy=healthy,
                              active_requests=active_requests)
        recent = load.recent
        recent.decay_to(now)
        return WorkerLoad(
            worker_id=worker_id,
            healthy=healthy,
            active_requests=active_requests,
            active_blocks=load.active_blocks,
            pending_prefill_tokens=load.pending_prefill,
            recent_prefill_tokens=recent.prefill_tokens,
            recent_sessions=recent.sessions,
        )
