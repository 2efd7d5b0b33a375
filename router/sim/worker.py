"""One simulated vLLM worker: vLLM's real KVCacheManager + the plugin's real PluginCore.

Nothing of the cache is re-implemented here: admission is vLLM's ``get_computed_blocks``
+ ``allocate_slots`` (through :class:`kvhint.engine_plugin.headless.HeadlessCache`), the
plugin's adapter wraps the manager exactly as inside vLLM (event tee, retained blocks
released under pressure, hits observed), hints go to the plugin's executor, and the host
tier is vLLM's offloading bookkeeping (:mod:`.host_tier`). What this class adds is the
part vLLM's scheduler would do with time: one prefill at a time in FIFO order, decode
beside it, and KV held from admission until the response ends.

Approximations (the same for every policy): a request's decode tokens are allocated in
one step when its prefill ends; they are unique tokens, so they are never reused (trace
blocks name prompts only); when the pool cannot hold the next prompt, the queue waits for
a running request to finish or a hold to end (no preemption). A request is dropped only
when vLLM would refuse it (prompt plus output longer than the pool, max_model_len), or
when nothing can ever make room (nothing running, no hold with a finite end).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhint.engine_plugin.core import EngineIdentity, PluginCore
from kvhint.engine_plugin.headless import HeadlessCache, build_kv_cache_manager
from kvhint.router.sim.config import SimConfig
from kvhint.router.sim.host_tier import SimHostTier
from kvhint.router.sim.timing import TimeModel
from kvhint.router.sim.trace import TraceRequest

EventsFn = Callable[[str, list[Any], list[tuple[bool, list[int]]]], None]

# Decode tokens get ids outside the range trace blocks use (tokens_for_block_ids maps a
# block id to a token below 2**30).
DECODE_TOKEN = (1 << 30) + 1


@dataclass(slots=True)
class Job:
    """A request's life on its worker (times in virtual seconds)."""

    request: TraceRequest
    session_key: str
    vllm_request: Any
    block_hashes: tuple[int, ...]
    worker_id: str
    predicted_cached_tokens: int
    predicted_computed_tokens: int
    arrival_s: float
    start_s: float = 0.0
    first_token_s: float = 0.0
    g1_hit_tokens: int = 0
    g2_hit_tokens: int = 0
    computed_tokens: int = 0
    decode_allocated: bool = True
    # The scheduler engine's marks (vLLM decides when; see scheduler_worker).
    admitted: bool = False
    first_token_out: bool = False


@dataclass(slots=True)
class WorkerCounters:
    admitted: int = 0
    admission_waits: int = 0
    dropped_too_large: int = 0
    decode_alloc_failures: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0
    g1_hit_tokens: int = 0
    g2_hit_tokens: int = 0
    # The scheduler engine: running requests vLLM preempted to make room.
    preemptions: int = 0

    def admit(self, job: Job, now: float, g1_hit: int, g2_hit: int) -> None:
        """The job's prompt starts at ``now`` with these prefix hits: noted on the job
        and counted (both engines)."""
        prompt = job.request.input_length
        job.admitted = True
        job.start_s = now
        job.g1_hit_tokens = g1_hit
        job.g2_hit_tokens = g2_hit
        job.computed_tokens = prompt - g1_hit - g2_hit
        self.admitted += 1
        self.computed_tokens += job.computed_tokens
        self.prompt_tokens += prompt
        self.g1_hit_tokens += g1_hit
        self.g2_hit_tokens += g2_hit


