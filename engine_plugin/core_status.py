"""What the engine reports about itself (mixed into
:class:`~kvhint.engine_plugin.core.PluginCore`): the heartbeat's WorkerStatus, and the
usage figures the scheduler thread hands the transport for it.

The figures are refreshed at most every :data:`STATUS_REFRESH_S`, at a scheduler step
(:meth:`StatusMixin._refresh_status_in_step`); a step that skips the refresh leaves the
time it falls due in the mailbox, so an engine that goes idle is woken for one more step
and the heartbeat never reports stale figures for good.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from msgspec import UNSET, UnsetType

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.executor import HintExecutor
from kvhint.engine_plugin.mailbox import Mailbox
from kvhint.engine_plugin.session_index import SessionPrefixIndex
from kvhint.engine_plugin.vllm_adapter import VllmCacheAdapter
from kvhint.schemas import Budgets, ClaimCost, Usage, WorkerStatus
from kvhint.schemas.hints import SUPPORTED_VERSIONS

if TYPE_CHECKING:
    from kvhint.engine_plugin.core import EngineIdentity

# The least time between two refreshes of the heartbeat's figures (each reads the pool,
# the index and the executor on the scheduler thread).
STATUS_REFRESH_S = 0.25


class StatusMixin:
    """The core's status; the core sets these up (``_status_at``: time.monotonic() of
    the last refresh, 0.0 at first)."""

    adapter: VllmCacheAdapter
    config: PluginConfig
    identity: EngineIdentity
    mailbox: Mailbox | None
    index: SessionPrefixIndex
    executor: HintExecutor
    cache_namespace: str
    event_seq: int
    _status_at: float

    def _refresh_status_in_step(self, mailbox: Mailbox) -> None:
        """At the end of a step: refresh the figures unless the last refresh is too
        recent, and then leave when it falls due."""
        now = time.monotonic()
        since = now - self._status_at
        if since >= STATUS_REFRESH_S:
            self._status_at = now
            self.refresh_status()
            mailbox.status_refresh_at = None
        else:
            # Skipped to spare the step; an engine that now goes idle would leave the
            # heartbeat reporting these figures' predecessors for good (a pin applied
            # in this step, missing). The transport wakes it for one step then.
            mailbox.status_refresh_at = time.time() + STATUS_REFRESH_S - since

    def refresh_status(self) -> None:
        """Hand the transport the figures its heartbeat reports (scheduler thread)."""
        if self.mailbox is not None:
            self.mailbox.status = {"usage": self.status_usage(), "seq": self.event_seq}

    def budgets(self) -> Budgets:
        return Budgets(max_pinned_blocks=self.executor.max_pinned_blocks,
                       max_pin_ttl_s=self.config.max_pin_ttl_s,
                       max_retained_blocks=self.executor.max_retained_blocks,
                       max_retain_ttl_s=self.config.max_retain_ttl_s)

    def status_usage(self) -> Usage:
        adapter = self.adapter
        total = adapter.num_blocks
        free = adapter.num_free_blocks
        return Usage(gpu_blocks_total=total, gpu_blocks_free=free,
                     kv_usage=round(1.0 - free / total, 6) if total else 0.0,
                     pinned_blocks=self.executor.pinned_blocks,
                     retained_blocks=self.executor.retained_blocks,
                     indexed_blocks=len(self.index), sessions=self.index.num_sessions,
                     active_requests=adapter.num_live_requests,
                     pending_hints=(len(self.mailbox.inbound) if self.mailbox else 0)
                     + self.executor.pending_actions)

    def worker_status(self, usage: Usage | None = None, interval_s: float | None = None
                      ) -> WorkerStatus:
        ident = self.identity
        return WorkerStatus(
            worker_id=ident.worker_id, epoch=ident.epoch, model=ident.model,
            cache_namespace=self.cache_namespace, block_size=self.adapter.block_size,
            hash_algo=ident.hash_algo, none_hash_seed=ident.none_hash_seed,
            data_parallel_rank=ident.data_parallel_rank,
            supported_actions=self.supported_actions(),
            host_tier=self.executor.host_tier is not None, budgets=self.budgets(),
            usage=usage or self.status_usage(), last_event_seq=self.event_seq,
            interval_s=interval_s or self.config.heartbeat_interval_s, at=time.time(),
            http_url=self.config.http_url,
            # Sent only when the chain is finer than a block (the 1.1 form otherwise).
            hash_block_size=(UNSET if self.adapter.hash_block_size == self.adapter.block_size
                             else self.adapter.hash_block_size),
            claim_cost=self.claim_cost())

    def claim_cost(self) -> ClaimCost | UnsetType:
        """The pool blocks a claim of n positions takes (status 1.3), from the groups a
        hybrid model's hit needs (``engine_plugin/group_holds.py``): the followed group
        and each other full-attention group a block a position, each tail group (sliding
        window, Mamba) its tail. UNSET on a one-group model (the 1.2 form: one a
        position)."""
        needs = self.adapter.hit_groups
        if not needs:
            return UNSET
        return ClaimCost(per_position=1 + sum(1 for n in needs if n.tail is None),
                         tails=[n.tail for n in needs if n.tail is not None])

    def supported_actions(self) -> dict[str, list[str]]:
        """What this worker applies (Demote and Share need a host tier; nothing without
        prefix caching; no Pin, Retain or Prefetch where a KV cache group no hold can take
        keeps any hit from being kept, ``group_holds.unheld_reason``)."""
        if not self.adapter.prefix_caching:
            return {}
        skip = {"kv.share"} if self.executor.host_tier is not None else {"kv.share", "kv.demote"}
        if self.adapter.unheld_groups:
            skip |= {"kv.pin", "kv.retain", "kv.prefetch"}
        return {action: list(versions) for action, versions in SUPPORTED_VERSIONS.items()
                if action not in skip}
