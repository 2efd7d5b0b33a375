"""The dashboard, which holds an admin key, as a page (security review).

Client-controlled strings reach it as text, never as markup. Session ids (body
``session_id``, ``X-Session-ID``, ``prompt_cache_key``) and tool names from a worker's
response go through a real router into ``/admin/overview``;
the page's own script (under Node.js, as in test_service_dashboard_render) draws them,
and what it wrote with ``innerHTML`` is parsed as a browser would: only the page's own
tags, no event-handler attribute, and each hostile string back as a cell's text.

Its responses (the page and the refusal of ``?key=``) are never content-sniffed."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import StubWorker, router_settings, running_router
from test_service_dashboard_render import needs_node, render

# Tags the page's own script writes; anything else came from data.
_PAGE_TAGS = {"tr", "th", "td", "div", "span", "i", "line", "text", "path"}

HOSTILE = ["<img src=x onerror=alert(1)>", "\"><script>alert(2)</script>",
           "'><svg onload=alert(3)>", "a&amp;b"]


class _Markup(HTMLParser):
    """Tags, attribute names and text cells of an HTML fragment, as a browser parses it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attributes: set[str] = set()
        self.cells: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attributes.update(name for name, _ in attrs)
        if tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def parse(fragment: str) -> _Markup:
    markup = _Markup()
    markup.feed(fragment)
    markup.close()
    return markup


def assert_only_the_pages_markup(elements: dict[str, Any]) -> None:
    """What the script wrote with innerHTML holds the page's own tags, no handler."""
    for element, fragment in elements.items():
        if not fragment["innerHTML"]:
            continue
        markup = parse(fragment["innerHTML"])
        assert markup.tags <= _PAGE_TAGS, (element, markup.tags)
        assert not any(name.startswith("on") for name in markup.attributes), element


