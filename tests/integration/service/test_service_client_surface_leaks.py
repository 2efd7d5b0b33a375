"""What the router's client surface showed that is no client's business (a security
review): a worker's model path in ``/v1/models``, a worker's error page relayed as JSON
without ``nosniff``, and the fleet's worker ids in ``/health`` to callers with no key.
Real router, real HTTP workers (small aiohttp servers: a vLLM model card with a path and
a proxy's HTML 503 are set per test, which a shared vLLM fixture cannot give)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, serving

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ROOT = "/srv/models/private-finetune-7b"


@dataclass
class CardWorker(StubWorker):
    """A stub whose /v1/models answers vLLM 0.32's model card (its ModelCard fields)."""

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "stub", "object": "model", "created": 1, "owned_by": "vllm",
             "root": ROOT, "parent": None, "max_model_len": 4096,
             "permission": [{"id": "modelperm-1", "object": "model_permission",
                             "allow_sampling": True}]},
            {"id": "lora-a", "object": "model", "created": 1, "owned_by": "vllm",
             "root": "/srv/adapters/lora-a", "parent": "stub", "max_model_len": 4096}]})


async def test_models_shows_no_worker_path_but_keeps_what_clients_use(
        tmp_path: Path) -> None:
    """Before, a tenant key's /v1/models carried each model's ``root``, its directory on
    the worker (a LoRA adapter's too). Now ``root`` is left out; OpenAI's fields, vLLM's
    ``max_model_len`` (clients size prompts by it), ``parent`` and ``permission`` stay.
    The router itself still reads ``root`` (the tokenizer it loads)."""
    async with serving([CardWorker()]) as (worker,):
        settings = router_settings(tmp_path, [("w0", worker.url)], admin_keys=["root-key"],
                                   tenants=[{"name": "a", "api_keys": ["ka"]}])
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            for key in ("ka", "root-key"):
                answer = await client.get(f"{router.url}/v1/models",
                                          headers={"authorization": f"Bearer {key}"})
                assert answer.status_code == 200
                assert "/srv/" not in answer.text, key
                cards = {card["id"]: card for card in answer.json()["data"]}
                assert set(cards) == {"stub", "lora-a"}
                assert cards["stub"] == {
                    "id": "stub", "object": "model", "created": 1, "owned_by": "vllm",
                    "parent": None, "max_model_len": 4096,
                    "permission": [{"id": "modelperm-1", "object": "model_permission",
                                    "allow_sampling": True}]}
                assert cards["lora-a"]["parent"] == "stub"
            assert router.runtime.models["stub"] == ROOT


async def test_a_workers_error_page_and_the_routers_own_errors_are_never_sniffed(
        tmp_path: Path) -> None:
    """A worker's (its proxy's) 502/503/504 body is relayed labelled application/json,
    whatever it is; before, without ``X-Content-Type-Options: nosniff``, on the origin
    that serves the dashboard. Now with it, as every other relayed answer; and the
    router's own error answers (401, 404, 503) carry it too."""
    async with serving([StubWorker(mode="html:503")]) as (worker,):
        settings = router_settings(tmp_path, [("w0", worker.url)], health_probe_s=30.0,
                                   tenants=[{"name": "a", "api_keys": ["ka"]}])
        auth = {"authorization": "Bearer ka"}
        async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
            page = await client.post(f"{router.url}/v1/chat/completions", headers=auth,
                                     json={**CHAT, "stream": True})
            assert page.status_code == 503 and "<script>" in page.text
            assert page.headers["content-type"] == "application/json"
            assert page.headers["x-content-type-options"] == "nosniff"
            # The worker is marked down now: the router's own 503, then its 401 and 404.
            own = [await client.post(f"{router.url}/v1/chat/completions", headers=auth,
                                     json=CHAT),
                   await client.post(f"{router.url}/v1/chat/completions", json=CHAT),
                   await client.get(f"{router.url}/v1/nothing-here", headers=auth)]
            assert [answer.status_code for answer in own] == [503, 401, 404]
            for answer in own:
                assert answer.headers["content-type"] == "application/json"
                assert answer.headers["x-content-type-options"] == "nosniff"


async def test_health_gives_counts_to_anyone_and_worker_ids_to_an_admin(
        tmp_path: Path) -> None:
    """Before, /health listed every worker's id and state to any caller. Now a caller
    without an admin key (a load balancer's probe, a tenant's key) gets counts, as from
    /ready; an admin key gets the ids too. It is 200 either way, with no URL."""
    async with serving([StubWorker(), StubWorker()]) as workers:
        settings = router_settings(tmp_path, [("gpu-a", workers[0].url),
                                              ("gpu-b", workers[1].url)],
                                   admin_keys=["root-key"],
                                   tenants=[{"name": "a", "api_keys": ["ka"]}])
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            for headers in ({}, {"authorization": "Bearer ka"},
                            {"authorization": "Bearer wrong"}):
                answer = await client.get(f"{router.url}/health", headers=headers)
                assert answer.status_code == 200
                assert "gpu-" not in answer.text and "127.0.0.1" not in answer.text, headers
                body = answer.json()
                assert body["known_workers"] == body["routable_workers"] == 2, body
                assert body["status"] == "ok" and "workers" not in body
            admin = await client.get(f"{router.url}/health",
                                     headers={"authorization": "Bearer root-key"})
            assert admin.status_code == 200 and "127.0.0.1" not in admin.text
            assert admin.json()["workers"] == {
                "gpu-a": {"http_up": True, "plugin_alive": False},
                "gpu-b": {"http_up": True, "plugin_alive": False}}
