"""The router end to end: two real vLLM CPU workers with the kvhint plugin, real NATS,
the router as its own process (as `kvhint router` runs it).

One module, two workers started once (about a minute each on this machine), tests in
order: the OpenAI SDK, vLLM's own benchmark client, agent sessions with tool gaps under
KV pressure with a router restart in the middle, a prefix-cache reset on a worker (vLLM's
dev-mode endpoint: the workers run with ``VLLM_SERVER_DEV_MODE=1``), an agent's pin
through the API outliving the planner's next protection, then one worker stopped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvhint.router.bench.agents import (
    TOOL_CALL_WORKER_ARGS,
    AgentClient,
    AgentWorkload,
    TurnResult,
)
from kvhint.router.devstack.up import plugin_transfer_config
from kvhint.router.devstack.vllm_server import VllmServer
from kvhint.router.service.launch import RouterProcess
from kvhint.router.service.nats_link import remove_streams
from kvhint.schemas import Subjects

KV_TOKENS = 4096  # per worker: the agent workload below needs ~2x that in total


class Stack:
    def __init__(self, workers: dict[str, VllmServer], router: RouterProcess,
                 prefix: str) -> None:
        self.workers = workers
        self.router = router
        self.prefix = prefix

    def admin(self, path: str, **params: object) -> dict:
        response = httpx.get(f"{self.router.url}/admin{path}", params=params, timeout=30)
        response.raise_for_status()
        return response.json()


@pytest.fixture(scope="module")
def stack(vllm_pool, nats_url: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    prefix = f"kvhinte2e.{uuid.uuid4().hex[:8]}"
    specs = {}
    for worker_id in ("w0", "w1"):
        config = plugin_transfer_config(worker_id, nats_url)
        config["kv_connector_extra_config"].update(subject_prefix=prefix,
                                                   events_stream_max_bytes=32 << 20)
        spec = replace(vllm_pool.base_spec, kv_cache_tokens=KV_TOKENS, kv_transfer_config=config,
                       extra_args=TOOL_CALL_WORKER_ARGS, cpu_bind="0" if worker_id == "w0" else "1",
                       env={"VLLM_SERVER_DEV_MODE": "1"})  # /reset_prefix_cache
        specs[f"e2e-{worker_id}"] = spec
    workers = {name.removeprefix("e2e-"): server
               for name, server in vllm_pool.start_all(specs).items()}
    state = tmp_path_factory.mktemp("router")
    router = RouterProcess({
        "KVHINT_ROUTER_WORKERS": ",".join(f"{w}={s.url}" for w, s in workers.items()),
        "KVHINT_ROUTER_NATS_URL": nats_url,
        "KVHINT_ROUTER_SUBJECT_PREFIX": prefix,
        "KVHINT_ROUTER_DATABASE_URL": f"sqlite:///{state / 'router.db'}",
        "KVHINT_ROUTER_STORE_FLUSH_INTERVAL_S": "0.1",
        "KVHINT_ROUTER_EVENTS_STREAM_MAX_BYTES": str(32 << 20),
        "KVHINT_ROUTER_OUTCOMES_STREAM_MAX_BYTES": str(8 << 20),
        "KVHINT_ROUTER_RELEASES_STREAM_MAX_BYTES": str(8 << 20),
        # Every prompt is hashed on the router's hashing thread (by default only long
        # ones): the predictions below then prove that path against real workers.
        "KVHINT_ROUTER_ROUTING__HASH_THREAD_MIN_TOKENS": "0",
    }, state / "router.log")  # on a port of its own pick, another if that one is taken
    router.start()
    try:
        yield Stack(workers, router, prefix)
    finally:
        router.stop()
        for server in workers.values():
            server.stop()  # two servers less held through the rest of the session
        asyncio.run(remove_streams(nats_url, Subjects(prefix)))


def test_openai_sdk_streaming_and_not(stack: Stack) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.router.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "tell me about caches " * 30}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                           extra_body={"session_id": "sdk"})
    assert first.usage.prompt_tokens > 64
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"session_id": "sdk"}))
    usage = chunks[-1].usage
    # Same session, same prefix, same worker: the second turn hits the cache.
    assert usage.prompt_tokens_details.cached_tokens >= 64
    # No usage asked for (continuous_usage_stats, which vLLM reads only with include_usage,
    # asks for none): the router's own usage chunk is not shown, nor a usage on any other
    # chunk, and the finish chunk carries vLLM's fingerprint, as from vLLM itself.
    plain = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream=True, prompt_cache_key="sdk",
        stream_options={"continuous_usage_stats": True}))
    assert all(chunk.usage is None for chunk in plain)
    assert plain[-1].choices[0].finish_reason == "length"
    assert plain[-1].system_fingerprint == first.system_fingerprint is not None
    completion = client.completions.create(model="tiny", prompt="abc " * 40, max_tokens=3)
    assert completion.usage.completion_tokens == 3
    session = stack.admin("/sessions/default/sdk")
    assert session["turns"] == 3 and session["cached_tokens"] >= 64


def test_vllm_benchmark_client(stack: Stack, tiny_model_dir: Path) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai-chat", "--base-url", stack.router.url,
        "--endpoint", "/v1/chat/completions", "--model", "tiny",
        "--tokenizer", str(tiny_model_dir), "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "8", "--num-prompts", "16",
        "--max-concurrency", "4", "--disable-tqdm"])
    result = main(args)
    assert result["completed"] == 16 and result["failed"] == 0


def test_agent_sessions_survive_a_router_restart(stack: Stack) -> None:
    workload = AgentWorkload(sessions=8, turns=4, system_words=60, task_words=40,
                             tool_result_words=30, max_tokens=8, stagger_s=0.2,
                             max_in_flight=4, gap_scale=0.5, connect_retries=40, seed=11)
    done: list[TurnResult] = []
    restarted = asyncio.Event()

    async def scenario() -> list[TurnResult]:
        loop = asyncio.get_running_loop()

        def on_turn(turn: TurnResult) -> None:
            done.append(turn)
            if len(done) == 12 and not restarted.is_set():
                restarted.set()
                # Graceful stop (flushes the store) and a fresh process on the same DB.
                loop.run_in_executor(None, _restart, stack.router)

        result = await AgentClient(stack.router.url, workload, on_turn=on_turn).run()
        return result.turns

    turns = asyncio.run(scenario())
    assert restarted.is_set()
    failures = [t for t in turns if not t.ok]
    assert not failures, failures[:3]
    assert len(turns) == 8 * 4
    # Responses really ended in tool calls (the planner saw tool gaps).
    assert sum(1 for t in turns if t.finish_reason == "tool_calls") >= 8 * 3 // 2
    # Nothing lost across the restart: every session has all its turns, and ended.
    sessions = {s["session_id"]: s for s in stack.admin("/sessions", source="store",
                                                        limit=1000)["sessions"]}
    for number in range(8):
        record = sessions[f"agent-11-{number}"]
        assert record["turns"] == 4 and record["state"] == "ended", record
    # The prompt hashes (made on the hashing thread) found the workers' cached blocks.
    assert sum(s["predicted_cached_tokens"] for s in sessions.values()) > 0
    # Hints were planned and the workers' outcomes are in the admin API.
    hints = stack.admin("/hints", limit=1000)
    counts = hints["counts_by_status"]
    assert counts.get("accepted", 0) + counts.get("clipped", 0) > 0, counts
    assert {h["trigger"].split(":")[0] for h in hints["hints"]} & {"gap", "end"}
    for worker in stack.admin("/workers")["workers"]:
        assert worker["plugin_alive"] and worker["stream"]["phase"] == "live"


def test_a_prefix_cache_reset_on_a_worker_reaches_the_router(stack: Stack) -> None:
    # A retain the worker accepted; then an operator resets the worker's prefix cache
    # (idle: the plugin gives its holds back so the reset can go through). The plugin
    # reports the release; the router takes it off the worker's and the tenant's budgets
    # and records it on the action's row (budgets: tests/integration/service).
    with httpx.Client(timeout=120) as client:
        # The earlier tests' agents leave retains (the planner's, some at the top
        # priority) that can fill a worker's retain budget, and this test's Retain at 90
        # is then clipped to nothing (a clean-clone CI run: clipped, 0 blocks): a reset
        # first lets their holds go, so this test holds what it asks whatever ran before.
        for server in stack.workers.values():
            cleared = client.post(f"{server.url}/reset_prefix_cache")
            assert cleared.status_code == 200 and cleared.json()["success"] is True, \
                cleared.text
        response = client.post(f"{stack.router.url}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4, "session_id": "reset-probe",
            "messages": [{"role": "user", "content": "keep this context please " * 20}]})
        assert response.status_code == 200, response.text
        worker_id = response.headers["x-kvhint-worker"]
        hinted = client.post(f"{stack.router.url}/v1/sessions/reset-probe/hints", json={
            "actions": [{"action_type": "kv.retain", "payload": {"priority": 90,
                                                                 "ttl_s": 600}}]})
        assert hinted.status_code == 200, hinted.text
        (action,) = hinted.json()["actions"]
        assert action["status"] in ("accepted", "clipped") and action["applied_blocks"] > 0, action
        reset = client.post(f"{stack.workers[worker_id].url}/reset_prefix_cache")
        assert reset.status_code == 200 and reset.json()["success"] is True, reset.text

        def released() -> dict | None:
            rows = stack.admin("/hints", session_id="reset-probe", limit=100)["hints"]
            row = next(r for r in rows if r["action_id"] == action["action_id"])
            return row if row["release_reason"] is not None else None

        deadline = time.monotonic() + 20
        while (row := released()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert row is not None, "the router never heard of the release"
        assert row["release_reason"] == "reset" and row["held_after_release_blocks"] == 0
        metrics = client.get(f"{stack.router.url}/metrics").text
        assert 'kvhint_router_hold_released_blocks_total{action="kv.retain",reason="reset"}' \
            in metrics


def test_an_agents_pin_outlives_the_planners_next_protection(stack: Stack) -> None:
    # An agent runtime pins its session through the API; the session's next turn makes
    # the planner protect it again (its Retain), which before replaced the agent's pin on
    # the worker. The real plugin keeps the two owners' claims apart; the session's end
    # releases the agent's pin.
    session = "owner-probe"
    messages = [{"role": "user", "content": "remember all of this context please " * 20}]
    with httpx.Client(timeout=120) as client:
        def turn() -> str:
            response = client.post(f"{stack.router.url}/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 4, "session_id": session,
                "messages": messages})
            assert response.status_code == 200, response.text
            messages.extend([response.json()["choices"][0]["message"],
                             {"role": "user", "content": "and now this as well " * 5}])
            return response.headers["x-kvhint-worker"]

        worker_id = turn()
        deadline = time.monotonic() + 60
        while stack.admin(f"/workers/{worker_id}")["status"] is None and \
                time.monotonic() < deadline:
            time.sleep(0.2)  # the plugin's first heartbeat (a test run alone)
        pinned = client.post(f"{stack.router.url}/v1/sessions/{session}/hints", json={
            "actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 300}}]})
        assert pinned.status_code == 200, pinned.text
        (pin,) = pinned.json()["actions"]
        assert pin["payload"]["owner"] == "agent", pin
        assert pin["status"] in ("accepted", "clipped") and pin["applied_blocks"] > 0, pin
        assert turn() == worker_id
        protected_at = _planner_protection_answered(stack, session, pin["action_id"])

        def pinned_on_worker() -> int:
            status = stack.admin(f"/workers/{worker_id}")["status"]
            # A heartbeat sent after the planner's Retain was applied.
            return status["usage"]["pinned_blocks"] if status["at"] > protected_at else -1

        # The heartbeat's figures are the scheduler thread's last refresh (at most every
        # 0.25 s, at a step): the first heartbeat after the Retain may predate the pin's
        # step. A pin the Retain undid stays missing from every later one.
        deadline = time.monotonic() + 20
        while (blocks := pinned_on_worker()) < pin["applied_blocks"] and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert blocks >= pin["applied_blocks"], blocks  # the pin is still there
        ended = client.delete(f"{stack.router.url}/v1/sessions/{session}")
        assert ended.status_code == 200, ended.text
        first = ended.json()["hints"][0]
        assert first["payload"]["owner"] == "agent" and first["payload"]["priority"] == 0
        deadline = time.monotonic() + 20
        while stack.admin(f"/workers/{worker_id}")["status"]["usage"]["pinned_blocks"] and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert stack.admin(f"/workers/{worker_id}")["status"]["usage"]["pinned_blocks"] == 0


def _planner_protection_answered(stack: Stack, session: str, after: str) -> float:
    """When the worker answered a protection of ``session`` the planner sent after the
    action ``after`` (its time on the router's clock)."""
    deadline = time.monotonic() + 30
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = stack.admin("/hints", session_id=session, limit=100)["hints"]
        sent_at = next(r["created_at"] for r in rows if r["action_id"] == after)
        answered = [r["updated_at"] for r in rows if r["source"] == "planner"
                    and r["action_type"] in ("kv.retain", "kv.pin")
                    and r["created_at"] > sent_at and r["status"] in ("accepted", "clipped")]
        if answered:
            return max(answered)
        time.sleep(0.2)
    raise AssertionError(f"no protection of the planner's after {after} was answered: "
                         f"{[(r['source'], r['trigger'], r['status']) for r in rows]}")


def _restart(router: RouterProcess) -> None:
    router.stop()
    router.start()


def test_stopping_one_worker_keeps_requests_succeeding(stack: Stack) -> None:
    # Sessions that last ran on w1: their next turn prefers w1 (affinity) and must fail
    # over to w0 once w1 is gone.
    on_w1 = [s["session_id"] for s in stack.admin("/sessions", limit=1000)["sessions"]
             if s["worker_id"] == "w1"]
    stack.workers["w1"].stop()
    with httpx.Client(timeout=120) as client:
        for number, session in enumerate([*on_w1, *(f"after-stop-{n}" for n in range(4))]):
            response = client.post(f"{stack.router.url}/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 4, "session_id": session,
                "messages": [{"role": "user", "content": f"still there? {number}"}]})
            assert response.status_code == 200, response.text
            assert response.headers["x-kvhint-worker"] == "w0"
        metrics = client.get(f"{stack.router.url}/metrics").text
    workers = {w["worker_id"]: w for w in stack.admin("/workers")["workers"]}
    retried = 'kvhint_router_retries_total{worker="w1"}' in metrics
    # A request that tried w1 was retried on w0, and w1 is marked down until it answers
    # (routing may also have sent every request to w0 straight away).
    assert retried == (workers["w1"]["http_up"] is False)
