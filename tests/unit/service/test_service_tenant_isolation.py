"""Tenant isolation of shared router resources: the session registry's memory bound is
per tenant, a response with ``n`` > 1 choices is read per completion (the session goes on
with one of them), ``n`` is bounded, and the traffic recorder's memory and disk are
bounded."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from kvhint.router.service.inbound import BadRequest
from kvhint.router.service.response_scan import ResponseObservation, SseRelay
from kvhint.router.service.sampling import check_parallel_samples, parallel_samples
from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.service.settings import RouterSettings
from kvhint.router.service.tenancy import TenantDirectory
from kvhint.router.service.trace_recorder import TraceRecorder, TracedRequest
from kvhint.router.sim.trace import load_trace
from test_service_lifecycle import build

BS = 16


# -- 1. sessions in memory, per tenant ---------------------------------------------------

def _registry(max_sessions: int, caps: dict[str, int]):
    evicted: collections.Counter[str] = collections.Counter()
    drops: list[str] = []
    registry = SessionRegistry(None, max_sessions, on_drop=lambda what, n: drops.append(what),
                               tenant_cap=caps.get,
                               on_evict=lambda tenant: evicted.update([tenant]))
    return registry, evicted, drops


def test_one_tenants_churn_of_session_ids_evicts_only_its_own_sessions() -> None:
    """A tenant at its max_sessions makes room among its own least recent sessions.
    Before, the registry's one LRU was shared: a tenant opening new session ids pushed
    every other tenant's sessions out of memory."""
    registry, evicted, drops = _registry(100, {"noisy": 3, "quiet": 3})
    quiet = [registry.open("quiet", f"q{n}", float(n)) for n in range(2)]
    for n in range(50):
        registry.open("noisy", f"n{n}", 10.0 + n)
    assert [registry.get("quiet", f"q{n}") for n in range(2)] == quiet
    assert registry.count("noisy") == 3 and registry.count("quiet") == 2
    assert [r.session_id for r in registry if r.tenant == "noisy"] == ["n47", "n48", "n49"]
    assert evicted == {"noisy": 47}
    assert drops == ["session_evicted_from_memory"] * 47
    assert registry.counts_by_state("quiet")["active"] == 2


def test_a_tenant_at_its_cap_keeps_turns_in_flight_and_evicts_ended_ones_first() -> None:
    registry, evicted, _drops = _registry(100, {"t": 2})
    busy = registry.open("t", "busy", 1.0)
    busy.inflight = 1
    done = registry.open("t", "done", 2.0)
    done.state = "ended"
    registry.open("t", "new", 3.0)  # the ended one goes, not the older one in flight
    assert registry.get("t", "busy") is busy and registry.get("t", "done") is None
    newer = registry.get("t", "new")
    assert newer is not None
    newer.inflight = 1
    registry.open("t", "newest", 4.0)  # all in flight: over the bound for now
    assert registry.count("t") == 3 and evicted == {"t": 1}


def test_the_global_bound_takes_from_the_tenant_holding_the_most() -> None:
    """Caps that add up to more than the router's bound: a full router evicts from the
    largest tenant, not from whoever opened least recently."""
    registry, evicted, _drops = _registry(6, {"big": 10, "small": 10})
    for n in range(2):
        registry.open("small", f"s{n}", float(n))
    for n in range(4):
        registry.open("big", f"b{n}", 10.0 + n)
    registry.open("small", "s2", 20.0)  # full: big (4 sessions) gives one up
    assert registry.count("small") == 3 and registry.count("big") == 3
    assert registry.get("big", "b0") is None and evicted == {"big": 1}
    assert len(registry) == 6


def test_a_restore_keeps_each_tenants_most_recent_sessions_within_its_cap() -> None:
    registry, evicted, _drops = _registry(100, {"a": 2})
    rows = [{"tenant": tenant, "session_id": f"{tenant}{n}", "created_at": 0.0,
             "last_activity": float(n)} for tenant in ("a", "b") for n in range(4)]
    registry.restore(rows)
    assert sorted(r.session_id for r in registry if r.tenant == "a") == ["a2", "a3"]
    assert registry.count("b") == 4 and evicted == {"a": 2}


