"""Session ids that would spoof what an operator reads (security review): C1 controls and
Unicode bidi, zero-width and other format characters passed the gateway's check (C0
and DEL only), so an id could reorder a log line or a dashboard row, hide part of
itself, or (U+0085, U+2028) break a line where a viewer reads one. Refused wherever a
session id comes in, as the C0 ones are, and counted."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from kvhint.router.safe_text import unsafe_char
from kvhint.router.service.inbound import BadRequest, check_session_id

from conftest import StubWorker, router_settings, running_router, sample, scrape

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
TENANTS = [{"name": "a", "api_keys": ["key-a"], "admin_keys": ["admin-a"]}]
KEY_A = {"authorization": "Bearer key-a"}
ADMIN_A = {"authorization": "Bearer admin-a"}

# Each one passed before; every one is a way to make an id read as something else.
SPOOFING = {
    "c1_nel": "s\x851",            # NEL: a line break to some log viewers
    "c1_csi": "s\x9b31m",          # 8-bit CSI: a terminal escape
    "rlo": "user\u202egnp.exe",    # right-to-left override
    "lri": "a\u20661\u2069",       # isolates
    "lrm": "a\u200e",
    "rlm": "a\u200f",
    "alm": "a\u061c",
    "zwsp": "ad\u200bmin",         # zero width: looks like "admin"
    "zwj": "a\u200d",
    "bom": "\ufeffa",
    "line_separator": "a\u2028b",
    "soft_hyphen": "a\u00adb",     # Cf too
}


@pytest.mark.parametrize("value", SPOOFING.values(), ids=SPOOFING.keys())
def test_spoofing_characters_are_unsafe(value: str) -> None:
    assert unsafe_char(value) is not None
    with pytest.raises(BadRequest, match="control characters") as refused:
        check_session_id(value)
    assert refused.value.rejection == "bad_session_id"
    # The message names the character escaped, never echoes it raw.
    assert unsafe_char(refused.value.message) is None


def test_ordinary_ids_still_pass() -> None:
    for value in ("s1", "agent-7/run:42", "café", "日本語のセッション", "Ωmega id", "a~b_c.d"):
        assert check_session_id(value) == value


async def test_spoofing_session_ids_are_refused_everywhere_and_counted(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        refused = 0
        for value in SPOOFING.values():
            for field in ("session_id", "prompt_cache_key"):
                for path, body in (("/v1/chat/completions", CHAT),
                                   ("/v1/completions", {"model": "stub", "prompt": "hi"}),
                                   ("/v1/responses", {"model": "stub", "input": "hi"})):
                    response = await client.post(f"{router.url}{path}", headers=KEY_A,
                                                 json={**body, field: value})
                    assert response.status_code == 400, (path, field, value, response.text)
                    error = response.json()["error"]
                    assert "control characters" in error["message"]
                    assert error["param"] == field
                    refused += 1
        # A header's bytes are read as UTF-8 where they are UTF-8 (a bidi override,
        # U+202E: E2 80 AE, is that character), else as Latin-1 (a lone C1 byte).
        for raw in (b"s\x851", "user\u202egnp".encode()):
            response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                                         headers={**KEY_A, "x-session-id": raw})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "X-Session-ID"
            refused += 1
        assert stub_workers[0].received == []

        for value in SPOOFING.values():
            ended = await client.delete(f"{router.url}/v1/sessions/{quote(value)}",
                                        headers=KEY_A)
            assert ended.status_code == 400, (value, ended.text)
            hinted = await client.post(f"{router.url}/v1/sessions/{quote(value)}/hints",
                                       headers=ADMIN_A, json={"actions": []})
            assert hinted.status_code == 400, (value, hinted.text)
            assert "control characters" in hinted.json()["error"]["message"]

        # Ordinary ids, the same routes: not refused for their characters.
        ok = await client.post(f"{router.url}/v1/chat/completions", headers=KEY_A,
                               json={**CHAT, "session_id": "café-1"})
        assert ok.status_code == 200, ok.text
        # A non-ASCII id in the header is the body's id: UTF-8, as clients send it. Read
        # as Latin-1, "€" (E2 82 AC) held a C1 control (0x82) and was refused.
        for carried in ({"headers": {**KEY_A, "x-session-id": "€-1".encode()},
                         "json": CHAT},
                        {"headers": KEY_A, "json": {**CHAT, "session_id": "€-1"}}):
            turn = await client.post(f"{router.url}/v1/chat/completions", **carried)
            assert turn.status_code == 200, turn.text
        assert router.runtime.sessions.get("a", "€-1").turns == 2

        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="a",
                      reason="bad_session_id") == refused
        assert sample(samples, "kvhint_router_session_end_rejections_total",
                      reason="bad_request") == len(SPOOFING)
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="bad_request") == len(SPOOFING)
