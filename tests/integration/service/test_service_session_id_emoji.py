"""Emoji ZWJ sequences in session ids (safe_text.py): a zero width joiner (U+200D) was
refused wherever it stood, so an agent naming its sessions "👨‍👩‍👧" or "🧑‍💻-7" got a
400. Between two pictographs it is an emoji, and passes, here and in the admin API's
paths (one rule); anywhere else it still hides text and is refused, as bidi controls,
tag characters and every other format character are."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from kvhint.router.safe_text import escaped, unsafe_char
from kvhint.router.service.inbound import BadRequest, check_session_id

from conftest import StubWorker, router_settings, running_router

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
TENANTS = [{"name": "a", "api_keys": ["key-a"], "admin_keys": ["admin-a"]}]
KEY_A = {"authorization": "Bearer key-a"}
ADMIN_A = {"authorization": "Bearer admin-a"}

EMOJI = {
    "family": "\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "rainbow_flag": "\U0001f3f3\ufe0f\u200d\U0001f308",          # after U+FE0F
    "technologist_skin_tone": "\U0001f469\U0001f3fd\u200d\U0001f4bb",  # after a tone
    "head_shaking": "\U0001f642\u200d\u2194\ufe0f",              # to a text-default one
    "in_an_id": "agent-\U0001f9d1\u200d\U0001f4bb/run:7",
    "presentation_selector": "\u2764\ufe0f",                    # U+FE0F alone: Mn
    "keycap": "#\ufe0f\u20e3",
}

STILL_REFUSED = {
    "letters": "ad\u200dmin",
    "after_a_letter": "a\u200d\U0001f468",
    "before_a_letter": "\U0001f468\u200da",
    "leading": "\u200d\U0001f468",
    "trailing": "\U0001f468\u200d",
    "doubled": "\U0001f468\u200d\u200d\U0001f469",
    "after_a_lone_tone": "\U0001f3fb\u200d\U0001f468",
    "before_a_bidi_override": "\U0001f468\u200d\u202e\U0001f469",
    "zwnj": "\U0001f468\u200c\U0001f469",
    # Tag characters (Cf) are invisible: a subdivision flag is refused with them.
    "tag_flag": "\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
}


@pytest.mark.parametrize("value", EMOJI.values(), ids=EMOJI.keys())
def test_emoji_sequences_pass(value: str) -> None:
    assert unsafe_char(value) is None
    assert escaped(value) == value
    assert check_session_id(value) == value


@pytest.mark.parametrize("value", STILL_REFUSED.values(), ids=STILL_REFUSED.keys())
def test_a_joiner_elsewhere_is_refused(value: str) -> None:
    assert unsafe_char(value) is not None
    with pytest.raises(BadRequest, match="control characters") as refused:
        check_session_id(value)
    assert refused.value.rejection == "bad_session_id"
    assert unsafe_char(refused.value.message) is None


def test_the_refusal_names_the_joiner_that_hides_text() -> None:
    """The first U+200D is an emoji's; the message names the second, at its index
    (before, ``value.index`` named the first one's)."""
    value = EMOJI["family"] + " ad\u200dmin"
    with pytest.raises(BadRequest) as refused:
        check_session_id(value)
    at = len(EMOJI["family"]) + len(" ad")
    assert value[at] == "\u200d"
    assert f"'\\u200d' at {at}" in refused.value.message
    assert escaped(value) == EMOJI["family"] + " ad\\u200dmin"


async def test_an_emoji_session_is_served_and_read_and_ended_by_its_admin(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS)
    session = EMOJI["family"]
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        turn = await client.post(f"{router.url}/v1/chat/completions", headers=KEY_A,
                                 json={**CHAT, "session_id": session})
        assert turn.status_code == 200, turn.text
        turn = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                                 headers={**KEY_A, "x-session-id": session.encode()})
        assert turn.status_code == 200, turn.text
        assert router.runtime.sessions.get("a", session).turns == 2
        path = f"{router.url}/admin/sessions/a/{quote(session)}"
        read = await client.get(path, headers=ADMIN_A)
        assert read.status_code == 200, read.text
        listed = await client.get(f"{router.url}/admin/hints",
                                  params={"session_id": session}, headers=ADMIN_A)
        assert listed.status_code == 200, listed.text
        ended = await client.post(f"{path}/end", headers=ADMIN_A)
        assert ended.status_code == 200, ended.text
