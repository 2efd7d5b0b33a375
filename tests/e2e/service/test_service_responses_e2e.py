"""vLLM's Responses API through the router, end to end: two real vLLM CPU workers with
the kvhint plugin and their response stores on (``VLLM_ENABLE_RESPONSES_API_STORE=1``),
real NATS, the router as its own process with two tenants.

One module, two workers started once, tests in order: the OpenAI SDK's
``client.responses.create`` (whole and streamed) with the router's prefix hashes matching
the workers' cache; follow-ups by ``previous_response_id`` and GETs reaching the one
worker of the two that stored each response; another tenant's ids unknown to it; then one
worker stopped: its responses are answered with an error, never sent to the other.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from kvhint.router.devstack.up import plugin_transfer_config
from kvhint.router.devstack.vllm_server import VllmServer
from kvhint.router.service.launch import RouterProcess
from kvhint.router.service.nats_link import remove_streams
from kvhint.schemas import Subjects

ADMIN = {"Authorization": "Bearer admin-key-e2e"}
ACME, BETA = "acme-key-e2e", "beta-key-e2e"
TENANTS = [{"name": "acme", "api_keys": [ACME]}, {"name": "beta", "api_keys": [BETA]}]
# Not a whole number of 32-token blocks: vLLM's cached tokens are then every full block.
PROMPT = "tell me about caches and how agents reuse them, in detail please " * 6


class Stack:
    def __init__(self, workers: dict[str, VllmServer], router: RouterProcess) -> None:
        self.workers = workers
        self.router = router

    def admin(self, path: str) -> dict:
        response = httpx.get(f"{self.router.url}/admin{path}", headers=ADMIN, timeout=30)
        response.raise_for_status()
        return response.json()

    def sdk(self, key: str = ACME):  # noqa: ANN201 - openai.OpenAI
        from openai import OpenAI

        return OpenAI(base_url=f"{self.router.url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def stack(vllm_pool, nats_url: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    prefix = f"kvhintresp.{uuid.uuid4().hex[:8]}"
    specs = {}
    for worker_id in ("w0", "w1"):
        config = plugin_transfer_config(worker_id, nats_url)
        config["kv_connector_extra_config"].update(subject_prefix=prefix,
                                                   events_stream_max_bytes=32 << 20)
        specs[f"resp-{worker_id}"] = replace(
            vllm_pool.base_spec, kv_cache_tokens=4096, kv_transfer_config=config,
            cpu_bind="0" if worker_id == "w0" else "1",
            env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    workers = {name.removeprefix("resp-"): server
               for name, server in vllm_pool.start_all(specs).items()}
    state = tmp_path_factory.mktemp("router")
    router = RouterProcess({
        "KVHINT_ROUTER_WORKERS": ",".join(f"{w}={s.url}" for w, s in workers.items()),
        "KVHINT_ROUTER_NATS_URL": nats_url,
        "KVHINT_ROUTER_SUBJECT_PREFIX": prefix,
        "KVHINT_ROUTER_DATABASE_URL": f"sqlite:///{state / 'router.db'}",
        "KVHINT_ROUTER_EVENTS_STREAM_MAX_BYTES": str(32 << 20),
        "KVHINT_ROUTER_OUTCOMES_STREAM_MAX_BYTES": str(8 << 20),
        "KVHINT_ROUTER_RELEASES_STREAM_MAX_BYTES": str(8 << 20),
        "KVHINT_ROUTER_TENANTS": json.dumps(TENANTS),
        "KVHINT_ROUTER_ADMIN_KEYS": ADMIN["Authorization"].removeprefix("Bearer "),
        "KVHINT_ROUTER_HEALTH_PROBE_S": "0.5",
    }, state / "router.log")  # on a port of its own pick, another if that one is taken
    router.start()
    try:
        stack = Stack(workers, router)
        # The plugins' heartbeats say how the workers hash blocks (block size, seed):
        # a prompt hashed before them is hashed with the router's defaults.
        deadline = time.monotonic() + 60
        while any(w["status"] is None for w in stack.admin("/workers")["workers"]):
            assert time.monotonic() < deadline, "a worker's plugin never heartbeat"
            time.sleep(0.2)
        yield stack
    finally:
        router.stop()
        for server in workers.values():
            server.stop()
        asyncio.run(remove_streams(nats_url, Subjects(prefix)))


def _index_holds_blocks(stack: Stack, worker_id: str, timeout_s: float = 30.0) -> None:
    """Waits until the router's index holds blocks of ``worker_id`` (its KV events)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{stack.router.url}/metrics", timeout=30).text
        for line in text.splitlines():
            if (line.startswith("kvhint_router_index_blocks{") and f'worker="{worker_id}"'
                    in line and float(line.split()[-1]) > 0):
                return
        time.sleep(0.2)
    raise AssertionError(f"no KV events of {worker_id} reached the router")


