"""PluginCore: the engine-side brain, everything that runs on the scheduler thread.

It owns the SessionPrefixIndex, the HintExecutor and the vLLM adapter, and talks to the
transport only through the :class:`~kvhint.engine_plugin.mailbox.Mailbox`. No threads,
no NATS, no vLLM imports here: the connector calls it from vLLM's hooks, and the
simulator calls it directly on a headless KVCacheManager with a virtual clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvhint.engine_plugin.config import LOGGER_NAME, PluginConfig
from kvhint.engine_plugin.core_inbound import InboundMixin
from kvhint.engine_plugin.core_status import StatusMixin
from kvhint.engine_plugin.executor import HintExecutor
from kvhint.engine_plugin.host_tier import HostTier
from kvhint.engine_plugin.inbound_checks import (
    INTERNAL_ERROR_REASON,
    NO_PREFIX_CACHE_REASON,
    decode_hints_safely,
    rejected,
    too_many_hashes,
    type_name,
    within_pool,
)
from kvhint.engine_plugin.index_events import CPU, GPU, Cleared, Hit, IndexEvent, Removed
from kvhint.engine_plugin.mailbox import EventBatchOut, Mailbox, peek_advice_id
from kvhint.engine_plugin.session_index import SessionPrefixIndex
from kvhint.engine_plugin.vllm_adapter import VllmCacheAdapter
from kvhint.schemas import (
    DONOR_ACTION_TYPE,
    DecodedHints,
    DonorAdvice,
    HintOutcome,
    HoldsReleased,
    InvalidAction,
    OutcomeStatus,
    ParsedAction,
    WireDecodeError,
    decode_advice,
    new_epoch,
)
from kvhint.schemas.advice import echoed_advice_id
from kvhint.schemas.hints import one_per_action_id

logger = logging.getLogger(LOGGER_NAME)

# Inbound messages handled per scheduler step, so a flood of hints cannot stall a step;
# and their bytes (the work grows with the block hashes named: 64 1 MB messages took
# ~280 ms in one step, one takes ~5-10 ms). A step takes messages until either is spent
# (at least one); the rest wait for the next step (the engine runs one for them).
MAX_INBOUND_PER_STEP = 64
MAX_INBOUND_BYTES_PER_STEP = 256 << 10
# And their actions (each costs up to ~10-50 us per block of the session it names): a
# step applies no more than 64 one-action messages could bring; a message with more has
# the rest applied in the next steps (:meth:`InboundMixin._within_step`). Before, one
# 1 MB message of ~7k session Pins held one step (the scheduler thread) for ~50 s.
MAX_INBOUND_ACTIONS_PER_STEP = 64


@dataclass(frozen=True)
class EngineIdentity:
    """Who this engine is, as the router sees it (heartbeat, outcomes, namespaces)."""

    worker_id: str
    model: str = "unknown"
    hash_algo: str = "sha256"
    none_hash_seed: str | None = "vllm-none-hash"
    data_parallel_rank: int = 0
    # Ordered by the engine's start (schemas.new_epoch): a router never takes an older
    # engine's late messages for a restart.
    epoch: str = field(default_factory=new_epoch)

    def cache_namespace(self, block_size: int) -> str:
        """Blocks are comparable across workers only within one namespace. A secret seed
        (xxhash without PYTHONHASHSEED: random per engine process) makes this engine's
        hashes its own, so its namespace names its epoch; before, every such engine of a
        model shared "secret" and donor advice compared hashes that never match."""
        seed = (self.none_hash_seed if self.none_hash_seed is not None
                else f"secret:{self.epoch}")
        return f"{self.model}|{self.hash_algo}|{seed}|bs{block_size}"


@dataclass(slots=True)
class CoreCounters:
    event_batches: int = 0
    events: int = 0
    # Block events of a KV-cache group other than the one followed (a hybrid model's):
    # neither indexed nor published (the router would drop them).
    events_other_group: int = 0
    hits_observed: int = 0
    hint_messages: int = 0
    advice_messages: int = 0
    snapshot_requests: int = 0
    internal_errors: int = 0
    # Latency samples not kept because an interval already held MAX_LATENCY_SAMPLES
    # (.core_inbound; kvhint:hint_apply_seconds then counts fewer outcomes than there were).
    latency_samples_dropped: int = 0
    # Seconds from a message's arrival at the transport to its outcomes (in the engine).
    apply_latencies_s: list[float] = field(default_factory=list)


class PluginCore(InboundMixin, StatusMixin):
    """See the module docstring. Construct with :meth:`attach`; its status (heartbeat
    figures): :mod:`.core_status`; one inbound message's handling: :mod:`.core_inbound`."""

    def __init__(self, adapter: VllmCacheAdapter, config: PluginConfig,
                 identity: EngineIdentity, clock: Callable[[], float],
                 mailbox: Mailbox | None = None, host_tier: HostTier | None = None) -> None:
        self.adapter = adapter
        self.config = config
        self.identity = identity
        self.clock = clock
        self.mailbox = mailbox
        self.index = SessionPrefixIndex(config.max_sessions, config.max_frontiers_per_session)
        self.executor = HintExecutor(adapter, self.index, config, identity.worker_id, clock,
                                     host_tier)
        self.counters = CoreCounters()
        self.event_seq = 0
        self.cache_namespace = identity.cache_namespace(adapter.block_size)
        self._pending_hits: list[Hit] = []
        # Outcomes the engine loop settled with no mailbox to post them to, kept for the
        # next advance() caller (an in-process driver: tests, the simulator).
        self._unposted: list[HintOutcome] = []
        self._status_at = 0.0
        # The index's copy for snapshot requests taken in the current pump(): one copy
        # serves them all (no event changes the index between them).
        self._step_snapshot: tuple[int, Any, Any] | None = None
        self._event_log: list[IndexEvent] | None = None
        self._errors_logged: set[str] = set()
        if mailbox is not None and mailbox.event_bytes_limit is None:
            mailbox.event_bytes_limit = config.event_buffer_bytes

    @classmethod
    def attach(cls, kv_cache_manager: Any, config: PluginConfig | None = None, *,
               clock: Callable[[], float] = time.time, identity: EngineIdentity | None = None,
               mailbox: Mailbox | None = None, host_tier: HostTier | None = None,
               find_host_tier: Callable[[VllmCacheAdapter], HostTier | None] | None = None
               ) -> PluginCore:
        """Bind to vLLM's KVCacheManager (installs the adapter's tees and wrappers).
        ``find_host_tier`` builds the host tier from the adapter when none is given."""
        config = config or PluginConfig()
        identity = identity or EngineIdentity(worker_id=config.resolved_worker_id(0))
        adapter = VllmCacheAdapter(kv_cache_manager)
        if host_tier is None and find_host_tier is not None:
            host_tier = find_host_tier(adapter)
        core = cls(adapter, config, identity, clock, mailbox, host_tier)
        core.adapter.install(
            core.guarded("take_events", core.on_engine_events),
            core.guarded("reset_prefix_cache", core.before_reset),
            core.guarded("allocate_slots:relieve_pressure", core.executor.relieve_pressure,
                         default=0),
            core.guarded("allocate_slots:observe_admission", core.observe_admission),
            core.guarded("allocate_slots:releasable", core.executor.holds.releasable,
                         default=0),
            core.guard)
        if core.adapter.events_enabled_by_plugin:
            logger.info("kvhint: KV cache events were off; the plugin turned them on in the "
                        "block pool (vLLM publishes them nowhere without --kv-events-config)")
        return core

    def detach(self) -> None:
        self.adapter.uninstall()

    def guard(self, hook: str, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """Run plugin code called from inside vLLM: an exception is logged (once per
        hook, with its traceback), counted, and never reaches the engine."""
        try:
            return fn(*args)
        except Exception:  # a plugin bug must never take the engine down
            self._internal_error(hook)
            return default

    def _internal_error(self, hook: str) -> None:
        """Count the exception being handled, and log it once per hook with its traceback."""
        self.counters.internal_errors += 1
        if hook not in self._errors_logged:
            self._errors_logged.add(hook)
            logger.exception("kvhint: error in %s (logged once; the engine continues as "
                             "plain vLLM)", hook)

    def guarded(self, hook: str, fn: Callable[..., Any], default: Any = None
                ) -> Callable[..., Any]:
        return lambda *args: self.guard(hook, fn, *args, default=default)

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Swap the injected clock (tests, and the simulator's virtual time)."""
        self.clock = clock
        self.executor.clock = clock

    def record_events(self, log: list[IndexEvent] | None) -> None:
        """Append every event applied to the index, in order, to ``log`` (replay proofs)."""
        self._event_log = log

    # --- request lifecycle (scheduler hooks) ------------------------------------------------

    def observe_admission(self, request: Any, num_local_hit_tokens: int) -> None:
        """The request was admitted reusing ``num_local_hit_tokens`` cached tokens. The
        adapter calls this from ``allocate_slots``; call it yourself only when admitting
        requests without going through the manager's ``allocate_slots``."""
        keys = self.adapter.hit_keys(request, num_local_hit_tokens)
        session_id = self.adapter.session_id(request)
        if keys and session_id is not None:
            hit = Hit(session_id, tuple(keys))
            self.counters.hits_observed += 1
            if self.index.is_resident(keys[-1], None):
                # Applied now, before this step's BlockStored events extend the same chain,
                # so the session's frontier ends on the new leaf, not on the hit prefix.
                self._apply_hits((hit,))
            else:
                # The hit is on blocks another request cached earlier in this very step;
                # their BlockStored events arrive with this step's drain.
                self._pending_hits.append(hit)

    def observe_new_request(self, request: Any) -> None:
        """Not needed any more (the adapter sees requests in ``allocate_slots`` and
        ``free``); kept so callers of the first API keep working."""

    def observe_finished(self, request: Any) -> None:
        """Not needed any more; see :meth:`observe_new_request`."""

    def sync(self) -> None:
        """Drain the manager's events into the index (the scheduler does this every step
        through the tee; the simulator calls it after driving the manager itself)."""
        self.adapter.manager.take_events()
        self._apply_pending_hits()

    def on_engine_events(self, events: list[Any]) -> None:
        """Every KV event the scheduler drains passes here (via the adapter's tee). The
        batch is published under the next sequence number even when the index update
        fails (a plugin bug: the exception goes on to the hook's guard, which counts it):
        the router mirrors vLLM's events, not this index, and a batch never published
        would leave no sequence gap to make it resync. A hybrid model's block events of
        KV-cache groups other than the one followed are not published (the router would
        drop them: ``schemas.events.follows_group``), counted in ``events_other_group``;
        a batch left with no event is not published and takes no sequence number."""
        try:
            self._index_engine_events(events)
        finally:
            self.counters.event_batches += 1
            self.counters.events += len(events)
            published, other_group = self.adapter.followed_events(events)
            self.counters.events_other_group += other_group
            if self.mailbox is not None and published:
                self.event_seq += 1
                self.mailbox.put_events(EventBatchOut(self.event_seq, time.time(), published))

    def _index_engine_events(self, events: list[Any]) -> None:
        index, adapter, log = self.index, self.adapter, self._event_log
        removed: list[int] = []
        cleared = False
        for event in adapter.index_events(events, adapter.event_group,
                                          adapter.re_reports_in(events)):
            index.apply(event)
            if log is not None:
                log.append(event)
            if isinstance(event, Removed):
                adapter.forget([k for k in event.hashes if not index.is_resident(k, None)])
                if event.medium == GPU:
                    removed.extend(event.hashes)
            elif isinstance(event, Cleared):
                if event.medium == GPU:
                    cleared = True
                    adapter.forget_all()  # a host-only block is then unknown until seen again
                else:
                    adapter.forget([k for k in adapter.known_keys()
                                    if not index.is_resident(k, None)])
        removed.extend(adapter.side_removed(events))  # a hybrid model's other groups'
        if removed or cleared:
            # A held block leaves the cache only by a path other than ours (an eviction
            # needs a free block): give its hold back so no budget is spent on it.
            self.executor.holds.release_gone(None if cleared else removed)
        self._apply_pending_hits()

    def before_reset(self) -> None:
        """vLLM is about to reset its prefix cache: release our holds if they are all
        that stands in the way (with running requests the reset fails anyway)."""
        handles = self.executor.holds.handles()
        if handles and self.adapter.only_held_blocks_in_use(handles):
            released = self.executor.release_all()
            logger.info("kvhint: released %d held blocks for a prefix-cache reset", released)
            self._post_releases()  # the engine may be idle: no step would post them soon

    def on_host_tier_reset(self, events_for: Callable[[bool | None, list[int], str],
                                                  list[Any]]) -> bool:
        """vLLM reset its connectors' caches and the host tier's CPU copies with them,
        announcing nothing. Publishes what drops them from the router's view and, applied
        to this index like any batch, from the plugin's (``events_for``: the vLLM adapter's
        ``HostTierReset.events``, which says how). Returns True (the hook's guard turns a
        plugin error into None)."""
        events = events_for(self.adapter.take_reset_result(), self.index.copies_in(CPU), CPU)
        if events:
            self.on_engine_events(events)
        return True

    def _apply_pending_hits(self) -> None:
        if self._pending_hits:
            self._apply_hits(self._pending_hits)
            self._pending_hits.clear()

    def _apply_hits(self, hits: Sequence[Hit]) -> None:
        for hit in hits:
            self.index.apply(hit)
        if self._event_log is not None:
            self._event_log.extend(hits)

    # --- hints --------------------------------------------------------------------------------

    def apply_hints(self, message: bytes | str | DecodedHints) -> list[HintOutcome]:
        """One outcome per action; an action the plugin fails on (a bug: counted, logged
        once) is answered ``rejected`` (REJECTED_INTERNAL_ERROR) and the others go on."""
        decoded = message if isinstance(message, DecodedHints) else self._decode_hints(message)
        self.counters.hint_messages += 1
        if not decoded.actions:
            return self.executor.apply(decoded)
        # One outcome per action id (decode_hints did this already; a DecodedHints built
        # in-process may not have).
        return [self._submit(decoded.message_id, action)
                for action in one_per_action_id(decoded.actions)]

    def _decode_hints(self, data: bytes | str) -> DecodedHints:
        """``data`` decoded (the transport does it off this thread; an in-process caller
        may not have): a decoder that raises (a bug: counted, logged once) leaves a
        message answered ``rejected`` with the reason, as a malformed one is."""
        decoded, failure = decode_hints_safely(data)
        if failure is not None:
            self._internal_error("decode_hints")
        return decoded

    def _submit(self, message_id: str, action: ParsedAction | InvalidAction) -> HintOutcome:
        if not self.adapter.prefix_caching:
            return self._rejected(message_id, action.action_id, type_name(action),
                                  NO_PREFIX_CACHE_REASON)
        try:
            return self.executor.submit(message_id,
                                        within_pool(action, self.adapter.num_blocks,
                                                    self.adapter.block_size))
        except Exception:  # one action's bug must not cost the others their outcomes
            self._internal_error("apply_hints")
            return self._rejected(message_id, action.action_id, type_name(action),
                                  INTERNAL_ERROR_REASON)

    def apply_advice(self, advice: bytes | str | DonorAdvice) -> HintOutcome:
        """One ``kv.donor`` outcome. The transport decodes advice off this thread (and
        answers a malformed one itself); bytes are for in-process callers."""
        self.counters.advice_messages += 1
        if not isinstance(advice, DonorAdvice):
            try:
                advice = decode_advice(advice)
            except WireDecodeError as exc:
                return self._rejected_advice(peek_advice_id(advice), str(exc))
        problem = too_many_hashes(advice.donor_block_hashes, self.adapter.num_blocks, "advice")
        if not self.adapter.prefix_caching:
            problem = NO_PREFIX_CACHE_REASON
        if problem is not None:
            return self._rejected_advice(advice.advice_id, problem)
        return self.executor.advise(advice, self.cache_namespace)

    def advance(self) -> list[HintOutcome]:
        """TTL expiry and deferred Prefetch completion at ``clock()``; with no mailbox,
        also the outcomes :meth:`pump` settled since the last call."""
        outcomes, self._unposted = self._unposted, []
        return outcomes + self.executor.advance()

    def take_releases(self) -> HoldsReleased | None:
        """What accepted Pins and Retains lost unasked since the last call (displaced,
        relieved under pressure, reset), as the message the router gets; None: nothing."""
        releases = self.executor.take_releases()
        if not releases:
            return None
        return HoldsReleased(worker_id=self.identity.worker_id, releases=releases,
                             at=self.clock())

    def _post_releases(self) -> None:
        if self.mailbox is not None and (message := self.take_releases()) is not None:
            self.mailbox.put_releases(message)

    def _rejected_advice(self, advice_id: str, reason: str) -> HintOutcome:
        advice_id = echoed_advice_id(advice_id)  # "" for one too long to echo
        return self._rejected(advice_id, advice_id, DONOR_ACTION_TYPE, reason)

    def _rejected(self, message_id: str, action_id: str, action_type: str, reason: str
                  ) -> HintOutcome:
        """A ``rejected`` outcome the executor did not make (not remembered: a repeat is
        applied), counted with the executor's."""
        self.executor.counters.count(action_type, OutcomeStatus.REJECTED)
        return rejected(self.identity.worker_id, message_id, action_id, action_type, reason,
                        self.clock())

    # --- the engine loop (connector) ------------------------------------------------------------

    def pump(self) -> None:
        """Once per scheduler step: handle inbound messages, expire TTLs, refresh status."""
        self._apply_pending_hits()
        mailbox = self.mailbox
        if mailbox is not None:
            mailbox.last_engine_activity = time.monotonic()
            handled = spent = actions = 0
            self._step_snapshot = None
            while (handled < MAX_INBOUND_PER_STEP and spent < MAX_INBOUND_BYTES_PER_STEP
                   and actions < MAX_INBOUND_ACTIONS_PER_STEP
                   and (item := mailbox.take()) is not None):
                handled += 1
                spent += len(item.data)
                actions += self._within_step(item, MAX_INBOUND_ACTIONS_PER_STEP - actions)
                mailbox.put_outcomes(self._handle_one(item), advice=item.kind == "advice")
            self._step_snapshot = None
        outcomes = self.executor.advance()
        if mailbox is None:
            # Without a transport only an in-process caller can have sent a Prefetch:
            # its outcome waits for that caller's advance().
            self._unposted.extend(outcomes)
        else:
            mailbox.put_outcomes(outcomes)
            # After the outcomes they may follow; a step's relief (allocations come before
            # this hook) goes out in the same step.
            self._post_releases()
            mailbox.next_deadline = self.executor.next_deadline()
            self._refresh_status_in_step(mailbox)

    def has_pending_work(self) -> bool:
        """Whether the engine should run a step even with no request: a hint waits, a TTL
        or deadline is due, or a status refresh a busy step skipped (woken for it)."""
        mailbox = self.mailbox
        if mailbox is not None and (mailbox.inbound or time.time() >= (
                mailbox.status_refresh_at or float("inf"))):
            return True
        deadline = self.executor.next_deadline()
        return deadline is not None and self.clock() >= deadline
