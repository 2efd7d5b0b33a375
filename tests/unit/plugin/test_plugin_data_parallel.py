"""Each data-parallel rank of one vLLM server is a worker of its own: its worker id, and
the X-data-parallel-rank value its heartbeat asks the router to send.

vLLM gives every rank of ``--data-parallel-size N`` the same kv_connector_extra_config;
before, every rank resolved the configured ``worker_id`` (and a dense model's ranks the
default ``w0`` too, as vLLM sets their ``data_parallel_rank`` to 0), so the ranks
published as one worker and the router dropped all but one rank's events as stale.

The parallel configs are vLLM's own ``ParallelConfig`` and ``KVTransferConfig``, changed
the way vLLM's EngineCore changes them for rank ``r`` (``EngineCoreProc.run_engine_core``:
the ``_dp<r>`` engine_id suffix, ``data_parallel_index``, ``data_parallel_rank_local``,
then ``reconfigure_for_independent_dp_rank`` for a dense model, ``data_parallel_rank``
for a MoE one). Only the ``VllmConfig`` around them is a stand-in (a namespace holding
the two): building a real one needs a model config, which loads a model's files, and
``data_parallel_place`` reads nothing else of it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvhint.engine_plugin.config import PluginConfigError, load_plugin_config
from kvhint.engine_plugin.vllm_adapter.data_parallel import (
    DataParallelPlace,
    data_parallel_place,
)
from kvhint.schemas import is_valid_worker_id

vllm_config = pytest.importorskip("vllm.config")


def _engine_core_config(size: int, rank: int, *, moe: bool = False, local_size: int | None = None,
                        local_rank: int | None = None, **lb: bool) -> SimpleNamespace:
    """The config rank ``rank``'s EngineCore sees (module doc); size 1: no DP at all."""
    local_size = size if local_size is None else local_size
    parallel = vllm_config.ParallelConfig(data_parallel_size=size,
                                          data_parallel_size_local=local_size, **lb)
    transfer = vllm_config.KVTransferConfig(kv_connector="KvHintConnector",
                                            kv_role="kv_producer")
    if size > 1:  # what run_engine_core does to a DP engine
        transfer.engine_id = f"{transfer.engine_id}_dp{rank}"
        parallel.data_parallel_rank_local = rank if local_rank is None else local_rank
        parallel.data_parallel_index = rank
        if moe:
            parallel.data_parallel_rank = rank
        else:
            parallel.reconfigure_for_independent_dp_rank()
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=transfer)


def test_a_single_rank_keeps_its_ids_exactly_and_asks_for_no_header() -> None:
    place = data_parallel_place(_engine_core_config(1, 0))
    assert place == DataParallelPlace()
    assert load_plugin_config({"worker_id": "gpu-0"}).resolved_worker_id(
        place.rank, place.several) == "gpu-0"
    assert load_plugin_config({}).resolved_worker_id(place.rank, place.several) == "w0"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_each_rank_of_one_server_gets_its_own_worker_id_and_header(moe: bool) -> None:
    """Dense ranks are independent engines to vLLM (data_parallel_size 1 and rank 0 in
    their EngineCore): rank 0 is told from no DP by the engine_id suffix alone."""
    places = [data_parallel_place(_engine_core_config(2, r, moe=moe)) for r in (0, 1)]
    assert [(p.rank, p.several, p.http_rank) for p in places] == [(0, True, 0), (1, True, 1)]
    configured = load_plugin_config({"worker_id": "gpu-0", "http_url": "http://gpu-0:8000"})
    ids = [configured.resolved_worker_id(p.rank, p.several) for p in places]
    assert ids == ["gpu-0-dp0", "gpu-0-dp1"] and all(map(is_valid_worker_id, ids))
    assert [load_plugin_config({}).resolved_worker_id(p.rank, p.several)
            for p in places] == ["w0", "w1"]


def test_external_load_balancing_needs_no_header() -> None:
    """One API server per rank (--data-parallel-rank given): it fronts this engine only;
    vLLM there accepts no rank but 0, so none is sent."""
    place = data_parallel_place(_engine_core_config(
        2, 1, local_size=1, local_rank=0, data_parallel_external_lb=True))
    assert (place.rank, place.several, place.http_rank) == (1, True, None)


def test_hybrid_load_balancing_sends_the_rank_on_the_node() -> None:
    """One API server per node: it numbers its own node's engines from 0."""
    place = data_parallel_place(_engine_core_config(
        4, 3, local_size=2, local_rank=1, data_parallel_hybrid_lb=True))
    assert (place.rank, place.several, place.http_rank) == (3, True, 1)


def test_a_worker_id_with_no_room_for_the_rank_stops_start_up_naming_the_key() -> None:
    config = load_plugin_config({"worker_id": "g" * 126})
    assert config.resolved_worker_id(1, several_ranks=False) == "g" * 126
    with pytest.raises(PluginConfigError, match="worker_id"):
        config.resolved_worker_id(1, several_ranks=True)