def test_openai_sdk_responses_whole_and_streamed(stack: Stack) -> None:
    client = stack.sdk()
    first = client.responses.create(model="tiny", input=PROMPT, max_output_tokens=4,
                                    extra_body={"session_id": "sdk"})
    assert first.status in ("completed", "incomplete") and first.id.startswith("resp_")
    assert first.usage.input_tokens > 64
    session = stack.admin("/sessions/acme/sdk")
    _index_holds_blocks(stack, session["worker_id"])
    kinds = []
    with client.responses.create(model="tiny", input=PROMPT, max_output_tokens=4,
                                 stream=True, extra_body={"session_id": "sdk"}) as stream:
        for event in stream:
            kinds.append(event.type)
    final = event.response  # the last event's: response.completed
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    cached = final.usage.input_tokens_details.cached_tokens
    assert final.usage.input_tokens == first.usage.input_tokens and cached >= 64
    # The router rendered the Responses input exactly as vLLM did (chat template,
    # special tokens, the tenant's salt): the blocks it predicted are the ones cached.
    session = stack.admin("/sessions/acme/sdk")
    assert session["turns"] == 2 and session["cached_tokens"] == cached
    assert session["predicted_cached_tokens"] == cached, session
    metrics = httpx.get(f"{stack.router.url}/metrics", timeout=30).text
    assert (f'kvhint_router_requests_total{{code="200",endpoint="responses",'
            f'worker="{session["worker_id"]}"}} 2.0') in metrics


def test_stored_responses_continue_on_the_worker_that_holds_them(stack: Stack) -> None:
    client = stack.sdk()
    made: dict[str, tuple[str, str]] = {}  # response id -> (worker, session)
    number = 0
    with httpx.Client(timeout=120) as http:
        while {w for w, _s in made.values()} != {"w0", "w1"}:
            number += 1
            assert number <= 24, "every new session went to one worker"
            answer = http.post(f"{stack.router.url}/v1/responses", headers={
                "Authorization": f"Bearer {ACME}"}, json={
                "model": "tiny", "input": f"conversation {number}: " + PROMPT,
                "max_output_tokens": 4, "session_id": f"chain-{number}"})
            assert answer.status_code == 200, answer.text
            made[answer.json()["id"]] = (answer.headers["x-kvhint-worker"], f"chain-{number}")
    for response_id, (worker, session) in made.items():
        # A wrong worker would answer 404: vLLM holds the response on one server only.
        raw = client.responses.with_raw_response.create(
            model="tiny", input="and then?", previous_response_id=response_id,
            max_output_tokens=4)
        assert raw.headers["x-kvhint-worker"] == worker
        follow = raw.parse()
        assert follow.previous_response_id == response_id
        stored = client.responses.retrieve(response_id)
        assert stored.id == response_id and stored.output_text is not None
        # The follow-up named no session: it continued its response's.
        assert stack.admin(f"/sessions/acme/{session}")["turns"] == 2
        again = client.responses.create(model="tiny", input="more", max_output_tokens=4,
                                        previous_response_id=follow.id)
        assert again.previous_response_id == follow.id


def test_another_tenants_response_ids_are_unknown_to_it(stack: Stack) -> None:
    from openai import NotFoundError

    made = stack.sdk().responses.create(model="tiny", input="private", max_output_tokens=2)
    beta = stack.sdk(BETA)
    with pytest.raises(NotFoundError, match="not found"):
        beta.responses.retrieve(made.id)
    with pytest.raises(NotFoundError, match="not found"):
        beta.responses.create(model="tiny", input="x", max_output_tokens=2,
                              previous_response_id=made.id)
    assert stack.sdk().responses.retrieve(made.id).id == made.id


def test_a_stopped_workers_responses_are_not_sent_to_the_other(stack: Stack) -> None:
    client = stack.sdk()
    on_w1 = None
    for number in range(24):
        raw = client.responses.with_raw_response.create(
            model="tiny", input=f"last {number}", max_output_tokens=2,
            extra_body={"session_id": f"last-{number}"})
        if raw.headers["x-kvhint-worker"] == "w1":
            on_w1 = raw.parse().id
            break
    assert on_w1 is not None
    served_by_w0 = _w0_requests(stack)
    stack.workers["w1"].stop()
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {ACME}"}) as http:
        follow = {"model": "tiny", "input": "still there?", "max_output_tokens": 2,
                  "previous_response_id": on_w1}
        deadline = time.monotonic() + 30
        while True:
            answer = http.post(f"{stack.router.url}/v1/responses", json=follow)
            assert answer.status_code in (502, 503), answer.text
            if answer.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        error = answer.json()["error"]
        assert answer.status_code == 503 and "held by worker w1" in error["message"], error
        assert http.get(f"{stack.router.url}/v1/responses/{on_w1}").status_code == 503
        # New work goes on at w0.
        fresh = http.post(f"{stack.router.url}/v1/responses",
                          json={"model": "tiny", "input": "hello", "max_output_tokens": 2})
        assert fresh.status_code == 200 and fresh.headers["x-kvhint-worker"] == "w0"
    assert _w0_requests(stack) == served_by_w0 + 1  # only the fresh one


def _w0_requests(stack: Stack) -> float:
    text = httpx.get(f"{stack.router.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvhint_router_requests_total{") and 'worker="w0"' in line)
