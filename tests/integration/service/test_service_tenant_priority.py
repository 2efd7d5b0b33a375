"""A request's ``priority`` through the real router to stand-in workers: a tenant's key
may send only what its ``tenants[].priority`` bounds allow (default: none but vLLM's
0), so no tenant moves its requests ahead of another's on workers scheduling by
priority; dev mode is not bounded, and a global admin's own traffic only by a configured
``default`` tenant's bounds. And ``stream`` as vLLM reads it ("true" streams)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from conftest import StubWorker, router_settings, running_router, sample, scrape

TENANTS = [{"name": "acme", "api_keys": ["ka"]},
           {"name": "beta", "api_keys": ["kb"], "priority": {"min": -5, "max": 5}}]
ACME, BETA = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
ROOT = {"Authorization": "Bearer root"}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
}


async def test_a_tenant_key_sends_only_the_priority_its_tenant_allows(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [(f"w{i}", w.url) for i, w in enumerate(stub_workers)],
                               tenants=TENANTS, admin_keys=["root"])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        refused = 0
        for path, body in BODIES.items():
            # acme (default bounds): any priority but 0 is refused, as vLLM reads it.
            for value in (-1, -100, "-1", 1, True, "x"):
                answer = await client.post(router.url + path, json={**body, "priority": value},
                                           headers=ACME)
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["param"] == "priority", error
                refused += 1
            # beta: -5 to 5.
            answer = await client.post(router.url + path, json={**body, "priority": -6},
                                       headers=BETA)
            assert answer.status_code == 400 and "from -5 to 5" in answer.text, answer.text
            refused += 1
        assert all(w.received == [] for w in stub_workers)  # nothing reached a worker

        sent = []
        for path in ("/v1/chat/completions", "/v1/completions"):
            for headers, value in ((ACME, 0), (ACME, "0"), (BETA, -5), (BETA, 5), (ROOT, -100)):
                answer = await client.post(router.url + path,
                                           json={**BODIES[path], "priority": value},
                                           headers=headers)
                assert answer.status_code == 200, answer.text
                sent.append(value)
        received = [body["priority"] for w in stub_workers for body in w.received]
        assert sorted(map(repr, received)) == sorted(map(repr, sent))

        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="acme",
                      reason="priority_not_allowed") == refused - 3
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="beta",
                      reason="priority_not_allowed") == 3


async def test_a_configured_default_bounds_the_global_admins_own_traffic(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A keyless ``default`` in the config sets the global admin's own traffic's limits:
    its ``priority`` bounds that traffic as any tenant's bound its keys (0 to 0 unless
    set); with none configured (the test above) that traffic has no bounds."""
    for default, allowed, refused in (({"name": "default"}, (0,), (-1, 1)),
                                      ({"name": "default", "priority": {"min": -2, "max": 0}},
                                       (-2, 0), (-3, 1))):
        settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                                   tenants=[TENANTS[0], default], admin_keys=["root"])
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = router.url + "/v1/chat/completions"
            for value in allowed:
                answer = await client.post(url, json={**BODIES["/v1/chat/completions"],
                                                      "priority": value}, headers=ROOT)
                assert answer.status_code == 200, answer.text
            for value in refused:
                answer = await client.post(url, json={**BODIES["/v1/chat/completions"],
                                                      "priority": value}, headers=ROOT)
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["param"] == "priority"
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_gateway_rejections_total",
                          tenant="default", reason="priority_not_allowed") == len(refused)


async def test_dev_mode_passes_any_priority_on(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """No key configured: every request is the operator's own, as before."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(router.url + "/v1/chat/completions",
                                   json={**BODIES["/v1/chat/completions"], "priority": -100})
        assert answer.status_code == 200, answer.text
        assert stub_workers[0].received[-1]["priority"] == -100


async def test_a_stream_asked_as_vllm_reads_it_is_relayed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """``"stream": "true"`` (a string vLLM reads as true) streams, with the usage chunk
    the router asked for stripped; 0 does not stream."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = router.url + "/v1/chat/completions"
        for value in ("true", "1", "yes", 1):
            answer = await client.post(url, json={**BODIES["/v1/chat/completions"],
                                                  "stream": value})
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"].startswith("text/event-stream")
            assert '"usage"' not in answer.text and "[DONE]" in answer.text
            assert stub_workers[0].received[-1]["stream_options"] == {"include_usage": True}
        # (0, not "false": the stand-in reads the JSON value's truth, as vLLM does not.)
        answer = await client.post(url, json={**BODIES["/v1/chat/completions"], "stream": 0})
        assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
