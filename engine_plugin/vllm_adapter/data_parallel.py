"""Which data-parallel rank this EngineCore is, and which ``X-data-parallel-rank`` value
reaches it through the vLLM API server in front of it.

vLLM runs one EngineCore per DP rank, each with its own KV cache and its own
scheduler-side connector, all built from one config. What an EngineCore's config says of
DP (vLLM 0.32, ``EngineCoreProc.run_engine_core`` and the Ray actors; read with getattr,
features not versions):

- a MoE model keeps ``data_parallel_size``, ``_size_local`` and ``_rank`` as served;
- a dense model's ranks are independent engines: ``reconfigure_for_independent_dp_rank``
  sets ``data_parallel_size`` and ``_size_local`` to 1 and ``data_parallel_rank`` to 0.
  What is left is ``data_parallel_index`` (the global rank), ``data_parallel_rank_local``
  (its index among the ranks of its node) and ``kv_transfer_config.engine_id``, which vLLM
  suffixes ``_dp<rank>`` on every DP engine so that connectors' ids differ per rank. That
  suffix is all that tells rank 0 of a dense DP engine from an engine without DP.

The API server's ``X-data-parallel-rank`` header picks one of the engines that server
fronts (``input_processor`` accepts ``0 <= r < (data_parallel_size_local if
local_engines_only else data_parallel_size)``; ``core_client`` indexes its engines, which
start at its own first rank, by it); without it vLLM balances the load across them, which
defeats cache-aware routing:

- internal load balancing (one API server for every rank): the global rank;
- hybrid (``data_parallel_hybrid_lb``: one API server per node): the rank on the node;
- external (``data_parallel_external_lb``: one API server per rank): none, the server
  fronts this engine only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DataParallelPlace:
    # The global DP rank (0 without DP).
    rank: int = 0
    # One of several DP ranks of one engine (which share one kv_connector_extra_config).
    several: bool = False
    # The X-data-parallel-rank value that reaches this engine through its API server;
    # None: no header is needed (no DP, or a server of its own).
    http_rank: int | None = None
    # How it was told (for the start-up log line).
    how: str = "no data parallelism"


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def data_parallel_place(vllm_config: Any) -> DataParallelPlace:
    """Where this EngineCore stands among the DP ranks of its engine (module doc)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    size = _int_or_none(getattr(parallel, "data_parallel_size", 1)) or 1
    index = _int_or_none(getattr(parallel, "data_parallel_index", None))
    rank = index if index is not None else (
        _int_or_none(getattr(parallel, "data_parallel_rank", 0)) or 0)
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    engine_id = getattr(transfer, "engine_id", None)
    suffixed = isinstance(engine_id, str) and engine_id.endswith(f"_dp{rank}")
    if size > 1:
        how = f"data_parallel_size {size}"
    elif rank > 0:
        how = "data_parallel_index (a dense model's rank, an engine of its own in vLLM)"
    elif suffixed:
        how = "kv_transfer_config.engine_id's _dp suffix (a dense model's rank 0)"
    else:
        return DataParallelPlace()
    if getattr(parallel, "data_parallel_external_lb", False):
        return DataParallelPlace(rank, True, None, how + "; external load balancing")
    if getattr(parallel, "data_parallel_hybrid_lb", False):
        local = _int_or_none(getattr(parallel, "data_parallel_rank_local", None))
        return DataParallelPlace(rank, True, local, how + "; hybrid load balancing")
    return DataParallelPlace(rank, True, rank, how)
