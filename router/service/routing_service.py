"""Routing glue: build the policy's frozen context from in-memory state and call
:func:`kvhint.router.policy.route`. No I/O here: hashing is CPU work on the request's own
body, the index and the load bookkeeping are in memory.

Hashing a long prompt is tens of milliseconds of tokenizer work (63k tokens: ~45 ms); on
the event loop it would stall every other request's stream for that long. A prompt
estimated at ``hash_thread_min_tokens`` or more, or whose body is over
``hash_inline_max_bytes`` (text in fields the estimate does not count, or a million empty
messages, renders to many tokens: a body has about as many bytes as its prompt has tokens,
or more), is hashed on ``hash_executor`` (the runtime's hashing threads, fair across
tenants: ``hash_queue.py``; the Rust tokenizer releases the GIL while it encodes, see
``PromptRenderer._encode``, and ``RequestHasher`` is thread-safe); shorter ones inline,
where a thread hop would cost more than it saves. A prompt surely longer than
``max_prompt_tokens`` (the workers refuse it) is not hashed at all: routed without
hashes, counted. The index, the loads and ``route()``
stay on the loop.

Load bookkeeping the policy needs (per worker): requests in flight, uncached prompt tokens
routed there whose first byte has not come back (``pending_prefill_tokens``), and a
time-decayed sum of uncached prompt tokens routed there (``recent_prefill_tokens``). A
Responses follow-up's prompt is mostly the conversation its worker prepends
(:class:`HeldConversation`): it books that, less what the worker likely still caches.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from kvhint.router.hashing import HashConfig, HashingError, PromptHashes, RequestHasher
from kvhint.router.kv_index.protocol import ClusterKvIndex
from kvhint.router.policy import (
    Overlap,
    RouteDecision,
    RouteRequest,
    WorkerScore,
    cached_tokens,
    RoutingConfig,
    RoutingContext,
    SessionPlacement,
    SessionPlanState,
    WorkerLoad,
    route,
)
from kvhint.router.policy.routed_load import RoutedLoads
from kvhint.router.service.hash_queue import FairHashQueue, TenantQueueFull
from kvhint.router.service.inbound import Endpoint, InboundRequest
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.sampling import prompt_batch
from kvhint.router.service.settings_sections import RoutingSettings
from kvhint.router.service.workers import WorkerRegistry, WorkerState

RECENT_HALF_LIFE_S = 120.0
# Rough tokens-per-character when the prompt cannot be tokenized (unknown model).
log = logging.getLogger(__name__)
_CHARS_PER_TOKEN = 4
# A prompt has at least one token per this many body bytes (JSON-escaped text runs about
# 3-6 bytes a token): a body over ``max_prompt_tokens`` times this is surely too long.
_MAX_BYTES_PER_TOKEN = 8
_json_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class HeldConversation:
    """What the router knows of the conversation a request continues in a worker's
    memory, which its body does not carry: a Responses follow-up by
    ``previous_response_id`` (vLLM prepends the stored turns), from the usage of the
    response it follows (responses_api.py :func:`follow_up_of`)."""

    worker_id: str  # the worker holding the stored turns
    tokens: int  # the conversation so far, about as the follow-up's prompt renders it
    # Of those, what that worker likely still holds in its prefix cache (the previous
    # prompt): an estimate, never a prediction (:attr:`RoutePlan.held_tokens`).
    held: int


def conversation_of_session(session: SessionPlanState, worker_id: str
                            ) -> HeldConversation | None:
    """A follow-up's conversation on ``worker_id`` as its session's planner state last
    saw it, for a response whose usage this replica never kept (another replica relayed
    it, or it was forgotten past ``responses.max_ids``): the last turn's prompt, as its
    worker's usage counted it (``ResponseFinished``), for the conversation and its held
    part alike (its completion is known only with its reasoning, which vLLM does not
    render again: left out). None unless the session's last turn went to ``worker_id``
    and was answered with usage (none since routed: ``gap_opened_at``, which a routed
    turn clears; a background response, a failure or a turn still in flight leave it
    cleared, and ``prompt_tokens`` then the router's own estimate). An estimate, booked
    as load only, like :func:`responses_api.follow_up_of`'s."""
    if (session.worker_id != worker_id or session.gap_opened_at is None
            or session.prompt_tokens <= 0):
        return None
    return HeldConversation(worker_id, session.prompt_tokens, session.prompt_tokens)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The decision plus what the rest of the request needs from routing."""

    decision: RouteDecision
    prompt_tokens: int
    block_hashes: tuple[int, ...]
    # How the prompt was (or would be) hashed: the block size, algorithm and seed of the
    # first live candidate heard (``_hash_config``); a worker hashing otherwise cannot
    # hold these hashes.
    hash_config: HashConfig
    exact: bool  # prompt_tokens/block_hashes come from the real tokenizer
    # Only one worker could take it: decided without hashing; complete() hashes later.
    deferred: bool = False
    # Unhashed, continuing a conversation ``held_by`` holds (HeldConversation): the
    # tokens of the prompt it likely has cached, counted off the load booked on it only.
    # Not a prediction: not in the decision's scores, so never checked against the
    # worker's answer, reported, or learnt from (forwarding.py ``_took``).
    held_tokens: int = 0
    held_by: str | None = None
    # A /v1/completions batch's prompts after its first (vLLM runs each as a request of
    # its own, on the same worker): their tokens, estimated without hashing
    # (:func:`batch_rest_tokens`). The batch is routed, predicted and planned by its
    # first prompt (``prompt_tokens``, ``block_hashes``); these are booked with it as
    # load on the chosen worker, all uncached (:meth:`uncached_on`,
    # :attr:`booked_tokens`).
    batch_rest_tokens: int = 0

    @property
    def block_size(self) -> int:
        return self.hash_config.block_size

    @property
    def booked_tokens(self) -> int:
        """The prompt tokens the request brings its worker: a batch's every prompt."""
        return self.prompt_tokens + self.batch_rest_tokens

    def uncached_on(self, worker_id: str) -> int:
        """Prompt tokens ``worker_id`` has to prefill, as its routed load books them: the
        prompt less the cached tokens predicted there, or likely held there, plus a
        batch's other prompts whole (none is predicted: an upper bound where they share
        a prefix, which vLLM caches once the first is in)."""
        held = self.held_tokens if worker_id == self.held_by else 0
        return (max(self.prompt_tokens - max(self.predicted_for(worker_id), held), 0)
                + self.batch_rest_tokens)

    def predicted_for(self, worker_id: str) -> int:
        """Cached tokens the decision predicted on ``worker_id``."""
        for score in self.decision.scores:
            if score.worker_id == worker_id:
                return score.cached_tokens
        return 0


@dataclass(slots=True)
class RoutingService:
    workers: WorkerRegistry
    metrics: RouterMetrics
    config: RoutingConfig
    hasher: RequestHasher | None
    default_block_size: int
    index: ClusterKvIndex | None = None
    seed: int = 0
    clock: Callable[[], float] = time.monotonic
    default_model: str | None = None
    # Long prompts are hashed here, off the event loop, in their tenant's own queue
    # (hash_queue.py); None: always inline. Only a FairHashQueue: it is what the runtime
    # runs, so tests and benchmarks measure that, not a FIFO executor of their own.
    hash_executor: FairHashQueue | None = None
    hash_thread_min_tokens: int = RoutingSettings.model_fields["hash_thread_min_tokens"].default
    hash_inline_max_bytes: int = RoutingSettings.model_fields["hash_inline_max_bytes"].default
    max_prompt_tokens: int = RoutingSettings.model_fields["max_prompt_tokens"].default
    _rng: random.Random = field(init=False)
    # The load figures route() sees, from what was routed (policy/routed_load.py: the
    # simulator keeps the same).
    _loads: RoutedLoads = field(default_factory=lambda: RoutedLoads(RECENT_HALF_LIFE_S))
    _seq: int = 0

    def __post_init__(self) -> None:
        if self.hash_executor is not None and not isinstance(self.hash_executor,
                                                             FairHashQueue):
            # Its submit takes the tenant first: any other executor would fail every
            # long prompt's hashing (routed unhashed) instead of refusing here.
            raise TypeError("RoutingService.hash_executor must be a FairHashQueue, not "
                            f"{type(self.hash_executor).__name__}")
        self._rng = random.Random(self.seed)

    # --- the decision -------------------------------------------------------------------

    async def plan(self, inbound: InboundRequest, session_worker: str | None,
                   session_turns: int, exclude: frozenset[str] = frozenset(),
                   earlier: RoutePlan | None = None,
                   conversation: HeldConversation | None = None) -> RoutePlan:
        """Rank the routable workers that serve ``inbound``'s model; raises
        ``NoWorkerAvailable``. ``exclude``: workers a failed attempt already tried.
        ``earlier``: this request's plan from a failed attempt; its prompt hashes, when
        exact, are reused rather than computed again. ``conversation``: what its prompt
        carries that its body does not (:func:`_with_conversation`)."""
        retry = bool(exclude)
        exclude = exclude | self.workers.not_serving(inbound.model or self.default_model)
        candidates = [w for w in self.workers.routable() if w.worker_id not in exclude]
        if len(candidates) == 1 and not retry:
            only = candidates[0].worker_id
            decision = RouteDecision(worker_id=only, fallbacks=(), predicted_cached_tokens=0,
                                     predicted_host_tokens=0, reason="only_worker")
            return _with_conversation(
                RoutePlan(decision, _estimate_tokens(inbound), (),
                          self._hash_config(candidates), exact=False, deferred=True,
                          batch_rest_tokens=batch_rest_tokens(inbound)),
                inbound, conversation)
        config = self._hash_config(candidates)
        if earlier is not None and earlier.exact:
            block_hashes, prompt_tokens = earlier.block_hashes, earlier.prompt_tokens
            config, exact = earlier.hash_config, True
        elif (hashes := await self._hash(inbound, config)) is not None:
            block_hashes, prompt_tokens = hashes.block_hashes, hashes.num_tokens
            config, exact = replace(config, block_size=hashes.block_size), True
        else:  # not tokenizable here: routed on an estimate, without cache overlap
            block_hashes, prompt_tokens = (), _estimate_tokens(inbound)
            exact = False
        block_size = config.block_size
        started = time.perf_counter()
        now = self.clock()
        overlaps: dict[str, Overlap] = {}
        if block_hashes and self.index is not None:
            match = self.index.match_prefix(block_hashes)
            overlaps = {w: Overlap(o.gpu_blocks, o.external_blocks)
                        for w, o in match.workers.items()}
        loads = tuple(self._worker_load(w, now, exclude) for w in self.workers.all()
                      if w.url is not None)
        placement = (SessionPlacement(session_worker, session_turns)
                     if session_worker is not None or session_turns else None)
        self._seq += 1
        decision = route(
            RoutingContext(workers=loads, config=self.config, session=placement, now=now),
            RouteRequest(prompt_tokens=prompt_tokens, block_size=block_size,
                         session_key=inbound.worker_session_id, request_seq=self._seq,
                         overlaps=overlaps),
            self._rng,
        )
        self.metrics.decision.observe(time.perf_counter() - started)
        if inbound.worker_session_id is not None and placement is None:
            # A new session's first turn: counted where it lands (new_session_spread).
            self._loads.session_placed(decision.worker_id, now)
        plan = RoutePlan(decision, prompt_tokens, block_hashes, config, exact,
                         batch_rest_tokens=batch_rest_tokens(inbound))
        return plan if exact else _with_conversation(plan, inbound, conversation)

    async def complete(self, plan: RoutePlan, inbound: InboundRequest) -> RoutePlan:
        """Fill a deferred plan's prompt hashes and its worker's predicted overlap."""
        chosen = self.workers.get(plan.decision.worker_id)
        config = self._hash_config([chosen] if chosen is not None else [])
        hashes = await self._hash(inbound, config)
        if hashes is None:
            return replace(plan, deferred=False)
        worker_id = plan.decision.worker_id
        cached = host = 0
        if self.index is not None and hashes.block_hashes:
            overlap = self.index.match_prefix(hashes.block_hashes).of(worker_id)
            cached, host = cached_tokens(Overlap(overlap.gpu_blocks, overlap.external_blocks),
                                         hashes.num_tokens, hashes.block_size)
        score = WorkerScore(worker_id, 0.0, cached, host)
        decision = replace(plan.decision, predicted_cached_tokens=cached,
                           predicted_host_tokens=host, scores=(score,))
        return RoutePlan(decision, hashes.num_tokens, hashes.block_hashes,
                         replace(config, block_size=hashes.block_size), exact=True,
                         batch_rest_tokens=plan.batch_rest_tokens)

    async def _hash(self, inbound: InboundRequest, config: HashConfig) -> PromptHashes | None:
        hasher = self.hasher
        if hasher is None:
            return None
        body: dict[str, Any] = inbound.body
        if "model" not in body and self.default_model is not None:
            body = {**body, "model": self.default_model}
        if self._surely_too_long(inbound):
            self.metrics.drop("prompt_hashing:over_max_length")
            return None
        started = time.perf_counter()
        try:
            queue = self.hash_executor
            if queue is not None and not self.hash_inline(inbound):
                # In the tenant's own queue: another tenant's burst delays it by about
                # one job, not the burst (hash_queue.py).
                hashes = await asyncio.wrap_future(queue.submit(
                    inbound.tenant.name, _hash_body, hasher, inbound.endpoint, body, config))
            else:
                hashes = _hash_body(hasher, inbound.endpoint, body, config)
        except TenantQueueFull:
            # Over hash_queue_per_tenant waiting: routed without hashes, like a prompt
            # over the max length, rather than a backlog without bound.
            self.metrics.drop("prompt_hashing:tenant_queue_full")
            return None
        except HashingError as exc:
            self.metrics.drop(f"prompt_hashing:{type(exc).__name__}")
            return None
        except Exception:  # noqa: BLE001 - a body the hasher trips on is still routed
            log.exception("prompt hashing failed; routing without prefix hashes")
            self.metrics.drop("prompt_hashing:internal_error")
            return None
        self.metrics.hashing.observe(time.perf_counter() - started)
        if hashes is not None and hashes.num_tokens > self.max_prompt_tokens:
            self.metrics.drop("prompt_hashing:over_max_length")
            return None
        return hashes

    def hash_inline(self, inbound: InboundRequest) -> bool:
        """Whether ``inbound`` is short enough to hash on the event loop: a small body
        (bytes bound its tokens whatever its shape) whose estimate is under the threshold."""
        return (inbound.raw_size <= self.hash_inline_max_bytes
                and _estimate_tokens(inbound) < self.hash_thread_min_tokens)

    def _surely_too_long(self, inbound: InboundRequest) -> bool:
        """Longer than the workers take whatever the tokenizer says: not worth hashing."""
        limit = self.max_prompt_tokens
        if inbound.raw_size > limit * _MAX_BYTES_PER_TOKEN:
            return True
        messages = inbound.messages
        return isinstance(messages, list) and len(messages) > limit  # >= 1 token each

    def _hash_config(self, candidates: Sequence[WorkerState]) -> HashConfig:
        """How the workers that may take the request hash blocks (block size, seed):
        a worker of another model may use others."""
        for worker in (*candidates, *self.workers.all()):
            if worker.status is not None and worker.plugin_alive:
                return HashConfig.from_status(worker.status)
        return HashConfig(block_size=self.default_block_size)

    def _worker_load(self, worker: WorkerState, now: float, exclude: frozenset[str]) -> WorkerLoad:
        return self._loads.worker_load(
            worker.worker_id, now,
            healthy=worker.routable and worker.worker_id not in exclude,
            active_requests=worker.inflight)

    # --- bookkeeping the proxy reports --------------------------------------------------

    def dispatched(self, worker_id: str, uncached_tokens: int, prompt_tokens: int,
                   block_size: int) -> None:
        """A request with ``uncached_tokens`` to prefill went to ``worker_id``."""
        self._loads.dispatched(worker_id, self.clock(), uncached_tokens, prompt_tokens,
                               block_size)

    def forget_worker(self, worker_id: str) -> None:
        """A worker gone for good (the registry forgot it): its load figures go too."""
        self._loads.forget(worker_id)

    def first_byte(self, worker_id: str, uncached_tokens: int) -> None:
        self._loads.first_token(worker_id, uncached_tokens)

    def finished(self, worker_id: str, prompt_tokens: int, block_size: int,
                 prefill_pending: int) -> None:
        self._loads.finished(worker_id, prompt_tokens, block_size, prefill_pending)


def _hash_body(hasher: RequestHasher, endpoint: Endpoint, body: Mapping[str, Any],
               config: HashConfig) -> PromptHashes | None:
    """The prompt's hashes (runs on the hashing thread for long prompts: no service state
    here); a completions batch is routed as one request by its first prompt, the only
    one hashed (its others are booked by :func:`batch_rest_tokens`: before, every
    prompt was tokenized and hashed and all but the first thrown away)."""
    if endpoint is Endpoint.CHAT:
        return hasher.hash_chat(body, config)
    if endpoint is Endpoint.RESPONSES:
        return hasher.hash_responses(body, config)
    prompts = hasher.hash_completion(body, config, first_only=True)
    return prompts[0] if prompts else None


def _one_prompt_tokens(prompt: Any) -> int:
    """About how many tokens one completions prompt is: a token-id list's length, a
    string's characters over :data:`_CHARS_PER_TOKEN` (at least 1)."""
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return len(prompt)
    return max(_field_chars(prompt) // _CHARS_PER_TOKEN, 1)


def batch_rest_tokens(inbound: InboundRequest) -> int:
    """The tokens of a ``/v1/completions`` batch's prompts after its first, without
    tokenizing them (:attr:`RoutePlan.batch_rest_tokens`): each token-id prompt's
    length, each string's characters / 4; 0 for one prompt or another endpoint."""
    batch = prompt_batch(inbound.prompt)
    return sum(map(_one_prompt_tokens, batch[1:])) if batch is not None else 0


def _with_conversation(plan: RoutePlan, inbound: InboundRequest,
                       conversation: HeldConversation | None) -> RoutePlan:
    """An unhashed ``plan`` whose prompt starts with ``conversation``: its prompt tokens
    are the conversation's plus the new input's (the body's instructions and tools are
    the conversation's own again, counted in its prompt: vLLM renders this request's in
    place of the previous one's), its held tokens the conversation's held part (whole
    blocks: vLLM caches no partial one) on the worker holding it. Never fewer prompt
    tokens than the body alone estimates (a follow-up sending more tools than before)."""
    if conversation is None:
        return plan
    prompt_tokens = max(plan.prompt_tokens,
                        conversation.tokens + _estimate_chars(inbound.body.get("input")))
    block = max(plan.block_size, 1)
    held = min(conversation.held, prompt_tokens) // block * block
    return replace(plan, prompt_tokens=prompt_tokens, held_tokens=held,
                   held_by=conversation.worker_id)


def _estimate_chars(value: Any) -> int:
    """About how many tokens one body field renders to (0: absent)."""
    return max(_field_chars(value) // _CHARS_PER_TOKEN, 1) if value else 0


def _field_chars(value: Any) -> int:
    """The characters one body field (text, or anything as JSON) brings: 0 when absent."""
    if not value:
        return 0
    return len(value) if isinstance(value, str) else len(_json_encode(value))


def _estimate_tokens(inbound: InboundRequest) -> int:
    """About how many tokens the prompt renders to: what decides where it is hashed.
    A chat counts its tool schemas, documents and earlier tool calls as well as its
    messages' text: agent frameworks send tens of thousands of tokens of tools with a
    short message."""
    if inbound.endpoint is Endpoint.CHAT:
        body = inbound.body
        chars = 0
        for message in inbound.messages or ():
            chars += len(str(message.get("content") or ""))
            chars += len(str(message.get("role") or ""))
            if message.get("tool_calls"):
                chars += len(_json_encode(message["tool_calls"]))
        for key in ("tools", "documents"):
            if body.get(key):
                chars += len(_json_encode(body[key]))
    elif inbound.endpoint is Endpoint.RESPONSES:
        body = inbound.body
        chars = sum(_field_chars(body.get(key)) for key in ("instructions", "input", "tools"))
    else:
        prompt = inbound.prompt
        if (batch := prompt_batch(prompt)) is not None:
            # Its first prompt: what is hashed (the others are batch_rest_tokens).
            return _one_prompt_tokens(batch[0])
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        chars = len(str(prompt))
    return max(chars // _CHARS_PER_TOKEN, 1)
