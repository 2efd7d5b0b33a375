"""vLLM's real scheduler-side objects on the CPU, without a model (tests and simulator).

Two builders:
- :func:`build_kv_cache_manager`: vLLM's own ``KVCacheManager``/``BlockPool`` with prefix
  caching and KV events on, nothing else (no VllmConfig, no Scheduler): fast enough to
  replay hour-long traces. :class:`HeadlessCache` drives it the way the scheduler does
  (``get_computed_blocks`` + ``allocate_slots`` + ``free``).
- :func:`build_scheduler`: vLLM's real ``Scheduler`` (and its manager) from a
  ``config.json``-only model folder (``skip_tokenizer_init``, ``HF_HUB_OFFLINE``,
  ``DeviceConfig("cpu")``, events on with the ``null`` publisher), optionally with a KV
  connector loaded by module path; :class:`HeadlessScheduler` steps it with fabricated
  model outputs (one sampled token per request that finished its prefill).

This module constructs vLLM objects for tests and the simulator only; the plugin that runs
inside vLLM touches vLLM internals only in :mod:`kvhint.engine_plugin.vllm_adapter`.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvhint.engine_plugin.config import KV_ROLE

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A Llama shape the CPU backend accepts (head_dim 64); only config.json is written.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_NUM_LAYERS, _NUM_KV_HEADS, _HEAD_DIM = 2, 4, 64


def config_only_model_dir(root: Path | None = None) -> Path:
    """A folder holding just ``config.json`` (enough for vLLM's ModelConfig)."""
    root = root or Path(os.environ.get("KVHINT_HEADLESS_DIR",
                                       Path(tempfile.gettempdir()) / "kvhint-headless"))
    model_dir = root / "config-only-llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.json"
    text = json.dumps(MODEL_CONFIG, indent=1, sort_keys=True)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return model_dir


def tokens_for_block_ids(block_ids: Sequence[int], block_size: int,
                         vocab_size: int = 1 << 30) -> list[int]:
    """Token ids whose vLLM block hashes chain like ``block_ids`` (e.g. Mooncake
    ``hash_ids``): block i is ``block_size`` copies of a token derived from its id, and
    vLLM's hash already chains over the parent, so equal id prefixes give equal hash
    prefixes and different ids give different hashes."""
    out: list[int] = []
    for block_id in block_ids:
        out.extend([block_id % vocab_size] * block_size)
    return out


def _request_factory(block_hasher: Callable[[Any], Any]) -> Callable[..., Any]:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    counter = itertools.count(1)

    def make_request(prompt_token_ids: Sequence[int], *, session_id: str | None = None,
                     request_id: str | None = None, max_tokens: int = 1,
                     extra_args: Mapping[str, Any] | None = None) -> Any:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                extra_args=dict(extra_args) if extra_args else None)
        return Request(request_id=request_id or f"req-{next(counter)}",
                       prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                       pooling_params=None, block_hasher=block_hasher, session_id=session_id)

    return make_request


def _block_hasher(block_size: int, hash_algo: str = "sha256") -> Callable[[Any], Any]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)  # before any Request computes block hashes
    return get_request_block_hasher(block_size, hash_fn)


def _full_attention_spec(block_size: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=_NUM_KV_HEADS,
                             head_size=_HEAD_DIM, dtype=torch.float32)


def _mamba_spec(block_size: int, mode: str) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block_size, shapes=((_NUM_KV_HEADS, _HEAD_DIM),),
                     dtypes=(torch.float32,), mamba_cache_mode=mode,
                     page_size_padded=_full_attention_spec(block_size).page_size_bytes)


def _sliding_window_spec(block_size: int, window: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=block_size, num_kv_heads=_NUM_KV_HEADS,
                             head_size=_HEAD_DIM, dtype=torch.float32, sliding_window=window)


# --- the manager alone ------------------------------------------------------------------------

