"""The dashboard's admin key never travels in a URL (security review: ``?key=`` was in
the request line, which proxies and access logs record). The page takes it from its
fragment (``#key=``, which browsers never send), keeps it in sessionStorage, takes it
out of the address bar and sends it in ``Authorization``; ``/dashboard?key=`` is
refused and counted; the admin API takes no key from the query string."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import StubWorker, router_settings, running_router, sample, scrape
from kvhint.router.service.dashboard import KEY_IN_QUERY

# Runs the page's <script>, as the router served it, in Node.js with the URL parts given,
# its fetch going to the real router; prints what the script did and showed.
_HARNESS = r"""
const fs = require("fs"), vm = require("vm");
const [pageFile, base, search, hash] = process.argv.slice(2);
const script = fs.readFileSync(pageFile, "utf8").match(/<script>([\s\S]*)<\/script>/)[1];
const elements = {}, fetched = [], answers = [], replaced = [], session = {},
      local = {kvhintKey: "old"};
const element = id => elements[id] ??= {textContent: "", innerHTML: "", className: "",
                                        clientWidth: 800, clientHeight: 200};
const store = data => ({getItem: k => data[k] ?? null, setItem: (k, v) => { data[k] = v; },
                        removeItem: k => { delete data[k]; }});
const context = vm.createContext({
  document: {getElementById: element},
  localStorage: store(local), sessionStorage: store(session),
  location: {search, hash, pathname: "/dashboard"},
  history: {replaceState: (state, title, url) => replaced.push(url)},
  fetch: (path, options) => {
    fetched.push({path, options});
    const answer = fetch(base + path, options);
    answers.push(answer);
    return answer;
  },
  setInterval: () => 0, URLSearchParams, Date, Math, Object, JSON, Number, String, Set,
});
vm.runInContext(script, context);
// Once the poll's answer is in and drawn (or shown as an error): what the page did.
Promise.allSettled(answers).then(() => setTimeout(() => {
  console.log(JSON.stringify({fetched, replaced, session, local,
                              err: element("err").textContent}));
  process.exit(0);
}, 200));
"""

needs_node = pytest.mark.skipif(shutil.which("node") is None,
                                reason="Node.js is not installed")


async def run_page(tmp_path: Path, page: str, base: str, search: str, hash_: str
                   ) -> dict[str, Any]:
    """Not blocking the event loop: the router it asks runs on it."""
    (tmp_path / "page.html").write_text(page)
    (tmp_path / "harness.js").write_text(_HARNESS)
    node = await asyncio.create_subprocess_exec(
        "node", str(tmp_path / "harness.js"), str(tmp_path / "page.html"), base, search,
        hash_, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(node.communicate(), 60)
    assert node.returncode == 0, err.decode()
    return json.loads(out)


@needs_node
async def test_the_page_takes_the_key_from_its_fragment_and_sends_it_in_a_header(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        page = await client.get(f"{router.url}/dashboard")
        assert page.status_code == 200
        shown = await run_page(tmp_path, page.text, router.url, "", "#key=root")
        # The query string is no way in any more: the page does not read it.
        ignored = await run_page(tmp_path, page.text, router.url, "?key=root", "")
    [call] = shown["fetched"]
    assert call["path"] == "/admin/overview"  # no key in the URL it asks
    assert call["options"]["headers"] == {"Authorization": "Bearer root",
                                          "X-Kvhint-Request": "dashboard"}
    assert shown["err"] == ""  # the real router's overview loaded with that key
    assert shown["session"] == {"kvhintKey": "root"}
    assert shown["local"] == {}  # what older pages kept there for good is gone
    assert shown["replaced"] == ["/dashboard"]  # out of the address bar and history
    [call] = ignored["fetched"]
    assert call["options"]["headers"] == {"X-Kvhint-Request": "dashboard"}
    assert ignored["session"] == {}
    assert "401" in ignored["err"] and "/dashboard#key=ADMIN_KEY" in ignored["err"]


async def test_a_key_in_the_query_string_is_refused_by_the_page_and_the_admin_api(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        refused = await client.get(f"{router.url}/dashboard?key=root")
        served = await client.get(f"{router.url}/dashboard")
        overview = await client.get(f"{router.url}/admin/overview?key=root")
        with_header = await client.get(f"{router.url}/admin/overview",
                                       headers={"authorization": "Bearer root"})
        samples = await scrape(client, router.url)
    assert refused.status_code == 400 and refused.text == KEY_IN_QUERY
    assert "root" not in refused.text
    assert refused.headers["content-security-policy"] == "default-src 'none'"
    assert refused.headers["referrer-policy"] == "no-referrer"
    assert refused.headers["cache-control"] == "no-store"
    assert sample(samples, "kvhint_router_drops_total", what="dashboard_key_in_query") == 1
    assert served.status_code == 200 and "#key=" in served.text
    assert overview.status_code == 401
    assert with_header.status_code == 200
