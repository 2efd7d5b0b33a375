"""A client's end of a session the planner had already abandoned, in the recorded trace:
the real router app (real tokenizer, a stub worker, a real NATS server, the plugin played
by the test) with its real trace recorder writing to a temporary folder, read back by
the simulator's own reader.

The trace holds the client's events, never the planner's: an abandonment is no line (a
replay's planner abandons on its own schedule), a client's end is an end line at the
time it came, once however often it is repeated, and the id reused after it is a new
session (``<id>~2``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conftest import StubWorker
from feed_helpers import router_with_accepting_plugin, until
from kvhint.router.service.trace_recorder import FILE_PREFIX
from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace
from test_service_sessions_api_contract import _turn

pytestmark = pytest.mark.usefixtures("throwaway_streams")

ADMIN_CALL = {"x-kvhint-request": "1"}  # dev mode: no key, the dashboard's header


async def test_a_client_end_after_an_abandonment_is_an_end_line_once(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Before, ``SessionLifecycle`` told the recorder of no end of a session the planner
    had abandoned: the file had no end line for the DELETE (nor the admin's end), and the
    id reused after it continued the ended session's lines (``deleted`` turn 2)."""
    traces = tmp_path / "traces"
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                            stub_workers[0], hints={"tick_s": 0.1},
                                            trace_dir=str(traces)) as (router, client, _):
        runtime, url = router.runtime, router.url
        for session in ("deleted", "admin_ended", "only_abandoned"):
            await _turn(client, url, session)
        runtime.hints.planner_config = dataclasses.replace(runtime.hints.planner_config,
                                                           abandon_after_s=0.5)
        await until(lambda: all(runtime.sessions.get("default", s).state == "ended"
                                for s in ("deleted", "admin_ended", "only_abandoned")))
        assert not runtime.sessions.get("default", "deleted").plan.ended_explicitly
        for _repeat in range(2):  # the second is no new end
            deleted = await client.delete(f"{url}/v1/sessions/deleted")
            assert deleted.status_code == 200, deleted.text
            ended = await client.post(f"{url}/admin/sessions/default/admin_ended/end",
                                      headers=ADMIN_CALL)
            assert ended.status_code == 200, ended.text
        for session in ("deleted", "admin_ended"):
            assert runtime.sessions.get("default", session).plan.ended_explicitly
        await _turn(client, url, "deleted")  # the id, reused after its client's end
        await _turn(client, url, "only_abandoned")  # back after an abandonment only
    (path,) = traces.glob(f"{FILE_PREFIX}*-bs32.jsonl")  # the plugin's block size: 32
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    end_lines = [line["session_id"] for line in lines if "input_length" not in line]
    assert sorted(end_lines) == ["admin_ended", "deleted"]  # one each, none for abandoning
    trace = load_trace(path, block_size=32)
    first, admin_ended, abandoned, again, returned = trace.requests
    assert (first.session_id, again.session_id, again.turn) == ("deleted", "deleted~2", 1)
    assert first.end_at_s is not None and first.arrival_s < first.end_at_s <= again.arrival_s
    assert admin_ended.session_id == "admin_ended" and admin_ended.end_at_s is not None
    assert first.end_at_s <= admin_ended.end_at_s <= again.arrival_s
    assert not first.end and not admin_ended.end and again.end_at_s is None
    # Abandoned only: the planner's, not the client's; its return continues it.
    assert (abandoned.session_id, abandoned.end_at_s) == ("only_abandoned", None)
    assert (returned.session_id, returned.turn) == ("only_abandoned", 2)
    # The replay takes the ends where they came.
    result = Simulation(trace, SimConfig(workers=1, gpu_blocks=256, block_size=32),
                        "kvhint").run()
    assert result.prompt_tokens == sum(r.input_length for r in trace.requests)
