"""A ``/v1/responses`` body becomes the chat messages, tools and flags vLLM 0.32 renders
it with: compared with vLLM's own conversion (its ResponsesRequest validation, then
``construct_input_messages``, ``construct_tool_dicts`` and
``should_continue_final_message``), on the installed vLLM. What the router cannot
reproduce is refused, not guessed. (Token ids and block hashes against a real server:
tests/e2e/service/test_service_responses_e2e.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvhint.router.hashing import HashConfig, ModelTokenizerSource, RequestHasher
from kvhint.router.hashing.errors import UnsupportedPrompt
from kvhint.router.hashing.prompts import _tool_dict
from kvhint.router.hashing.responses_input import responses_chat_body

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
           "strict": True}
BARE_TOOL = {"type": "function", "name": "ping", "parameters": None}

AGENT_TURN = [
    {"role": "system", "content": "sys"},
    {"role": "developer", "content": "dev"},
    {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
    {"id": "rs_1", "type": "reasoning", "summary": [],
     "content": [{"type": "reasoning_text", "text": "think"}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather",
     "arguments": "{\"city\": \"Paris\"}"},
    {"type": "function_call", "call_id": "c2", "name": "ping", "arguments": "{}",
     "id": "fc_2", "status": "completed"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "c2",
     "output": [{"type": "input_text", "text": "pong"}]},
    {"role": "assistant", "content": "plain"},
    {"id": "rs_2", "type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
    {"role": "user", "content": "next", "name": "bob"},
]

BODIES = {
    "string": {"input": "hello", "instructions": "be brief"},
    "agent turn": {"input": AGENT_TURN, "tools": [WEATHER, BARE_TOOL],
                   "reasoning": {"effort": "low"}},
    "tools off": {"input": "hi", "tools": [WEATHER], "tool_choice": "none"},
    "no tools": {"input": [{"role": "user", "content": "hi"}], "tools": []},
    "partial answer": {"input": [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "1, 2,", "status": "incomplete"}]},
    "calls first": {"input": [
        {"type": "function_call", "call_id": "c9", "name": "ping", "arguments": ""},
        {"type": "custom_tool_call_output", "call_id": "c9", "output": "ok"}]},
}


def _vllm(body: dict[str, Any]) -> tuple[list[Any], Any, bool]:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
        should_continue_final_message,
    )

    request = ResponsesRequest.model_validate({"model": "tiny", **body})
    messages = construct_input_messages(request_instructions=request.instructions,
                                        request_input=request.input)
    return (messages, construct_tool_dicts(request.tools, request.tool_choice),
            should_continue_final_message(request.input))


@pytest.mark.parametrize("name", sorted(BODIES))
def test_the_chat_body_is_what_vllm_renders(name: str) -> None:
    body = {"model": "tiny", **BODIES[name]}
    messages, tools, continue_final = _vllm(body)
    chat = responses_chat_body(body)
    assert chat["messages"] == messages
    # The order of a tool call's function keys too (a template may print it as JSON).
    assert [[list(call["function"]) for call in m.get("tool_calls") or ()]
            for m in chat["messages"]] == [[list(call["function"])
                                            for call in m.get("tool_calls") or ()]
                                           for m in messages]
    assert [_tool_dict(t) for t in chat.get("tools", ())] == (tools or [])
    assert chat["continue_final_message"] is continue_final
    assert chat["add_generation_prompt"] is not continue_final
    assert chat["add_special_tokens"] is True  # ResponsesRequest's tokenize params
    effort = (body.get("reasoning") or {}).get("effort")
    assert chat.get("reasoning_effort") == effort


@pytest.mark.parametrize("extra", [
    {"previous_response_id": "resp_1"},
    {"prompt": {"id": "pmpt_1"}},
    {"truncation": "auto"},
    {"tools": [{"type": "web_search_preview"}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                "namespace": "ns"}]},
    {"input": [{"id": "rs", "type": "reasoning", "summary": [], "encrypted_content": "x"}]},
    {"input": [{"type": "item_reference", "id": "msg_1"}]},
])
def test_what_the_router_cannot_reproduce_is_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedPrompt):
        responses_chat_body({"model": "tiny", "input": "hi", **extra})


def test_hashes_are_the_chat_renderings_with_special_tokens(tiny_model_dir: Path) -> None:
    hasher = RequestHasher({"tiny": ModelTokenizerSource(tiny_model_dir)})
    config = HashConfig(block_size=4)
    text = "The quick brown fox jumps over the lazy dog. " * 4
    responses = hasher.hash_responses({"model": "tiny", "input": text, "cache_salt": "t"},
                                      config)
    chat = hasher.hash_chat({"model": "tiny", "cache_salt": "t", "add_special_tokens": True,
                             "messages": [{"role": "user", "content": text}]}, config)
    assert responses == chat and responses.block_hashes


def test_a_template_printing_tool_calls_sees_them_as_vllm_hands_them(
        tiny_model_dir: Path) -> None:
    """A Responses request's tool calls reach the template with ``name`` before
    ``arguments`` (vLLM builds them so, unvalidated), not in a chat request's order."""
    from transformers import AutoTokenizer
    from vllm.renderers.chat_utils import _postprocess_messages

    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                "{{ c.function | tojson }}{% endfor %}{% endfor %}")
    hasher = RequestHasher({"tiny": ModelTokenizerSource(tiny_model_dir,
                                                         chat_template=template)})
    body = {"model": "tiny", "input": AGENT_TURN[5:9]}
    messages, _tools, _continue = _vllm(body)
    _postprocess_messages(messages)  # vLLM decodes the JSON arguments in place
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert text.index('"name"') < text.index('"arguments"')
    expected = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert list(hasher.hash_responses(body, HashConfig(block_size=4)).token_ids) == expected
