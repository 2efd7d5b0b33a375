"""One simulated vLLM worker that runs vLLM's real ``Scheduler``, step by step.

The ``fast`` engine (:mod:`.worker`) drives vLLM's KVCacheManager directly and schedules
by its own rule (one prefill at a time, decode beside it). This worker hands scheduling to
vLLM itself, as a server does: vLLM's ``Scheduler`` with the kvhint plugin loaded as its
KV connector (:func:`kvhint.engine_plugin.headless.build_scheduler`) decides each step
which requests run, how much of each prompt is prefilled (chunked prefill under
``max_num_batched_tokens``), which waiting requests are admitted and which running ones
are preempted when the pool runs out. With host blocks, vLLM's OffloadingConnector runs
beside the plugin in a MultiConnector, as on a CUDA server, and its stores and loads are
reported done at the step's end (``HeadlessScheduler``). Nothing of that is
re-implemented here; what this class adds is the model's time for each step
(:meth:`TimeModel.step_s`) and the bookkeeping the simulation reads (hits at admission,
first tokens, finished responses).

Protocol, per step: :meth:`begin_step` calls ``schedule()`` at the step's start and
returns its length; :meth:`end_step`, at its end, feeds vLLM a fabricated model output
(one sampled token per request whose prefill is done) through ``update_from_output``,
which frees finished requests. Requests and hints that arrive in between reach vLLM as
they would on a server: requests wait for the next ``schedule()``; hints apply at once.

Invariants: at most one step is in flight; a step that schedules nothing ends at once and
the worker waits for a :meth:`begin_step` from outside (an arrival, a hint, a tick), so an
engine stuck on pinned blocks does not spin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvhint.engine_plugin.headless import (
    MODEL_CONFIG,
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
)
from kvhint.router.sim.config import SimConfig
from kvhint.router.sim.timing import TimeModel
from kvhint.router.sim.worker import EventsFn, Job, WorkerCounters


@dataclass(slots=True)
class StepEnd:
    """What one step's end produced: jobs whose first token came out, jobs whose
    response ended (vLLM has freed their blocks)."""

    first_tokens: list[Job] = field(default_factory=list)
    finished: list[Job] = field(default_factory=list)


class _EventTee:
    """Stands in for vLLM's (null) KV event publisher: the scheduler publishes each step's
    KV events here and they go to the simulated router's index."""

    def __init__(self, forward: Callable[[list[Any]], None]) -> None:
        self._forward = forward

    def publish(self, batch: Any) -> None:
        self._forward(list(batch.events))

    def shutdown(self) -> None:
        return None


