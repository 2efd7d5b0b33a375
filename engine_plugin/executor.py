"""HintExecutor: applies parsed hints to one engine's block cache and answers outcomes.

Synchronous and single-threaded (the scheduler thread, or the simulator); time comes from
an injected clock. It knows vLLM only through the :class:`BlockCache` port, which the
vLLM adapter implements over the real BlockPool.

Semantics (DESIGN §2, issue 3):
- every action gets exactly one terminal outcome; Prefetch may send ``deferred`` first;
  actions are idempotent by ``action_id`` (a duplicate gets the latest outcome again).
  An id one message names twice is answered once, ``rejected``, none of its actions
  applied (:func:`~kvhint.schemas.hints.one_per_action_id`). A Prefetch still waiting is
  replaced by a newer action under its id (one its memory forgot the Prefetch for): it
  never settles over that action's claim; it is counted (``prefetches_replaced``) and
  that action's outcome, which answers the id, says so. Demote handling is :mod:`.demote_apply`'s,
  Prefetch's :mod:`.prefetch`'s.
- a block is *held* (one extra reference in the pool, out of the free queue) while it has
  at least one claim. Pin claims are hard until their TTL; retain claims are soft: they
  are dropped whenever the engine needs the memory (:meth:`relieve_pressure`), lowest
  priority first, then least recently hinted, leaf first, so retention never causes an
  allocation failure or a preemption that plain vLLM would not have. A block under several
  retains has the highest of their priorities.
- a Pin, Retain or (applied) Demote whose target is a session supersedes that session's
  earlier Pin and Retain claims of the same ``owner`` on this worker: the old claims are
  dropped first, so priority and TTL are replaced, not combined. ``Retain{priority: 0}``
  therefore releases what that owner held for the session; when nothing else holds it,
  the free blocks that only this session used move to the head of the eviction order
  (leaf first), so an ended session goes before live ones. By block hashes it releases
  that owner's block-hash Retains on those blocks (a shared prefix's); session claims on
  them and Pins stay until they end. Owners' claims are apart so
  that the router's planner, which re-plans every session, never undoes what an agent
  runtime asked for: an agent's Pin outlives the planner's next Retain or release. An
  agent's Demote supersedes the planner's claims too; a session's Demote lets go no block
  another claim holds (another session's, a shared prefix's, an agent's under a
  planner's Demote): :mod:`.demotion`. A Demote waiting for host copies ends by its
  deadline, set when it first came; a repeat never moves it (the same id, even once
  forgotten by the memory, is a duplicate; a new id for the same session target
  supersedes the waiting one and keeps its deadline).
- pins are clipped to a block budget and a max TTL; retains to their own budget, where a
  higher-priority retain displaces lower-priority retained blocks, an agent runtime's
  (owner ``agent``) above every planner claim whatever the numbers
  (:func:`~kvhint.engine_plugin.hold_records.retain_rank`).
- Demote, Share and the load half of Prefetch need a host tier; without one (the CPU
  backend) Demote and Share are rejected with that reason, and Prefetch succeeds only for
  blocks already in G1 (waiting, ``deferred``, until the deadline for the others). With
  one, Demote lets go first only the GPU copies of blocks whose host copy has finished.
- blocks an accepted Pin/Retain loses later without the router asking (displaced,
  relieved under pressure, given back for a prefix-cache reset, gone from vLLM's cache by
  another path) are reported by :meth:`take_releases`; TTL expiry and the router's own
  supersessions are not.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvhint.engine_plugin.block_cache import BlockCache, BlockHandle
from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.demote_apply import DemoteMixin
from kvhint.engine_plugin.demotion import PendingDemote
from kvhint.engine_plugin.group_holds import claim_blocks, unheld_reason, with_side_blocks
from kvhint.engine_plugin.hold_records import PIN, ClaimKey, DonorClaim, claim_action_id
from kvhint.engine_plugin.holds import HoldLedger
from kvhint.engine_plugin.host_tier import NO_HOST_TIER, HostTier
from kvhint.engine_plugin.outcome_counts import counted_action_type
from kvhint.engine_plugin.prefetch import REPLACED_PREFETCH_NOTE, PendingPrefetch, PrefetchMixin
from kvhint.engine_plugin.session_index import SessionPrefixIndex
from kvhint.schemas import (
    DONOR_ACTION_TYPE,
    REJECTED_EXPIRED,
    ActionType,
    Amount,
    DecodedHints,
    DemotePayload,
    DonorAdvice,
    HintOutcome,
    HintOwner,
    HoldRelease,
    InvalidAction,
    OutcomeStatus,
    ParsedAction,
    PinPayload,
    PrefetchPayload,
    ReleaseReason,
    RetainPayload,
    SharePayload,
    Target,
)
from kvhint.schemas._codec import quoted
from kvhint.schemas.advice import echoed_advice_id
from kvhint.schemas.hints import one_per_action_id
from kvhint.schemas.outcomes import REJECTED_NO_HOST_TIER, REJECTED_NO_SHARED_TIER

ACCEPTED, CLIPPED, DEFERRED = OutcomeStatus.ACCEPTED, OutcomeStatus.CLIPPED, OutcomeStatus.DEFERRED
REJECTED, MISSING = OutcomeStatus.REJECTED, OutcomeStatus.MISSING
PLANNER, AGENT = HintOwner.PLANNER.value, HintOwner.AGENT.value

@dataclass(slots=True)
class ExecutorCounters:
    # (counted_action_type(action_type), status) -> n: bounded, whatever types come.
    outcomes: Counter = field(default_factory=Counter)
    duplicates: int = 0
    # Answered action ids forgotten to bound the idempotency memory
    # (max_remembered_actions): a repeat of one is applied again.
    remembered_forgotten: int = 0
    # Target blocks Prefetches did not wait for because the prefetch budget was full.
    prefetch_clipped_blocks: int = 0
    # Prefetches still waiting that a newer action under their id replaced (the memory
    # had forgotten them): waited for no more; that action's outcome answers the id.
    prefetches_replaced: int = 0

    def count(self, action_type: str, status: OutcomeStatus) -> None:
        self.outcomes[(counted_action_type(action_type), status.value)] += 1


class HintExecutor(PrefetchMixin, DemoteMixin):
    """Applies hints against a :class:`BlockCache`; see the module docstring."""

    def __init__(self, cache: BlockCache, index: SessionPrefixIndex, config: PluginConfig,
                 worker_id: str, clock: Callable[[], float],
                 host_tier: HostTier | None = None) -> None:
        self.cache = cache
        self.index = index
        self.config = config
        self.worker_id = worker_id
        self.clock = clock
        self.host_tier = host_tier
        self.holds = HoldLedger(cache, config.pin_budget_blocks(cache.num_blocks),
                                config.retain_budget_blocks(cache.num_blocks))
        self.counters = ExecutorCounters()
        self._pending: dict[str, PendingPrefetch] = {}
        self.max_prefetch_blocks = config.prefetch_budget_blocks(cache.num_blocks)
        self._prefetch_waiting = 0  # sum of the pending Prefetches' costs
        self._pending_demotes: dict[str, PendingDemote] = {}
        # Terminal outcomes settled outside advance() (a waiting Demote superseded), for
        # the next advance() to return.
        self._settled: list[HintOutcome] = []
        self._memory: OrderedDict[tuple[str, str], HintOutcome] = OrderedDict()

    # --- public API -----------------------------------------------------------------------

    @property
    def max_pinned_blocks(self) -> int:
        return self.holds.max_pinned

    @property
    def max_retained_blocks(self) -> int:
        return self.holds.max_retained

    @property
    def pinned_blocks(self) -> int:
        return self.holds.pinned

    @property
    def retained_blocks(self) -> int:
        return self.holds.retained

    @property
    def pending_actions(self) -> int:
        return len(self._pending) + len(self._pending_demotes)

    def apply(self, decoded: DecodedHints) -> list[HintOutcome]:
        """Apply one hints message; one outcome per action (or one for a message that
        names no action at all)."""
        if not decoded.actions:
            reason = (f"malformed hints message: {decoded.error}" if decoded.error
                      else "hints message has no actions")
            outcome = self._outcome(decoded.message_id, "", "", REJECTED, reason)
            self.counters.count("", REJECTED)
            return [outcome]
        return [self.submit(decoded.message_id, action)
                for action in one_per_action_id(decoded.actions)]

    def submit(self, message_id: str, action: ParsedAction | InvalidAction) -> HintOutcome:
        """Apply one action and return its outcome (the remembered one for a duplicate)."""
        key = ("hint", action.action_id)
        if action.action_id and key in self._memory:
            self.counters.duplicates += 1
            self._memory.move_to_end(key)
            return self._memory[key]
        if (waiting := self._pending_demotes.get(action.action_id)) is not None:
            # A Demote still waiting for copies that the memory forgot: a duplicate all
            # the same (applied again, it would restart its wait: a sender re-sending it
            # would keep it waiting for good).
            self.counters.duplicates += 1
            return waiting.deferred
        replaced = self._replace_waiting_prefetch(action.action_id)
        if isinstance(action, InvalidAction):
            outcome = self._outcome(message_id, action.action_id, action.action_type,
                                    REJECTED, action.reason)
        else:
            outcome = self._dispatch(message_id, action)
        if replaced:
            outcome = msgspec.structs.replace(outcome, reason="; ".join(
                filter(None, (outcome.reason, REPLACED_PREFETCH_NOTE))))
        self._remember(key, outcome)
        return outcome

    def advise(self, advice: DonorAdvice, namespace: str) -> HintOutcome:
        """Check a donor's residency (and retain it for ``ttl_s``); answer ``kv.donor``."""
        key = ("donor", echoed_advice_id(advice.advice_id))  # "": not remembered
        if key in self._memory:
            self.counters.duplicates += 1
            return self._memory[key]
        outcome = self._advise(advice, namespace)
        self._remember(key, outcome)
        return outcome

    def advance(self) -> list[HintOutcome]:
        """Expire claims whose TTL passed and settle deferred Prefetches and Demotes at
        ``clock()``; returns the terminal outcomes of those."""
        now = self.clock()
        self.holds.expire(now)
        done, self._settled = self._settled, []
        if self._pending_demotes:
            done.extend(self._settle_demotes(now))
        if self._pending:
            done.extend(self._settle_prefetches(now))
        return done

    def next_deadline(self) -> float | None:
        """When :meth:`advance` next has work (a claim expiry, a Prefetch's or a waiting
        Demote's deadline)."""
        times = [p.deadline for p in self._pending.values()]
        times.extend(p.deadline for p in self._pending_demotes.values())
        expiry = self.holds.next_expiry()
        if expiry is not None:
            times.append(expiry)
        return min(times) if times else None

    def relieve_pressure(self, num_blocks: int, keep: frozenset[int] = frozenset()) -> int:
        """The engine cannot allocate: release up to ``num_blocks`` retained blocks (not
        ``keep``, the allocating request's own hits)."""
        return self.holds.relieve(num_blocks, keep)

    def release_all(self) -> int:
        """Give every held block back (before vLLM resets its prefix cache)."""
        return self.holds.release_all()

    def take_releases(self) -> list[HoldRelease]:
        """What accepted Pins and Retains (and donor advice's retains) lost unasked since
        the last call, each with the ledger's reason as the wire's (a block vLLM dropped
        from its cache by another path is ``gone``, HoldsReleased 1.1; a router of an
        earlier version reads it as ``other``, its figures applied the same)."""
        return [HoldRelease(
            action_id=claim_action_id(loss.action_id),
            # A donor advice's claim is reported under its advice's id and type (the
            # kv.donor outcome's), never as a hint action of the same id.
            action_type=DONOR_ACTION_TYPE if isinstance(loss.action_id, DonorClaim) else (
                ActionType.PIN if loss.kind == PIN else ActionType.RETAIN).value,
            session_id=loss.scope,
            reason=ReleaseReason(loss.reason),
            released=self._amount(loss.released), held=self._amount(loss.held))
            for loss in self.holds.take_losses()]

    # --- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, message_id: str, action: ParsedAction, may_wait: bool = True
                  ) -> HintOutcome:
        """``may_wait``: a Demote may wait for host copies in flight (not when it already
        has: its deadline came or its copies are done)."""
        payload = action.payload
        action_id, type_ = action.action_id, action.action_type.value

        def answer(status: OutcomeStatus, reason: str, requested: Amount = Amount(),
                   applied: Amount = Amount()) -> HintOutcome:
            return self._outcome(message_id, action_id, type_, status, reason, requested,
                                 applied)

        if payload.expires_at is not None and self.clock() > payload.expires_at:
            return answer(REJECTED, f"{REJECTED_EXPIRED} expires_at {payload.expires_at:.3f} "
                                   "has passed")
        if isinstance(payload, SharePayload):
            if payload.destination_worker == self.worker_id:
                return answer(REJECTED, "share destination is this worker")
            return answer(REJECTED, f"{REJECTED_NO_SHARED_TIER} and none is configured "
                                    "here; nothing changed")
        if isinstance(payload, DemotePayload) and self.host_tier is None:
            return answer(REJECTED, f"{REJECTED_NO_HOST_TIER}: {NO_HOST_TIER}; nothing changed")
        # A Prefetch retains what it brings until its deadline: on such a model that keeps
        # no hit either (before, it held blocks and answered accepted).
        if (isinstance(payload, (PinPayload, PrefetchPayload)) or isinstance(
                payload, RetainPayload) and payload.priority > 0) and (
                reason := unheld_reason(self.cache)):
            return answer(REJECTED, reason)  # a Retain at priority 0 releases: applied
        resolved = self._resolve(payload.target)
        if isinstance(resolved, tuple):
            keys, requested_blocks = resolved
        else:
            return answer(resolved[0], resolved[1])
        requested = self._amount(requested_blocks)
        handles = [h for h in map(self.cache.lookup, keys) if h is not None]
        if isinstance(payload, PrefetchPayload):
            return self._prefetch(message_id, action_id, payload, keys, handles, requested)
        scope = payload.target.session_id
        if not handles:
            return answer(MISSING, "no target block is resident", requested)
        notes = []
        if len(handles) < requested_blocks:
            notes.append(f"{len(handles)} of {requested_blocks} target blocks resident")
        owner = payload.owner.value
        superseded = (self._supersede_waiting_demotes(scope, owner, action_id)
                      if scope is not None else [])
        if isinstance(payload, DemotePayload):
            if may_wait and (wait := self._copies_to_wait_for(handles, owner, scope)):
                # A Demote that replaces a waiting one of the same target (a repeat under
                # a new id) keeps the earlier deadline: re-sending never postpones it.
                deadline = min([self.clock() + self.config.demote_copy_wait_s]
                               + [p.deadline for p in superseded
                                  if p.action.payload.target == payload.target])
                deferred = answer(DEFERRED, f"{wait} of {len(handles)} resident blocks have "
                                  "a host copy vLLM's connector is still making; waiting up "
                                  f"to {deadline - self.clock():.3g}s for them", requested)
                self._pending_demotes[action_id] = PendingDemote(message_id, action,
                                                                  deadline, deferred)
                return deferred
            return self._demote(answer, scope, owner, handles, requested, notes)
        if scope is not None:
            self.holds.supersede(scope, owner)
        if isinstance(payload, PinPayload):
            applied = self._pin(action_id, payload.ttl_s, handles, notes, scope, owner)
        elif isinstance(payload, RetainPayload):
            if payload.priority == 0 and scope is None:
                dropped, freed = self.holds.release_retains(
                    with_side_blocks(self.cache, handles), owner)
                notes.append(f"priority 0: released this owner's block-hash Retains on "
                             f"{dropped} blocks ({freed} back in the free queue; session "
                             "claims and Pins stay until they end)")
                return answer(ACCEPTED, "; ".join(notes), requested)
            if payload.priority == 0:
                moved = self._evict_first_exclusive(scope)
                notes.append(f"priority 0: released; {moved} free blocks only this session "
                             "used now go first")
                # ``applied`` is what the action holds now: nothing (the sender counts an
                # accepted Retain's ``applied`` as held).
                return answer(ACCEPTED, "; ".join(notes), requested)
            applied = self._retain(action_id, payload.priority, payload.ttl_s, handles, notes,
                                   scope, owner)
        else:  # pragma: no cover - every payload type is handled above
            raise TypeError(type(payload))
        status = ACCEPTED if not notes else CLIPPED  # notes so far say what was clipped
        if payload.evict_rest_first:
            moved = self._evict_first_exclusive(scope, keep=set(keys))
            notes.append(f"{moved} free blocks of the session past the target go first")
        return answer(status, "; ".join(notes), requested, self._amount(applied))

    def _resolve(self, target: Target) -> tuple[list[int], int] | list:
        """Target -> (hashes root first, number of blocks asked for), or
        ``[status, reason]`` when it cannot name any block here."""
        if target.block_hashes is not None:
            keys = list(dict.fromkeys(target.block_hashes))
            return keys, len(keys)
        session_id = target.session_id
        assert session_id is not None  # Target.problem() guarantees one of the forms
        if not self.index.has_session(session_id):
            return [MISSING, f"session {session_id!r} has no resident blocks here"]
        if target.prefix_tokens is not None:
            num = target.prefix_tokens // self.cache.block_size
            if num == 0:
                return [REJECTED, f"prefix_tokens {target.prefix_tokens} is less than one "
                                  f"block ({self.cache.block_size} tokens)"]
            return self.index.session_prefix(session_id, num), num
        keys = self.index.session_blocks(session_id)
        return keys, len(keys)

    # --- pin / retain -----------------------------------------------------------------------

    def _pin(self, action_id: str, ttl: float, handles: list[BlockHandle], notes: list[str],
             scope: str | None, owner: str) -> int:
        if ttl > self.config.max_pin_ttl_s:
            ttl = self.config.max_pin_ttl_s
            notes.append(f"ttl clipped to max_pin_ttl_s={ttl:g}")
        blocks, clip, shape_note = claim_blocks(self.cache, handles)
        applied, note = self.holds.pin(action_id, blocks, self.clock() + ttl, scope, owner,
                                       clip)
        notes.extend(n for n in (note, shape_note) if n)
        return applied

    def _retain(self, action_id: ClaimKey, priority: int, ttl_s: float | None,
                handles: list[BlockHandle], notes: list[str], scope: str | None,
                owner: str) -> int:
        ttl = ttl_s if ttl_s is not None else self.config.max_retain_ttl_s
        if ttl > self.config.max_retain_ttl_s:
            ttl = self.config.max_retain_ttl_s
            notes.append(f"ttl clipped to max_retain_ttl_s={ttl:g}")
        blocks, clip, shape_note = claim_blocks(self.cache, handles)
        applied, note = self.holds.retain(action_id, priority, blocks, self.clock() + ttl,
                                          scope, owner, clip)
        notes.extend(n for n in (note, shape_note) if n)
        return applied

    def _evict_first_exclusive(self, session_id: str | None,
                               keep: set[int] | None = None) -> int:
        """Move the session's free blocks no other session or claim uses, except ``keep``,
        to the head of the eviction order: a released (ended, abandoned) session is the
        cheapest thing to lose, and so is the rest of one whose next turn reads only the
        prefix a Pin or Retain with ``evict_rest_first`` protects."""
        if session_id is None:
            return 0
        handles = [h for h in map(self.cache.lookup, self.index.exclusive_blocks(session_id))
                   if h is not None and not self.holds.is_held(h.block_id)
                   and (keep is None or h.key not in keep)]
        return self.cache.evict_first(handles)

    # --- donor -------------------------------------------------------------------------------

    def _advise(self, advice: DonorAdvice, namespace: str) -> HintOutcome:
        def answer(status: OutcomeStatus, reason: str, requested: Amount = Amount(),
                   applied: Amount = Amount()) -> HintOutcome:
            advice_id = echoed_advice_id(advice.advice_id)
            return self._outcome(advice_id, advice_id, DONOR_ACTION_TYPE,
                                 status, reason, requested, applied)

        problem = advice.problem()
        if problem is not None:
            return answer(REJECTED, problem)
        if advice.namespace != namespace:
            return answer(REJECTED, f"namespace {quoted(advice.namespace)} is not this "
                                    f"worker's ({namespace!r})")
        keys = list(dict.fromkeys(advice.donor_block_hashes))
        requested = self._amount(len(keys))
        handles = [h for h in map(self.cache.lookup, keys) if h is not None]
        if not handles:
            return answer(MISSING, "no donor block is resident", requested)
        notes = []
        if len(handles) < len(keys):
            notes.append(f"{len(handles)} of {len(keys)} donor blocks resident")
        if self.config.donor_retain and (reason := unheld_reason(self.cache)):
            # As a Retain is (before: "N donor blocks retained", no hit kept).
            return answer(REJECTED, reason, requested)
        if self.config.donor_retain:
            # Under its own key: never a hint action's claim (nor a Prefetch's). What
            # clipped the retain (max_retain_ttl_s, the retain budget) is said, and the
            # TTL held is the one applied; before, both went unsaid and the reason named
            # the advice's ttl_s. The status stays residency's (schemas.advice).
            clips: list[str] = []
            retained = self._retain(DonorClaim(advice.advice_id),
                                    self.config.donor_retain_priority, advice.ttl_s,
                                    handles, clips, None, PLANNER)
            held_s = min(advice.ttl_s, self.config.max_retain_ttl_s)
            notes.append(f"{retained} donor blocks retained for {held_s:g}s")
            notes.extend(clips)
        status = CLIPPED if len(handles) < len(keys) else ACCEPTED
        return answer(status, "; ".join(notes), requested, self._amount(len(handles)))

    # --- outcomes ---------------------------------------------------------------------------

    def _amount(self, blocks: int) -> Amount:
        return Amount(blocks=blocks, tokens=blocks * self.cache.block_size)

    def _outcome(self, message_id: str, action_id: str, action_type: str,
                 status: OutcomeStatus, reason: str, requested: Amount = Amount(),
                 applied: Amount = Amount()) -> HintOutcome:
        return HintOutcome(message_id=message_id, action_id=action_id, action_type=action_type,
                           worker_id=self.worker_id, status=status, reason=reason,
                           requested=requested, applied=applied, at=self.clock())

    def _remember(self, key: tuple[str, str], outcome: HintOutcome) -> None:
        self.counters.count(outcome.action_type, outcome.status)
        if not key[1]:
            return
        self._memory[key] = outcome
        self._memory.move_to_end(key)
        while len(self._memory) > self.config.max_remembered_actions:
            self._memory.popitem(last=False)
            self.counters.remembered_forgotten += 1
