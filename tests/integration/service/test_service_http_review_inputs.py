"""Inputs the router's HTTP surface took badly (review of its surface): each was a 500
("internal router error"), where the standard is a 4xx with a message for a client's
bad input, and one worker's bad answer never failing what the others can serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, sample, scrape, serving

TENANTS = [{"name": "a", "api_keys": ["key-a"]}]
KEY_A = {"authorization": "Bearer key-a"}


class ListingWorker(StubWorker):
    """A worker whose /v1/models answer is ``listing`` (a worker behind a proxy of its
    own, or one a forged heartbeat points at, answers what it likes)."""

    listing: Any = None

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response(self.listing)


@pytest.mark.parametrize("listing", [
    {"object": "list", "data": 5},
    {"object": "list", "data": None},
    {"object": "list", "data": [{"id": ["stub"]}, {"id": {"a": 1}}]},
])
async def test_a_malformed_model_listing_leaves_the_other_workers_models_listed(
        tmp_path: Path, tiny_model_dir: Path, listing: Any) -> None:
    """A listing whose ``data`` is no array, or whose ids are no strings (unhashable):
    before, every client's /v1/models was a 500 while that worker answered so. Now
    that worker's listing is read as no answer, as one that is not JSON was already."""
    odd = ListingWorker(model_root=str(tiny_model_dir))
    odd.listing = listing
    async with serving([StubWorker(model_root=str(tiny_model_dir)), odd]) as (good, _):
        settings = router_settings(tmp_path, [("w0", good.url), ("w1", odd.url)],
                                   tenants=TENANTS)
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            answer = await client.get(f"{router.url}/v1/models", headers=KEY_A)
            assert answer.status_code == 200, answer.text
            assert [m["id"] for m in answer.json()["data"]] == ["stub"]
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_drops_total", what="internal_error") is None


async def test_a_content_part_whose_type_is_not_a_string_is_no_router_error(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A tenant's (salted) request with a media part whose ``type`` is an array or an
    object: before, the router's media check raised on it (a 500, counted as its own
    internal error); now the part goes on as sent, for vLLM to refuse (400)."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        for kind in (["image_url"], {"image_url": 1}):
            part = {"type": kind, "image_url": {"url": "data:image/png;base64,AAAA"}}
            answer = await client.post(f"{router.url}/v1/chat/completions", headers=KEY_A,
                                       json={"model": "stub", "messages": [
                                           {"role": "user", "content": [part]}]})
            assert answer.status_code == 200, answer.text  # the stub worker's answer
            assert stub_workers[0].received[-1]["messages"][0]["content"] == [part]
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_drops_total", what="internal_error") is None
