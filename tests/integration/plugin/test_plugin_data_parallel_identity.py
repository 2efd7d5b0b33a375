"""The connector on vLLM's real Scheduler, as one data-parallel rank of a server: it binds
as a worker of its own and its heartbeat names the X-data-parallel-rank that reaches it;
as the only rank it binds and heartbeats exactly as before (no new field on the wire).

Where this EngineCore stands among the ranks is vLLM's parallel config, read by
``data_parallel_place`` (tests/unit/plugin/test_plugin_data_parallel.py, on vLLM's own
configs). A headless scheduler is built without DP, so the rank-1 case replaces that one
function's answer with what rank 1 of two reads; everything from there on (worker id,
log line, heartbeat) is the connector's own path.
"""

from __future__ import annotations

import pytest

from kvhint.engine_plugin import connector as connector_module
from kvhint.engine_plugin.vllm_adapter.data_parallel import DataParallelPlace
from kvhint.schemas import decode_status, encode_status
from scheduler_fixtures import nats_plugin, plugin_log_lines, sched


def test_rank_1_of_two_is_its_own_worker_and_names_its_header(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connector_module, "data_parallel_place", lambda _config: (
        DataParallelPlace(rank=1, several=True, http_rank=1, how="data_parallel_index")))
    with plugin_log_lines() as lines:
        h = sched(worker_id="gpu-0", http_url="http://gpu-0:8000")
    assert h.connector.core.identity.worker_id == "gpu-0-dp1"
    beat = decode_status(encode_status(h.connector._status_of(None, 3)))
    assert (beat.worker_id, beat.data_parallel_rank, beat.http_dp_rank) == ("gpu-0-dp1", 1, 1)
    assert beat.http_url == "http://gpu-0:8000" and beat.last_event_seq == 3
    assert any("data-parallel rank 1" in line and "gpu-0-dp1" in line
               and "X-data-parallel-rank 1" in line for line in lines), lines


def test_a_single_rank_binds_and_heartbeats_as_before() -> None:
    with plugin_log_lines() as lines:
        h = sched(worker_id="gpu-0")
    assert h.connector.core.identity.worker_id == "gpu-0"
    wire = encode_status(h.connector._status_of(None, 0))
    assert b"http_dp_rank" not in wire  # the 1.0 form, byte for byte
    beat = decode_status(wire)
    assert beat.worker_id == "gpu-0" and beat.data_parallel_header is None
    assert "kvhint: worker id gpu-0" in lines


def test_a_server_on_nats_without_a_worker_id_is_warned_once_naming_the_key(
        nats_url: str, subject_prefix: str) -> None:
    """Its id is the default w<rank>: w0 on every single-rank server, and the router takes
    two of them for one worker (it follows one and refuses the other's messages). Before,
    nothing said so at the servers. A configured id, or no NATS (nothing published): no
    warning."""
    def warnings(lines: list[str]) -> list[str]:
        return [line for line in lines if "no worker_id" in line]

    with plugin_log_lines() as lines, nats_plugin(nats_url, subject_prefix, worker_id=None,
                                                  create_events_stream=False) as h:
        assert h.connector.core.identity.worker_id == "w0"
    (warned,) = warnings(lines)
    assert "w0" in warned and "kv_connector_extra_config['worker_id']" in warned
    with plugin_log_lines() as lines, nats_plugin(nats_url, subject_prefix,
                                                  create_events_stream=False):
        pass
    with plugin_log_lines() as more:
        sched(worker_id=None)
    assert warnings(lines) == [] and warnings(more) == []