@dataclass
class HeadlessCache:
    """vLLM's KVCacheManager driven directly, the way the scheduler drives it."""

    manager: Any
    block_size: int
    make_request: Callable[..., Any]

    @property
    def block_pool(self) -> Any:
        return self.manager.block_pool

    @property
    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def lookup_hit_tokens(self, request: Any) -> int:
        """Tokens of the request's prompt found in the prefix cache (no side effects)."""
        _, num_tokens, _ = self.manager.get_computed_blocks(request)
        return num_tokens

    def admit(self, request: Any) -> int | None:
        """Allocate and cache the whole prompt; returns the prefix-hit tokens, or None
        when it does not fit (nothing changes then)."""
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, request.num_tokens - num_hit,
                                          num_new_computed_tokens=num_hit,
                                          new_computed_blocks=blocks)
        if new is None:
            return None
        request.num_computed_tokens = request.num_tokens
        return num_hit

    def append_tokens(self, request: Any, token_ids: Sequence[int]) -> bool:
        """Decode: append output tokens, allocate and cache their blocks."""
        ok = True
        for token in token_ids:
            request.append_output_token_ids(token)
            if self.manager.allocate_slots(request, 1) is None:
                ok = False
                break
            request.num_computed_tokens = request.num_tokens
        return ok

    def finish(self, request: Any) -> None:
        self.manager.free(request)


