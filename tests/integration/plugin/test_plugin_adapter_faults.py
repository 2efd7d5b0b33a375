"""A bug in the plugin's own bookkeeping inside vLLM's allocate/free path never reaches
the engine: vLLM's Scheduler keeps scheduling and freeing, the error is counted.

The bug is injected (the adapter's hash resolution made to raise): no input is known to
cause one, and the contract is about what happens if one ever does."""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from scheduler_fixtures import prompt, sched


def _raises(_hashes: Any) -> Any:
    raise KeyError("a bug in the plugin's hash mapping")


def test_a_plugin_error_in_the_allocate_and_free_wrappers_stays_out_of_vllm() -> None:
    """Before, the error escaped ``Scheduler.schedule()`` and ``finish_requests()``,
    uncounted, and on the free path vLLM's own ``free`` never ran: the request's blocks
    stayed allocated."""
    h = sched(num_blocks=64)
    core = h.connector.core
    request = h.add(h.make_request(prompt([1, 2, 3]), session_id="s", max_tokens=3))
    h.step()
    free_before_admission = h.block_pool.get_num_free_blocks()
    core.adapter._resolve_hashes = _raises
    other = h.add(h.make_request(prompt([7, 8]), session_id="t", max_tokens=3))
    h.step()  # allocate_slots maps the new request's hashes: raises inside
    assert other.request_id in h.scheduler.running or other.num_computed_tokens > 0
    h.scheduler.finish_requests([request.request_id, other.request_id],
                                RequestStatus.FINISHED_ABORTED)
    assert h.block_pool.get_num_free_blocks() > free_before_admission
    assert request.request_id not in h.scheduler.requests
    manager = h.kv_cache_manager.coordinator.single_type_managers[0]
    assert request.request_id not in manager.req_to_blocks
    assert other.request_id not in manager.req_to_blocks
    assert core.counters.internal_errors >= 2
