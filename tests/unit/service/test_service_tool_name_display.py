"""Tool names an answer carries (the model's text, which a tenant's prompt and tool
definitions steer) reach what operators read: the session's open gap (/admin, the
dashboard), the learnt gap statistics, the traces. A bidi override or a control in one
reordered or forged what was shown; they are kept, each such character escaped
(safe_text.py), chat and Responses alike. Ordinary names are untouched."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from kvhint.router.safe_text import escaped, unsafe_char
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay

SPOOF = "get_weather\u202e)tcaer(\u200b\x85\n"
SHOWN = "get_weather\\u202e)tcaer(\\u200b\\x85\\n"


def test_escaped_keeps_ordinary_names_and_escapes_the_rest() -> None:
    for name in ("ls", "get_weather", "search.web", "天気", "café"):
        assert escaped(name) == name
    assert escaped(SPOOF) == SHOWN and unsafe_char(SHOWN) is None


def test_a_chat_answers_tool_names_are_shown_escaped() -> None:
    seen = ResponseObservation()
    body = {"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": SPOOF, "arguments": "{}"}},
        {"id": "2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2}}
    seen.observe_json(json.dumps(body).encode())
    assert seen.tool_names == [SHOWN, "ls"]


async def test_a_responses_answers_tool_names_are_shown_escaped() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": SPOOF, "arguments": "{}"}
    body = {"type": "response.completed", "sequence_number": 0, "response": {
        "id": "resp_1", "object": "response", "status": "completed", "output": [call],
        "usage": None, "error": None}}
    stream = f"event: response.completed\ndata: {json.dumps(body)}\n\n".encode()

    async def source() -> AsyncIterator[bytes]:
        yield stream

    observation = ResponsesObservation()
    assert b"".join([c async for c in ResponsesRelay(observation).relay(source())]) == stream
    assert observation.tool_names == [SHOWN]
