"""The dashboard's own script renders a real router's ``/admin/overview`` (run under
Node.js with a minimal stand-in for the page's DOM: only the elements it writes to)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import router_hearing_nats, router_with_accepting_plugin, status, until
from kvhint.router.service.settings import RouterSettings
from kvhint.schemas import Subjects, new_epoch
from test_service_admin_session_ends import _abandon
from test_service_sessions_api_contract import _turn

DASHBOARD = (Path(__file__).resolve().parents[3] / "router" / "service" / "static"
             / "dashboard.html")

# Runs the page's <script> against a recorded overview, with the browser's clock at
# ``browser_now`` (s), and prints what it wrote into each element.
_HARNESS = r"""
const fs = require("fs"), vm = require("vm");
const [page, overviewFile, browserNow] = process.argv.slice(2);
const overview = JSON.parse(fs.readFileSync(overviewFile, "utf8"));
const script = fs.readFileSync(page, "utf8").match(/<script>([\s\S]*)<\/script>/)[1];
const elements = {};
const element = id => elements[id] ??= {textContent: "", innerHTML: "", className: "",
                                        clientWidth: 800, clientHeight: 200};
Date.now = () => Number(browserNow) * 1000;
const context = vm.createContext({
  document: {getElementById: element},
  localStorage: {getItem: () => null, setItem: () => {}, removeItem: () => {}},
  sessionStorage: {getItem: () => null, setItem: () => {}},
  location: {search: "", hash: "", pathname: "/dashboard"},
  history: {replaceState: () => {}},
  fetch: async () => ({ok: true, json: async () => overview}),
  setInterval: () => 0, URLSearchParams, Date, Math, Object, JSON, Number, String, Set,
});
vm.runInContext(script, context);
setTimeout(() => console.log(JSON.stringify(elements)), 50);
"""


needs_node = pytest.mark.skipif(shutil.which("node") is None,
                                reason="Node.js is not installed")


def render(tmp_path: Path, overview: dict[str, Any], browser_now: float) -> dict[str, Any]:
    """What the dashboard's script wrote into each element for ``overview``."""
    (tmp_path / "overview.json").write_text(json.dumps(overview))
    (tmp_path / "harness.js").write_text(_HARNESS)
    run = subprocess.run(
        ["node", str(tmp_path / "harness.js"), str(DASHBOARD), str(tmp_path / "overview.json"),
         str(browser_now)], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(run.stdout)


async def _overview_after_a_turn(settings: RouterSettings, api_key: str | None,
                                 admin_key: str | None) -> dict[str, Any]:
    def auth(key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"} if key else {}

    async with running_router(settings) as router, httpx.AsyncClient() as client:
        response = await client.post(f"{router.url}/v1/chat/completions", json={
            "model": "stub", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "session_id": "s1"}, headers=auth(api_key))
        assert response.status_code == 200
        overview = await client.get(f"{router.url}/admin/overview", headers=auth(admin_key))
        assert overview.status_code == 200
        return overview.json()


@needs_node
async def test_ages_are_counted_on_the_routers_clock_not_the_browsers(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    overview = await _overview_after_a_turn(
        router_settings(tmp_path, [("w0", stub_workers[0].url)]), None, None)
    [session] = overview["sessions"]
    # The router saw the session's last activity 7 s before its "now"; the browser's
    # clock is an hour behind the router's (before, every age read "0s ago").
    overview["now"] = session["last_activity"] + 7
    elements = render(tmp_path, overview, overview["now"] - 3600)
    assert elements["err"]["textContent"] == ""
    assert "s1" in elements["sessions"]["innerHTML"]
    assert "<td>7s ago</td>" in elements["sessions"]["innerHTML"]
    assert "w0" in elements["workers"]["innerHTML"]


@needs_node
async def test_a_tenant_admins_overview_renders_without_the_fleets_figures(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A tenant admin's overview has nulls where the fleet's traffic would be."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"],
                               tenants=[{"name": "a", "api_keys": ["ka"],
                                         "admin_keys": ["aa"]}])
    overview = await _overview_after_a_turn(settings, "ka", "aa")
    assert overview["totals"] is None
    elements = render(tmp_path, overview, overview["now"])
    assert elements["err"]["textContent"] == ""
    assert elements["share"]["textContent"] == "–"
    assert elements["reqs"]["textContent"] == "–"
    assert "s1" in elements["sessions"]["innerHTML"]
    workers = elements["workers"]["innerHTML"]
    assert "w0" in workers and "undefined" not in workers and "null" not in workers


@needs_node
@pytest.mark.usefixtures("throwaway_streams")
async def test_a_worker_id_conflict_shows_in_the_workers_table(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines heartbeating under one worker id (over a real NATS server, as in
    test_service_feed_id_conflict): the overview's worker has a ``conflict``, which the
    workers table showed nowhere. Now its row names the other engine's address and
    epoch; a worker without one shows "–" there. Reported at once here
    (conflict_confirm_s 0, not the 5 min a rollout's overlap is told apart by)."""
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_CONFIRM_S", "0")
    subjects = Subjects(subject_prefix)
    first, second = new_epoch(1_000.0), new_epoch(2_000.0)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, client, nc):
        runtime = router.runtime
        await nc.publish(subjects.status("w1"), status("w1", first, 0, "http://w1:8000"))
        beats = [(first, "http://127.0.0.1:1"), (second, "http://127.0.0.1:2")]
        for n in range(40):  # taken as a restart first, then both keep beating
            epoch, url = beats[n % 2]
            await nc.publish(subjects.status("w0"), status("w0", epoch, 0, url))
            await asyncio.sleep(0.1)
            if runtime.ingestor.conflicting_workers():
                break
        await until(lambda: runtime.ingestor.conflicting_workers() == ("w0",))
        await until(lambda: runtime.workers.get("w1") is not None)
        overview = (await client.get(f"{router.url}/admin/overview")).json()
    (w0,) = [w for w in overview["workers"] if w["worker_id"] == "w0"]
    conflict = w0["conflict"]
    assert conflict is not None and conflict["other_epoch"] != w0["epoch"]
    elements = render(tmp_path, overview, overview["now"])
    assert elements["err"]["textContent"] == ""
    rows = elements["workers"]["innerHTML"].split("</tr>")
    assert "<th>id conflict</th>" in rows[0]
    (row0,) = [r for r in rows if "<td>w0</td>" in r]
    shown = (f"<td class=bad>another engine: {conflict['other_url']} "
             f"(epoch {conflict['other_epoch']}), heard ")
    assert shown in row0, row0
    (row1,) = [r for r in rows if "<td>w1</td>" in r]
    assert row1.endswith("<td class=>–</td>"), row1


@needs_node
@pytest.mark.usefixtures("throwaway_streams")
async def test_the_sessions_table_tells_a_client_end_from_an_abandonment(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Both sessions are ``state: ended``; the overview's ``planner.ended_explicitly``
    tells them apart, which the table did not show (both read "ended"). A session not
    ended shows its state alone."""
    async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                            stub_workers[0], hints={"tick_s": 0.1}
                                            ) as (router, client, _):
        for session in ("deleted", "abandoned"):
            await _turn(client, router.url, session)
        assert (await client.delete(f"{router.url}/v1/sessions/deleted")).status_code == 200
        planner_config = router.runtime.hints.planner_config
        await _abandon(router.runtime, "abandoned")
        router.runtime.hints.planner_config = planner_config  # "active" is not abandoned
        await _turn(client, router.url, "active")
        overview = (await client.get(f"{router.url}/admin/overview")).json()
    elements = render(tmp_path, overview, overview["now"])
    assert elements["err"]["textContent"] == ""
    rows = {row.split("</td>")[1].removeprefix("<td>"): row  # by the session column
            for row in elements["sessions"]["innerHTML"].split("</tr>")[1:-1]}
    assert set(rows) == {"deleted", "abandoned", "active"}
    assert '<td title="ended by its client or an admin">ended (client)</td>' in rows["deleted"]
    assert ('<td title="abandoned by the planner when idle">ended (idle)</td>'
            in rows["abandoned"])
    assert "<td>active</td>" in rows["active"] and "ended" not in rows["active"]