class SimWorker:
    """See the module docstring. ``on_events(worker_id, vllm_events, host_events)``
    receives every KV event batch (the router's index is fed from it)."""

    def __init__(
        self,
        worker_id: str,
        cache: HeadlessCache,
        core: PluginCore,
        timing: TimeModel,
        host: SimHostTier | None,
        store_on_compute: bool,
        on_events: EventsFn,
    ) -> None:
        self.worker_id = worker_id
        self.cache = cache
        self.core = core
        self.timing = timing
        self.host = host
        self.store_on_compute = store_on_compute and host is not None
        self._on_events = on_events
        self.queue: deque[Job] = deque()
        self.prefilling: Job | None = None
        self.decoding: dict[str, Job] = {}
        self.counters = WorkerCounters()
        # Jobs dropped since the engine last took them (the router hears of their end).
        self.dropped: list[Job] = []
        # The headless manager is built with max_model_len = the whole pool.
        self.max_model_len = int(cache.manager.max_model_len)

    @property
    def active_requests(self) -> int:
        return len(self.queue) + len(self.decoding) + (1 if self.prefilling else 0)

    def make_request(self, prompt_token_ids: list[int], session_key: str,
                     output_tokens: int) -> Any:
        """The vLLM request for a prompt (its output is appended at the prefill's end)."""
        del output_tokens  # allocated in one step by finish_prefill, not by vLLM
        return self.cache.make_request(prompt_token_ids, session_id=session_key)

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)

    def start_prefill(self, now: float) -> tuple[Job, float] | None:
        """Admit the head of the queue if the prefill slot is free and its KV fits;
        returns the job and when its prefill ends."""
        if self.prefilling is not None or not self.queue:
            return None
        job = self.queue[0]
        if job.request.input_length + job.request.output_length > self.max_model_len:
            # vLLM refuses such a request outright (longer than max_model_len).
            self.queue.popleft()
            self._dropped(job)
            return self.start_prefill(now)
        hit = self.cache.admit(job.vllm_request)
        if hit is None:
            if not self.decoding and not self._holds_will_end():
                # Nothing will ever free: no running request, no hold with an end.
                self.queue.popleft()
                self._dropped(job)
                self._sync()
                return self.start_prefill(now)
            # Wait for a running request to end or a hold to expire (the engine retries
            # on each event: a response's end, the next hold deadline, a hint, a tick).
            self.counters.admission_waits += 1
            self._sync()
            return None
        self.queue.popleft()
        prompt = job.request.input_length
        block_size = self.cache.block_size
        host_tokens = 0
        g1_blocks = hit // block_size
        if self.host is not None:
            rest = job.block_hashes[g1_blocks:]
            found = self.host.prefix_blocks(rest)
            host_tokens = max(min(found * block_size, prompt - 1 - hit), 0)
            loaded = -(-host_tokens // block_size)
            self.host.load(rest[:loaded])
        computed = prompt - hit - host_tokens
        if self.store_on_compute:
            # vLLM's OffloadingConnector stores the newly computed full blocks.
            self.host.store(job.block_hashes[g1_blocks:])  # type: ignore[union-attr]
        self._sync()
        self.counters.admit(job, now, hit, host_tokens)
        self.prefilling = job
        return job, now + self.timing.prefill_s(computed, host_tokens)

    def _holds_will_end(self) -> bool:
        """Whether the plugin holds blocks it will let go of at a known time."""
        deadline = self.core.executor.next_deadline()
        return deadline is not None and math.isfinite(deadline)

    def _dropped(self, job: Job) -> None:
        self.counters.dropped_too_large += 1
        self.dropped.append(job)

    def finish_prefill(self, now: float) -> tuple[Job, float]:
        """The prefill ended: first token out; decode until the returned time."""
        job = self.prefilling
        assert job is not None, "finish_prefill without a prefill"
        self.prefilling = None
        job.first_token_s = now
        output = job.request.output_length
        if output > 0:
            request = job.vllm_request
            request.append_output_token_ids([DECODE_TOKEN] * output)
            allocated = self.cache.manager.allocate_slots(request, output)
            if allocated is None:
                job.decode_allocated = False
                self.counters.decode_alloc_failures += 1
            else:
                request.num_computed_tokens = request.num_tokens
            self._sync()
        self.decoding[job.vllm_request.request_id] = job
        return job, now + self.timing.decode_s(output)

    def finish(self, job: Job) -> None:
        """The response ended: vLLM frees the request's blocks (cached ones stay)."""
        del self.decoding[job.vllm_request.request_id]
        self.cache.finish(job.vllm_request)
        self._sync()

    def sync(self) -> None:
        """Drain events caused outside a request (hints, TTL expiry)."""
        self._sync()

    def _sync(self) -> None:
        events = self.cache.manager.take_events()  # the plugin's tee sees them first
        self.core.sync()
        host_events = self.host.take_events() if self.host is not None else []
        if events or host_events:
            self._on_events(self.worker_id, events, host_events)


def build_fast_worker(worker_id: str, config: SimConfig, clock: Callable[[], float],
                      on_events: EventsFn) -> SimWorker:
    """vLLM's KVCacheManager with the plugin attached as it attaches inside vLLM, on the
    simulation's clock."""
    cache = build_kv_cache_manager(config.block_size, config.gpu_blocks)
    host = (SimHostTier(config.host_blocks, config.host_cache_policy)
            if config.host_blocks > 0 else None)
    core = PluginCore.attach(cache.manager, config.plugin_config(worker_id), clock=clock,
                             identity=EngineIdentity(worker_id, model="sim"), host_tier=host)
    return SimWorker(worker_id, cache, core, config.timing, host, store_on_compute=True,
                     on_events=on_events)