def test_a_tenants_session_cap_defaults_to_an_equal_share() -> None:
    settings = RouterSettings(tenants=[
        {"name": "a", "api_keys": ["ka"], "max_sessions": 7},
        {"name": "b", "api_keys": ["kb"]}, {"name": "c", "api_keys": ["kc"]},
        {"name": "d", "api_keys": ["kd"], "max_in_flight": 5}])
    directory = TenantDirectory(settings)
    assert directory.session_cap("a", 1000) == 7
    assert directory.session_cap("b", 1000) == 250
    assert directory.session_cap("default", 1000) == 250  # a global admin's own traffic
    assert directory.get("d").max_in_flight == 5 and directory.get("b").max_in_flight is None
    alone = TenantDirectory(RouterSettings())
    assert alone.session_cap("default", 1000) == 1000
    with pytest.raises(ValueError):
        RouterSettings(tenants=[{"name": "a", "max_sessions": 0}])
    with pytest.raises(ValueError):
        RouterSettings(tenants=[{"name": "a", "max_in_flight": 0}])


# -- 3. n > 1 ----------------------------------------------------------------------------

def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _relay(parts: list[bytes]) -> ResponseObservation:
    import asyncio

    observation = ResponseObservation()
    relay = SseRelay(observation, strip_usage_chunk=False)

    async def source():
        for part in parts:
            yield part

    async def collect() -> None:
        async for _chunk in relay.relay(source()):
            pass

    asyncio.run(collect())
    return observation


USAGE = {"prompt_tokens": 100, "completion_tokens": 9,
         "prompt_tokens_details": {"cached_tokens": 64}}