@needs_node
async def test_hostile_session_ids_and_tool_names_render_as_text(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    worker = stub_workers[0]
    worker.tool_names = HOSTILE
    worker.finish_reason = "tool_calls"
    settings = router_settings(tmp_path, [("w0", worker.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for where, session in zip(("session_id", "X-Session-ID", "prompt_cache_key"),
                                  HOSTILE, strict=False):
            body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4}
            headers: dict[str, str] = {}
            if where == "X-Session-ID":
                headers["x-session-id"] = session
            else:
                body[where] = session
            response = await client.post(f"{router.url}/v1/chat/completions", json=body,
                                         headers=headers)
            assert response.status_code == 200, response.text
        overview = (await client.get(f"{router.url}/admin/overview")).json()
    assert {s["session_id"] for s in overview["sessions"]} == set(HOSTILE[:3])
    assert all(s["open_gap"]["tools"] == sorted(HOSTILE) for s in overview["sessions"])
    elements = render(tmp_path, overview, overview["now"])
    assert elements["err"]["textContent"] == ""
    assert_only_the_pages_markup(elements)
    cells = parse(elements["sessions"]["innerHTML"]).cells
    for session in HOSTILE[:3]:
        assert session in cells  # shown, as its own text
    assert ",".join(sorted(HOSTILE)) in cells  # the open gap's tool names, as text


# Maps whose keys are data (worker ids, outcome names), not field names.
_DATA_KEYED = {"by_worker", "hint_status_counts"}


def hostile(value: Any, number: list[int], keys: bool = False) -> Any:
    """``value`` with every string in it replaced by a hostile one (each different:
    ``number`` counts them), and the keys of the maps keyed by data; numbers, booleans,
    nulls and field names kept."""
    if isinstance(value, str):
        number[0] += 1
        return f"{HOSTILE[number[0] % 3]}{number[0]}"  # each one markup if raw
    if isinstance(value, list):
        return [hostile(v, number) for v in value]
    if isinstance(value, dict):
        return {(hostile(k, number) if keys else k): hostile(v, number, k in _DATA_KEYED)
                for k, v in value.items()}
    return value


@needs_node
async def test_every_string_of_the_overview_renders_as_text(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """What else reaches the page from outside (worker ids and epochs from any NATS
    publisher's heartbeat, a worker's outcome reasons, tenant names, hint fields, the
    timeline's per-worker keys): a real overview, with a hint row and a timeline point
    of the router's shapes added, every string in it made hostile."""
    worker = stub_workers[0]
    worker.tool_names, worker.finish_reason = ["t"], "tool_calls"
    settings = router_settings(tmp_path, [("w0", worker.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        response = await client.post(f"{router.url}/v1/chat/completions", json={
            "model": "stub", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "session_id": "s"})
        assert response.status_code == 200
        overview = (await client.get(f"{router.url}/admin/overview")).json()
    now = overview["now"]
    overview["hints"] = [{
        "action_id": "a", "tenant": "default", "session_id": "s", "worker_id": "w0",
        "action_type": "pin", "source": "planner", "trigger": "tool_gap",
        "status": "released", "reason": "r", "requested_blocks": 3, "applied_blocks": 2,
        "created_at": now - 5, "release_reason": "evicted", "released_at": now - 1,
        "held_after_release_blocks": 1}]
    overview["hint_status_counts"] = {"accepted": 1, "rejected": 2}
    overview["timeline"] = [{"at": now, "requests": 1, "prompt_tokens": 40,
                             "cached_tokens": 32, "predicted_cached_tokens": 30,
                             "cached_share": 0.8,
                             "by_worker": {"w0": {"prompt_tokens": 40, "cached_tokens": 32,
                                                  "cached_share": 0.8}}}]
    overview["sessions"][0]["planner"]["protection"] = {"action_type": "pin", "blocks": 2}
    overview["workers"][0]["epoch"] = "e"
    overview["workers"][0]["stream"] = {"phase": "live", "applied_seq": 4}
    # Another engine heartbeating under the worker's id: its address and epoch are any
    # NATS publisher's (test_service_dashboard_render makes a real one).
    overview["workers"][0]["conflict"] = {"other_epoch": "e2", "other_url": "http://x",
                                          "found_s_ago": 3.0, "other_heard_s_ago": 1.0}
    overview["workers"][0]["status"] = {"usage": {"kv_usage": 0.5, "pinned_blocks": 1,
                                                  "retained_blocks": 2}}
    before = render(tmp_path, overview, now)
    assert before["err"]["textContent"] == ""
    elements = render(tmp_path, hostile(overview, [0]), now)
    assert elements["err"]["textContent"] == ""
    assert_only_the_pages_markup(elements)
    for element, fragment in elements.items():  # only the text changed
        assert (parse(fragment["innerHTML"]).attributes
                == parse(before[element]["innerHTML"]).attributes), element
    assert "<img" not in elements["legend"]["innerHTML"]  # per-worker timeline keys


@pytest.mark.parametrize("value", HOSTILE)
def test_the_markup_check_sees_an_unescaped_string(value: str) -> None:
    """The check above would catch a string written raw (what it guards against)."""
    markup = parse(f"<tr><td>{value}</td></tr>")
    caught = (not markup.tags <= _PAGE_TAGS
              or any(name.startswith("on") for name in markup.attributes)
              or value not in markup.cells)
    assert caught


async def test_the_page_and_its_refusal_are_not_content_sniffed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """Both carried a strict CSP, no-referrer, DENY and no-store, but no ``nosniff``."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        page = await client.get(f"{router.url}/dashboard")
        refused = await client.get(f"{router.url}/dashboard?key=root")
    assert (page.status_code, refused.status_code) == (200, 400)
    for response in (page, refused):
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["referrer-policy"] == "no-referrer"
        assert response.headers["cache-control"] == "no-store"
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert "'unsafe-inline'" not in page.headers["content-security-policy"].split(
        "script-src")[1].split(";")[0]


async def test_admin_answers_are_not_cached_or_content_sniffed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """The admin API's answers (tenants' sessions and hints, what the dashboard reads)
    carried neither no-store nor nosniff."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"])
    auth = {"authorization": "Bearer root"}
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for path in ("/admin/overview", "/admin/sessions", "/admin/workers", "/admin/hints"):
            answer = await client.get(f"{router.url}{path}", headers=auth)
            assert answer.status_code == 200, path
            assert answer.headers["cache-control"] == "no-store", path
            assert answer.headers["x-content-type-options"] == "nosniff", path


async def test_a_workers_answer_is_never_served_as_html_from_the_routers_origin(
        tmp_path: Path) -> None:
    """A worker's answer kept its own Content-Type: a proxy's HTML error page in front
    of a worker, or a worker a forged heartbeat pointed elsewhere, was served as HTML from
    the origin whose dashboard keeps an admin key for its tab. Now only JSON, event
    streams and plain text pass as they are; anything else is plain text, never
    sniffed. (The stub stands in for that page: no real vLLM answers HTML.)"""
    stub = StubWorker()
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}
        async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
            for stream in (False, True):
                ok = await client.post(f"{router.url}/v1/chat/completions",
                                       json={**body, "stream": stream})
                assert ok.status_code == 200
                assert ok.headers["content-type"].startswith(
                    "text/event-stream" if stream else "application/json")
                assert ok.headers["x-content-type-options"] == "nosniff"
            for mode in ("html:400", "html:200"):
                stub.mode = mode
                for stream in (False, True):
                    page = await client.post(f"{router.url}/v1/chat/completions",
                                             json={**body, "stream": stream})
                    assert page.headers["content-type"].startswith("text/plain"), (mode, stream)
                    assert page.headers["x-content-type-options"] == "nosniff"
                    assert "<script>" in page.text  # relayed, as text
    finally:
        await stub.stop()
