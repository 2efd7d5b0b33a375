"""What one simulation run is: the fleet, the time model, the engine, the policies' knobs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvhint.engine_plugin.config import PluginConfig
from kvhint.router.policy import PlannerConfig, RoutingConfig
from kvhint.router.sim.timing import TimeModel

ENGINES = ("fast", "scheduler")


@dataclass(frozen=True)
class SimConfig:
    workers: int = 1
    gpu_blocks: int = 5_000
    host_blocks: int = 0
    block_size: int = 512
    timing: TimeModel = TimeModel()
    seed: int = 0
    tick_s: float = 5.0
    # Half-life of the router's recent-computed-tokens load signal.
    recent_half_life_s: float = 120.0
    host_cache_policy: str = "lru"
    # Overrides of the plugin's config (its kv_connector_extra_config keys).
    plugin: Mapping[str, Any] = field(default_factory=dict)
    routing: RoutingConfig = RoutingConfig()
    planner: PlannerConfig = PlannerConfig()
    timeline_bucket_s: float = 60.0
    keep_records: bool = False
    # "fast": the simulator's own FIFO schedule over vLLM's KVCacheManager (worker.py);
    # "scheduler": vLLM's real Scheduler, stepped (scheduler_worker.py), with its
    # max_num_batched_tokens and max_num_seqs (vLLM's OpenAI server defaults on an
    # H100-class GPU; on the CPU they are 2,048 and 128).
    engine: str = "fast"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    # Scheduler engine only, > 0: layer 0 attends a sliding window of this many tokens
    # beside full attention (a hybrid model: two KV cache groups, headless.py), so the
    # plugin's holds take both groups' blocks and its status carries a claim cost.
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r} (known: {', '.join(ENGINES)})")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.sliding_window < 0 or (self.sliding_window and self.engine != "scheduler"):
            raise ValueError("sliding_window must be >= 0, and > 0 only with the scheduler "
                             "engine")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.gpu_blocks < 2:
            raise ValueError("gpu_blocks must be >= 2")
        if self.sliding_window and self.gpu_blocks <= self.window_blocks():
            # Before, max_model_len came out at zero or below and vLLM failed inside.
            raise ValueError(
                f"gpu_blocks ({self.gpu_blocks}) must exceed the {self.window_blocks()} "
                f"blocks the sliding window takes (sliding_window {self.sliding_window} "
                f"plus max_num_batched_tokens {self.max_num_batched_tokens}, in blocks of "
                f"{self.block_size}, plus one): no request would fit")
        if self.host_blocks < 0:
            raise ValueError("host_blocks must be >= 0")
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError("block_size must be a positive multiple of 32 (vLLM on the CPU)")
        self.plugin_config("w0")  # bad plugin overrides fail here, before any worker runs

    def window_blocks(self) -> int:
        """The pool's blocks a sliding-window group keeps from a request (scheduler
        engine): vLLM reserves a request's window and a step's tokens, and one block more
        (a window straddling a block boundary); 0 without a window."""
        if not self.sliding_window:
            return 0
        return -(-(self.sliding_window + self.max_num_batched_tokens) // self.block_size) + 1

    def plugin_config(self, worker_id: str) -> PluginConfig:
        """The plugin's validated config for one simulated worker (its defaults, then
        ``plugin``); pydantic's ValidationError is a ValueError."""
        return PluginConfig(worker_id=worker_id, **dict(self.plugin))
