"""A ``/v1/responses`` body as the ``/v1/chat/completions`` body vLLM 0.32 renders it as,
so :meth:`RequestHasher.hash_chat` gives its exact prompt hashes.

vLLM renders a Responses request through the chat template
(``renderers/online_renderer.py`` ``render_responses``): ``instructions`` becomes a system
message, ``input`` items become chat messages (``responses/utils.py``
``construct_input_messages`` / ``_construct_message_from_response_item``), function tools
become chat tools (``construct_tool_dicts``), and ``build_chat_params`` sets
``add_generation_prompt``/``continue_final_message`` from the last item and
``reasoning_effort`` from ``reasoning.effort``. One difference from chat: the rendered text
is tokenized with ``add_special_tokens`` true (``ResponsesRequest.build_tok_params`` leaves
vLLM's ``TokenizeParams`` default).

Only what is reproduced exactly is converted; anything else raises
:class:`UnsupportedPrompt` (routed without predicted overlap, counted):
``previous_response_id`` (the earlier turns live in the worker's memory, not in the
body), ``previous_input_messages`` and ``prompt`` templates, ``truncation: "auto"``,
non-function tools, namespaced or custom tool calls, reasoning items with encrypted
content, and input item types other than messages, ``function_call``,
``function_call_output``, ``custom_tool_call_output`` and ``reasoning``. Images and
other non-text parts are refused later by the chat renderer, as for chat. gpt-oss
(Harmony) models render another way entirely; like their chat requests, they are not
told apart here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvhint.router.hashing.errors import PromptRenderError, UnsupportedPrompt

# Passed to the chat body as they are: the chat renderer reads (or refuses) them the same
# way for both endpoints.
_SHARED_FIELDS = ("model", "cache_salt", "chat_template_kwargs", "mm_processor_kwargs",
                  "media_io_kwargs")
# A last item in one of these states is continued, not answered (should_continue_final_message).
_PARTIAL = ("in_progress", "incomplete")
_TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def responses_chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body whose rendering is the Responses request's prompt (module doc)."""
    for name in ("previous_response_id", "previous_input_messages", "prompt"):
        if body.get(name) is not None:
            raise UnsupportedPrompt(f"'{name}': the prompt is not all in the request body")
    if body.get("truncation") == "auto":
        raise UnsupportedPrompt("'truncation': 'auto' may cut the prompt")
    request_input = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
    elif isinstance(request_input, list):
        for item in request_input:
            _append_item(messages, item)
    else:
        raise PromptRenderError("'input' must be a string or an array")
    if not messages:
        raise PromptRenderError("the request renders no message")
    continue_final = _continues_final(request_input)
    chat: dict[str, Any] = {name: body[name] for name in _SHARED_FIELDS if name in body}
    chat.update(messages=messages, add_generation_prompt=not continue_final,
                continue_final_message=continue_final, add_special_tokens=True)
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    tools = _chat_tools(body.get("tools"))
    if tools:  # vLLM: no tools (or an empty list) renders as no tools at all
        chat["tools"] = tools
        if "tool_choice" in body:
            chat["tool_choice"] = body["tool_choice"]
    return chat


def _append_item(messages: list[dict[str, Any]], item: Any) -> None:
    """``_construct_message_from_response_item``: a new message, or one merged into the
    previous assistant message (a tool call, reasoning, or text it lacks)."""
    if not isinstance(item, Mapping):
        raise PromptRenderError("every item of 'input' must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind == "function_call":
        _append_tool_call(messages, previous, item)
    elif kind == "reasoning":
        _append_reasoning(messages, previous, item)
    elif kind in _TOOL_OUTPUTS:
        messages.append({"role": "tool", "content": item.get("output"),
                         "tool_call_id": item.get("call_id")})
    elif kind == "message" and "role" in item:
        _append_message(messages, previous, item)
    else:
        raise UnsupportedPrompt(f"input item type {kind!r} is not reproduced")


def _append_message(messages: list[dict[str, Any]], previous: dict[str, Any] | None,
                    item: Mapping[str, Any]) -> None:
    if item.get("role") != "assistant":
        messages.append(dict(item))  # vLLM passes the item on as the chat message
        return
    content = item.get("content")
    text: Any = None
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and content:
        first = content[0]
        if not isinstance(first, Mapping) or not isinstance(first.get("text"), str):
            # An output message opening with a refusal: vLLM fails on it.
            raise UnsupportedPrompt("an assistant item whose first part has no text")
        text = first["text"]
    if text is None:
        messages.append(dict(item))
    elif previous is not None and previous.get("content") is None:
        previous["content"] = text
    else:
        messages.append({"role": "assistant", "content": text})


def _append_tool_call(messages: list[dict[str, Any]], previous: dict[str, Any] | None,
                      item: Mapping[str, Any]) -> None:
    if item.get("namespace"):
        raise UnsupportedPrompt("namespaced tool calls are not reproduced")
    call = {"id": item.get("call_id"),
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            "type": "function"}
    if previous is None:
        messages.append({"role": "assistant", "tool_calls": [call]})
    elif previous.get("tool_calls") is None:
        previous["tool_calls"] = [call]
    else:
        previous["tool_calls"].append(call)


def _append_reasoning(messages: list[dict[str, Any]], previous: dict[str, Any] | None,
                      item: Mapping[str, Any]) -> None:
    if item.get("encrypted_content"):
        raise UnsupportedPrompt("encrypted reasoning (vLLM refuses it)")
    reasoning = ""
    for key in ("content", "summary"):  # content first; a summary stands in for it
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            first = parts[0]
            if not isinstance(first, Mapping) or not isinstance(first.get("text"), str):
                raise PromptRenderError(f"a reasoning item's {key} needs text")
            reasoning = first["text"]
            break
    if previous is not None and previous.get("reasoning") is None:
        previous["reasoning"] = reasoning
    else:
        messages.append({"role": "assistant", "reasoning": reasoning})


def _continues_final(request_input: Any) -> bool:
    """``should_continue_final_message``: the last item is a message or reasoning still
    in progress or cut short, which the model continues."""
    if not isinstance(request_input, list) or not request_input:
        return False
    last = request_input[-1]
    return (isinstance(last, Mapping) and last.get("type", "message") in ("message", "reasoning")
            and last.get("status") in _PARTIAL)


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses function tools (flat) in the chat shape the chat renderer reads."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise PromptRenderError("'tools' must be an array")
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise UnsupportedPrompt(f"tool type {kind!r} is not reproduced")
        function = {key: tool[key] for key in ("name", "description", "parameters",
                                               "strict", "defer_loading") if key in tool}
        out.append({"type": "function", "function": function})
    return out