class SchedulerSimWorker:
    """See the module docstring. ``on_events(worker_id, vllm_events, host_events)``
    receives every KV event batch (the router's index is fed from it)."""

    def __init__(
        self,
        worker_id: str,
        engine: HeadlessScheduler,
        timing: TimeModel,
        max_model_len: int,
        on_events: EventsFn,
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.timing = timing
        self.max_model_len = max_model_len
        # Beside vLLM's OffloadingConnector (a host tier) it is one of a MultiConnector's.
        connectors = getattr(engine.connector, "sub_connectors", [engine.connector])
        kvhint = next(c for c in connectors if hasattr(c, "core"))
        core = kvhint.core
        assert core is not None, "the kvhint connector binds its core when vLLM builds it"
        self.core = core
        # vLLM's OffloadingConnector bookkeeping as the plugin finds it (None: no host tier).
        self.host = kvhint.host_tier
        self._on_events = on_events
        scheduler = engine.scheduler
        scheduler.kv_event_publisher = _EventTee(
            lambda events: on_events(worker_id, events, []) if events else None)
        self.block_size = int(engine.vllm_config.cache_config.block_size)
        self.jobs: dict[str, Job] = {}
        self.counters = WorkerCounters()
        # Jobs refused since the engine last took them (the router hears of their end).
        self.dropped: list[Job] = []
        self._in_step: Any = None  # the SchedulerOutput of the step in flight

    @property
    def active_requests(self) -> int:
        return len(self.jobs)

    def make_request(self, prompt_token_ids: list[int], session_key: str,
                     output_tokens: int) -> Any:
        """The vLLM request for a prompt; vLLM stops it after ``output_tokens`` (at least
        one, as the OpenAI server asks)."""
        return self.engine.make_request(prompt_token_ids, session_id=session_key,
                                        max_tokens=max(output_tokens, 1))

    def enqueue(self, job: Job) -> None:
        """Hand the request to vLLM's waiting queue, unless vLLM refuses it outright
        (prompt plus output longer than max_model_len): counted as dropped."""
        request = job.request
        if request.input_length + max(request.output_length, 1) > self.max_model_len:
            self.counters.dropped_too_large += 1
            self.dropped.append(job)
            return
        self.jobs[job.vllm_request.request_id] = job
        self.engine.add(job.vllm_request)

    def begin_step(self, now: float) -> tuple[float, list[Job]] | None:
        """Start a step if none is in flight and vLLM has work; returns its length and
        the jobs it admitted (their prefix hits are known now), or None."""
        if self._in_step is not None or not self.jobs:
            return None
        scheduler = self.engine.scheduler
        admitted: list[Job] = []
        retried = False
        prefill_tokens = host_tokens = 0
        while True:
            out = scheduler.schedule()
            self.counters.preemptions += len(out.preempted_req_ids)
            for request_id, tokens in out.num_scheduled_tokens.items():
                if tokens > 1:  # a prompt chunk (or a preempted request's recompute)
                    prefill_tokens += tokens
                job = self.jobs[request_id]
                if not job.admitted:
                    self._admit(job, now)
                    admitted.append(job)
                    host_tokens += job.g2_hit_tokens
            self._sync()
            if out.total_num_scheduled_tokens:
                break
            self.engine.complete(out)
            if not retried and scheduler.finished_recving_kv_req_ids:
                # A host load vLLM started in this schedule() finished at its end (the
                # loads are reported done at once): its request runs in the next step,
                # now, not at the simulation's next tick.
                retried = True
                continue
            # Nothing fits (holds or running requests fill the pool): wait for a kick.
            self.counters.admission_waits += 1
            return None
        self._in_step = out
        return self.timing.step_s(prefill_tokens, host_tokens), admitted

    def _admit(self, job: Job, now: float) -> None:
        # What vLLM reports as the response's cached tokens, set at the request's first
        # schedule(): local prefix hits, and external ones the OffloadingConnector loads
        # from the host tier (the kvhint connector loads nothing). vLLM keeps
        # prefill_stats only with log_stats on (build_scheduler's default).
        stats = job.vllm_request.prefill_stats
        self.counters.admit(job, now, int(stats.num_local_cached_tokens),
                            int(stats.num_external_cached_tokens))

    def end_step(self, now: float) -> StepEnd:
        """The step in flight ends at ``now``: its tokens come out."""
        out, self._in_step = self._in_step, None
        assert out is not None, "end_step without a step in flight"
        engine_outputs = self.engine.complete(out)
        ended = StepEnd()
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                job = self.jobs.get(output.request_id)
                if job is None:
                    continue
                if output.new_token_ids and not job.first_token_out:
                    job.first_token_out = True
                    job.first_token_s = now
                    ended.first_tokens.append(job)
                if output.finish_reason is not None:
                    del self.jobs[output.request_id]
                    ended.finished.append(job)
        self._sync()
        return ended

    def sync(self) -> None:
        """Drain events caused outside a step (hints, TTL expiry)."""
        self._sync()

    def _sync(self) -> None:
        events = self.engine.kv_cache_manager.take_events()  # the plugin's tee sees them
        self.core.sync()
        if events:
            self._on_events(self.worker_id, events, [])


def build_scheduler_worker(worker_id: str, config: SimConfig, clock: Callable[[], float],
                           on_events: EventsFn) -> SchedulerSimWorker:
    """vLLM's Scheduler with the plugin loaded as a server loads it (its connector,
    validating the same extra config), on the simulation's clock."""
    # The whole pool, as the fast engine's manager; vLLM caps it at the model's positions.
    # A sliding-window group shares the pool (SimConfig.window_blocks; SimConfig
    # refuses a pool it would leave no block of).
    max_model_len = min((config.gpu_blocks - config.window_blocks()) * config.block_size,
                        int(MODEL_CONFIG["max_position_embeddings"]))
    engine = build_scheduler(HeadlessSchedulerSpec(
        block_size=config.block_size, num_blocks=config.gpu_blocks + 1,
        max_model_len=max_model_len, max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": worker_id, **config.plugin},
        host_blocks=config.host_blocks, sliding_window=config.sliding_window))
    worker = SchedulerSimWorker(worker_id, engine, config.timing, max_model_len, on_events)
    worker.core.use_clock(clock)
    return worker