def test_a_streamed_answer_with_n_choices_is_read_per_completion() -> None:
    """vLLM streams each of n choices by its index, every one ending in an event with
    its finish_reason, and one usage whose completion_tokens sums them all. Before,
    the router took that sum for the one completion the session goes on with: the
    planner protected prompt + n completions, and the trace replayed them as one."""
    parts = [_event({"choices": [{"index": i, "delta": {"content": "x"},
                                  "finish_reason": None}]}) for i in range(3)]
    parts += [_event({"choices": [{"index": i, "delta": {}, "finish_reason": "length"}]})
              for i in range(3)]
    parts += [_event({"choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]
    seen = _relay(parts)
    assert seen.choices == 3 and seen.completion_tokens == 9
    assert seen.completion_tokens_per_choice == 3


def test_a_whole_answer_with_n_choices_is_read_per_completion() -> None:
    seen = ResponseObservation()
    seen.observe_json(json.dumps({"choices": [
        {"index": i, "message": {"content": "x"}, "finish_reason": "stop"}
        for i in range(2)], "usage": USAGE}).encode())
    assert seen.choices == 2 and seen.completion_tokens_per_choice == 5  # 9 / 2, up
    single = ResponseObservation()
    single.observe_json(json.dumps({"choices": [
        {"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}],
        "usage": USAGE}).encode())
    assert single.completion_tokens_per_choice == 9


async def test_the_planner_learns_one_completion_of_an_n_choice_answer() -> None:
    _clock, _link, _hints, sessions, lifecycle, _ended = build(["w0"])
    record = lifecycle.begin_turn("acme", "s")
    await lifecycle.routed(record, "w0", 400, 0, (1, 2, 3))
    answer = ResponseObservation(finish_reason="tool_calls", tool_names=["search"],
                                 prompt_tokens=400, completion_tokens=40, cached_tokens=0,
                                 choices=4)
    await lifecycle.finished(record, "w0", answer, session_end=False)
    assert record.plan.context_tokens == 410  # the prompt and one completion of 10


def test_n_is_bounded_by_routing_max_n() -> None:
    assert RouterSettings().routing.max_n == 16
    check_parallel_samples({"n": 16}, 16, 16)
    check_parallel_samples({"n": "many"}, 16, 16)  # vLLM answers for what it cannot read
    for key in ("n", "best_of"):
        with pytest.raises(BadRequest) as refused:
            check_parallel_samples({key: 17}, 16, 16)
        assert refused.value.status == 400 and refused.value.param == key
        assert "routing.max_n" in refused.value.message
    assert parallel_samples({"n": 3, "best_of": 5}) == 5
    assert parallel_samples({"n": True}) == 1


@pytest.mark.parametrize("n", ["64", 64.0, " 64", "17", 17.0, True, "1", 64.5, "x", None, [2]])
def test_n_is_read_as_vllm_reads_it(n: object) -> None:
    """The router's count of ``n`` is vLLM's own (its request models, in-process): "64"
    and 64.0 are 64 sequences to vLLM. Before, the router counted only a JSON integer,
    and ``"n": "64"`` passed routing.max_n (16) as one sequence; a value vLLM refuses
    is left to vLLM's 400."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for model, body in ((ChatCompletionRequest, {"messages": []}),
                        (CompletionRequest, {"prompt": "p"})):
        try:
            vllm_n = model.model_validate({"model": "m", **body, "n": n}).n
        except ValidationError:
            vllm_n = None
        if vllm_n is None:  # vLLM refuses it (or null: its default)
            check_parallel_samples({"n": n}, 16, 16)
            assert parallel_samples({"n": n}) == 1
            continue
        assert parallel_samples({"n": n}) == max(1, vllm_n)
        if vllm_n > 16:
            with pytest.raises(BadRequest):
                check_parallel_samples({"n": n}, 16, 16)
        else:
            check_parallel_samples({"n": n}, 16, 16)


# -- 4. the traffic recorder's memory and disk ------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(session: str | None, end: bool = False, blocks: int = 2) -> TracedRequest:
    return TracedRequest(tenant="acme", session_id=session, prompt_tokens=blocks * BS,
                         block_hashes=tuple(range(1000, 1000 + blocks)), block_size=BS,
                         output_tokens=3, finish_reason="stop", tool_names=(), end=end)


def _recorder(tmp_path: Path, **kwargs):
    drops: collections.Counter[str] = collections.Counter()
    clock = Clock()
    recorder = TraceRecorder(tmp_path / "traces", lambda what, n: drops.update({what: n}),
                             stall_s=60.0, clock=clock, wall=lambda: 0.0, **kwargs)
    return recorder, drops, clock


def _record(recorder: TraceRecorder, clock: Clock, request: TracedRequest) -> None:
    clock.now += 0.01
    recorder.finished(recorder.arrived(), request)


async def test_the_recorder_remembers_a_bounded_number_of_sessions(tmp_path: Path) -> None:
    """Past max_sessions the least recently written session is forgotten (counted).
    Before, every session id the router ever saw stayed in memory. One that comes back
    after it was forgotten continues under a fresh id: its old id ended in the file, and
    continuing it would make the file unloadable."""
    recorder, drops, clock = _recorder(tmp_path, max_sessions=3)
    _record(recorder, clock, _request("a", end=True))  # "a" ends in the file
    for name in ("b", "c", "d", "e"):
        _record(recorder, clock, _request(name))
    _record(recorder, clock, _request("a"))  # forgotten meanwhile: not "a" again
    recorder.session_ended("acme", "e")
    await recorder.close()
    assert drops == {"trace_session_evicted": 3}
    assert len(recorder._tracks) == 3
    trace = load_trace(recorder.path, block_size=BS)
    ids = [r.session_id for r in trace.requests]
    assert ids[:5] == ["a", "b", "c", "d", "e"] and ids[5].startswith("a~e")
    assert trace.requests[4].end_at_s is not None  # e's end line, still remembered


async def test_a_full_trace_file_is_rotated_and_each_file_loads(tmp_path: Path) -> None:
    """Past trace_max_bytes the file is renamed .1 (.1 to .2 ...), keep_files kept, the
    oldest deleted and its requests counted. Before, one file grew for as long as the
    router ran. An end line is written only into a file that holds a request of its
    session, so every file loads on its own."""
    line = len(json.dumps({"timestamp": 0.0, "session_id": "s0", "tenant": "acme",
                           "input_length": 32, "output_length": 3, "hash_ids": [1000, 1001],
                           "finish_reason": "stop"}, separators=(",", ":"))) + 1
    recorder, drops, clock = _recorder(tmp_path, max_bytes=2 * line, keep_files=2)
    _record(recorder, clock, _request("s0"))
    _record(recorder, clock, _request("s1"))
    await recorder.flush()  # the first file: two requests, full
    recorder.session_ended("acme", "s1")  # s1's lines are in the full file: no end line
    _record(recorder, clock, _request("s0"))  # s0 goes on in the next file
    recorder.session_ended("acme", "s0")  # an end line there, after its request
    for n in range(2, 7):
        _record(recorder, clock, _request(f"s{n}"))
    await recorder.close()
    files = sorted(p.name for p in (tmp_path / "traces").iterdir())
    base = recorder.path.name
    assert files == sorted([base, f"{base}.1", f"{base}.2"])
    assert drops == {"trace_rotated_out": 2}  # the first file (s0, s1) deleted
    loaded = {name: load_trace(tmp_path / "traces" / name, block_size=BS)
              for name in files}
    assert [[r.session_id for r in loaded[n].requests] for n in
            (f"{base}.2", f"{base}.1", base)] == [["s0", "s2"], ["s3", "s4"], ["s5", "s6"]]
    assert loaded[f"{base}.2"].requests[0].end_at_s is not None
    assert recorder.written == 8
    for name in files:
        assert (tmp_path / "traces" / name).stat().st_size <= 2 * line + line