def build_kv_cache_manager(block_size: int = 512, num_blocks: int = 5_000, *,
                           max_model_len: int | None = None, hash_algo: str = "sha256",
                           enable_events: bool = True, watermark: float = 0.0
                           ) -> HeadlessCache:
    """vLLM's real KVCacheManager + BlockPool (prefix caching on). ``num_blocks`` usable
    blocks (vLLM adds its null block); ``watermark``: vLLM's ``--watermark``, the share
    of the blocks it keeps free when admitting a waiting request."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    spec = _full_attention_spec(block_size)
    total = num_blocks + 1  # block 0 is vLLM's null block
    config = KVCacheConfig(
        num_blocks=total, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"
                                           for i in range(_NUM_LAYERS)], spec)])
    config.hash_block_size = block_size
    manager = KVCacheManager(
        kv_cache_config=config,
        max_model_len=max_model_len or num_blocks * block_size,
        scheduler_block_size=block_size, hash_block_size=block_size,
        enable_caching=True, log_stats=False, enable_kv_cache_events=enable_events,
        watermark=watermark)
    return HeadlessCache(manager, block_size, _request_factory(_block_hasher(block_size,
                                                                            hash_algo)))


# --- the scheduler ----------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadlessSchedulerSpec:
    block_size: int = 32
    num_blocks: int = 64  # including vLLM's null block, as --num-gpu-blocks-override
    max_model_len: int | None = None  # default: what the cache can hold, at most 8192
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    connector_module: str | None = None  # e.g. "kvhint.engine_plugin.connector"
    connector_class: str = "KvHintConnector"
    connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_role: str = KV_ROLE  # the named connector's (the MultiConnector's is kv_both)
    # > 0: run vLLM's OffloadingConnector (CPU host tier of this many blocks) beside the
    # named connector in a MultiConnector, the way a CUDA server is configured for Demote.
    host_blocks: int = 0
    log_stats: bool = True
    # True: vLLM's AsyncScheduler with async scheduling on, as a CUDA server runs by
    # default (the CPU platform turns it off while validating the config: set again here).
    async_scheduling: bool = False
    # > 0: a prefill gets at most this many tokens a step while others wait (chunked).
    long_prefill_token_threshold: int = 0
    model_dir: Path | None = None
    # False: as ``--no-enable-prefix-caching`` (nothing cached: what the plugin does then).
    enable_prefix_caching: bool = True
    # > 0: layer 0 attends a sliding window of this many tokens beside the full-attention
    # layer (a hybrid model, gpt-oss's 1:1 pattern: two KV cache groups).
    sliding_window: int = 0
    # vLLM's --prefix-cache-retention-interval (its default 0: a sliding-window group
    # caches only the window before each prompt's end; None: every block).
    prefix_cache_retention_interval: int | None = 0
    # True: layer 0 is a Mamba layer beside the full-attention one (Jamba's, Granite 4's
    # kind: two KV cache groups), in vLLM's "align" cache mode as vLLM sets it with
    # prefix caching on: the state's block size is attention's, its page padded to it.
    mamba: bool = False


@dataclass
class HeadlessScheduler:
    scheduler: Any
    vllm_config: Any
    make_request: Callable[..., Any]
    steps: int = 0
    # With a host tier: whether this step's offload jobs are reported done at once
    # (False leaves them in flight until it is set again).
    complete_offloads: bool = True
    _offloads_in_flight: list[Any] = field(default_factory=list)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def kv_cache_manager(self) -> Any:
        return self.scheduler.kv_cache_manager

    @property
    def block_pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    def add(self, request: Any) -> Any:
        self.scheduler.add_request(request)
        return request

    def step(self, after_schedule: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
        """One schedule() + update_from_output() with a fabricated model output;
        ``after_schedule(scheduler_output)`` runs in between (e.g. to read a request's
        ``prefill_stats``, which vLLM clears when the request finishes)."""
        out = self.scheduler.schedule()
        if after_schedule is not None:
            after_schedule(out)
        return out, self.complete(out)

    def complete(self, out: Any) -> Any:
        """The model's answer to ``out`` (one :meth:`Scheduler.schedule` result), fed to
        ``update_from_output``; returns its engine outputs. Split from :meth:`step` for a
        caller whose model time passes between the two (the simulator)."""
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = scheduler.requests.get(req_id)
            if req is None:  # finished (aborted) while the step was in flight
                sampled.append([])
                continue
            # After schedule(), num_computed_tokens includes this step's tokens; a
            # partial prefill chunk samples nothing, as in the real model runner.
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([7 + len(req.output_token_ids) % 100] if done else [])
        output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            # A real runner with a connector always attaches one; without it the
            # scheduler never calls connector.update_connector_output().
            kv_connector_output=self._offload_report(out.kv_connector_metadata))
        engine_outputs = scheduler.update_from_output(out, output)
        self.steps += 1
        return engine_outputs

    def _offload_report(self, metadata: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        self._offloads_in_flight.append(metadata)
        if not self.complete_offloads:
            return KVConnectorOutput()
        done = _offload_jobs_done(self._offloads_in_flight)
        self._offloads_in_flight.clear()
        return done

    def run_until_done(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_requests() and steps < max_steps:
            self.step()
            steps += 1
        return steps

    def run(self, request: Any) -> Any:
        """Add one request and step until the scheduler is idle; returns the request."""
        self.add(request)
        self.run_until_done()
        return request


def _mamba_cache_args(spec: HeadlessSchedulerSpec) -> dict[str, Any]:
    """What vLLM's MambaModelConfig sets for a Mamba model: "align" with prefix caching
    (the state cached at block boundaries, the block size attention's), else "none"."""
    if not spec.mamba:
        return {}
    if spec.enable_prefix_caching:
        return {"mamba_cache_mode": "align", "mamba_block_size": spec.block_size}
    return {"mamba_cache_mode": "none"}


def _offload_jobs_done(metadatas: Sequence[Any]) -> Any:
    """The worker's report for these steps' OffloadingConnector jobs: every store and load
    done (the host link keeps up, as the simulator models it).

    A stand-in, because vLLM's offloading worker copies with CUDA streams and does not run
    on the CPU backend (``CPUOffloadingSpec.get_worker`` raises); the scheduler-side
    bookkeeping it reports to is vLLM's own."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorMetadata,
        MultiKVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    multi = [m for m in metadatas if isinstance(m, MultiKVConnectorMetadata)]
    if not multi:
        return KVConnectorOutput()
    reports: list[Any] = [None] * len(multi[0].metadata)
    loaded: set[str] = set()
    for metadata in multi:
        for i, part in enumerate(metadata.metadata):
            if not isinstance(part, OffloadingConnectorMetadata):
                continue
            done = reports[i] = reports[i] or OffloadingWorkerMetadata()
            for job_id in (*part.store_jobs, *part.load_jobs):
                done.mark_completed(job_id)
            loaded.update(job.req_id for job in part.load_jobs.values())
    # A request waiting for a load is released by the worker's finished_recving.
    return KVConnectorOutput(
        finished_recving=loaded or None,
        kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(metadata=tuple(reports)))


def build_scheduler(spec: HeadlessSchedulerSpec = HeadlessSchedulerSpec()) -> HeadlessScheduler:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = str(spec.model_dir or config_only_model_dir())
    # The cache must hold one max_model_len request: (num_blocks - 1) * block_size.
    max_model_len = spec.max_model_len or min(8192, (spec.num_blocks - 1) * spec.block_size)
    transfer = None
    if spec.connector_module is not None:
        transfer = KVTransferConfig(kv_connector=spec.connector_class,
                                    kv_connector_module_path=spec.connector_module,
                                    kv_role=spec.kv_role,
                                    kv_connector_extra_config=dict(spec.connector_extra_config))
    if spec.host_blocks > 0:
        if transfer is None:
            raise ValueError("host_blocks needs a connector_module to run beside")
        offloading = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {}}  # cpu_bytes_to_use: set below
        transfer = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"connectors": [
                                        {"kv_connector": transfer.kv_connector,
                                         "kv_connector_module_path":
                                             transfer.kv_connector_module_path,
                                         "kv_role": spec.kv_role,
                                         "kv_connector_extra_config":
                                             dict(spec.connector_extra_config)},
                                        offloading]})
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                                 dtype="float32", max_model_len=max_model_len, seed=0),
        cache_config=CacheConfig(block_size=spec.block_size,
                                 enable_prefix_caching=spec.enable_prefix_caching,
                                 prefix_caching_hash_algo="sha256",
                                 prefix_cache_retention_interval=(
                                     spec.prefix_cache_retention_interval),
                                 num_gpu_blocks_override=spec.num_blocks,
                                 **_mamba_cache_args(spec)),
        scheduler_config=SchedulerConfig(max_num_seqs=spec.max_num_seqs,
                                         max_num_batched_tokens=max(spec.max_num_batched_tokens,
                                                                    spec.block_size),
                                         max_model_len=max_model_len,
                                         is_encoder_decoder=False, enable_chunked_prefill=True,
                                         long_prefill_token_threshold=(
                                             spec.long_prefill_token_threshold),
                                         async_scheduling=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    # What EngineCore._initialize_kv_caches does with the workers' layer specs; the CPU
    # attention backend's layout is LBHNC. num_gpu_blocks_override fixes the block count.
    attention = _full_attention_spec(spec.block_size)
    layer_specs = {f"model.layers.{i}.self_attn.attn": attention for i in range(_NUM_LAYERS)}
    if spec.sliding_window > 0:
        layer_specs["model.layers.0.self_attn.attn"] = _sliding_window_spec(
            spec.block_size, spec.sliding_window)
    if spec.mamba:
        layer_specs["model.layers.0.self_attn.attn"] = _mamba_spec(
            spec.block_size, vllm_config.cache_config.mamba_cache_mode)
    memory = attention.page_size_bytes * _NUM_LAYERS * (spec.num_blocks + 1)
    resolve_kv_cache_layout(vllm_config, [["LBHNC"]], list(layer_specs.values()))
    kv_cache_config = generate_scheduler_kv_cache_config(
        get_kv_cache_configs(vllm_config, [layer_specs], [memory]))
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler_class = Scheduler
    if spec.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        vllm_config.scheduler_config.async_scheduling = True
        scheduler_class = AsyncScheduler
    if spec.host_blocks > 0:
        # What CPUOffloadingSpec divides cpu_bytes_to_use by: one block of every layer,
        # rounded up to its alignment.
        from vllm.utils.math_utils import round_up
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        per_block = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
        offloading["kv_connector_extra_config"]["cpu_bytes_to_use"] = spec.host_blocks * round_up(
            per_block, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config,
                                                                         vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    hasher = _block_hasher(hash_block_size)
    scheduler = scheduler_class(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size, hash_block_size=hash_block_size,
        include_finished_set=False, log_stats=spec.log_stats)
    return HeadlessScheduler(scheduler, vllm_config, _request_factory(hasher))
