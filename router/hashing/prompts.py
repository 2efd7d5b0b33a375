"""Render OpenAI request bodies into the exact token ids vLLM 0.32's OpenAI server feeds
its engine, for one model (tokenizer + chat template).

Chat (``vllm/renderers/online_renderer.py`` ``preprocess_chat`` -> ``renderers/hf.py``):
messages are normalised into a *conversation* (text parts joined with ``"\\n"`` for
"string"-format templates, kept as ``{"type": "text"}`` dicts for "openai"-format ones;
assistant ``tool_calls`` with JSON ``arguments`` decoded to dicts; ``developer`` messages
turned into one system message when the template lacks that role), the template is applied
with ``tokenize=False`` and the request's kwargs (``add_generation_prompt``,
``continue_final_message``, ``documents``, ``reasoning_effort``, ``chat_template_kwargs``,
``tools``) filtered to those the template or ``apply_chat_template`` accepts, and the text
is tokenized with ``add_special_tokens`` (default False for chat).

Completions: each prompt string is tokenized with ``add_special_tokens`` (default True);
token-id prompts pass through.

Anything we cannot reproduce exactly (images/audio/video parts, prompt embeds,
``truncate_prompt_tokens``, a per-request chat template) raises
:class:`UnsupportedPrompt`; a malformed body raises :class:`PromptRenderError`.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from kvhint.router.hashing.chat_template import TemplateTraits, template_traits
from kvhint.router.hashing.errors import PromptRenderError, UnsupportedPrompt
from kvhint.router.hashing.processor_template import processor_chat_template

# vLLM's TEXT_PART_TYPES and the key each keeps its text under.
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
                   "refusal": "refusal", "thinking": "thinking"}
_SKIP_WHEN_NONE = ("text", "refusal")
_BILLING_HEADER = "x-anthropic-billing-header"
# Request fields whose effect on the prompt we do not reproduce.
_UNSUPPORTED_FIELDS = ("prompt_embeds", "truncate_prompt_tokens", "chat_template",
                       "mm_processor_kwargs", "media_io_kwargs")
# The order of a tool call's ``function`` keys a template sees: a chat request's is
# validated into openai's TypedDict (arguments, name); a Responses request's calls are
# built by vLLM as ``FunctionCallTool(name=..., arguments=...)`` and never validated
# (responses/utils.py), so name comes first. A template that prints the function
# ``| tojson`` renders the two differently.
CHAT_FUNCTION_KEYS = ("arguments", "name")
RESPONSES_FUNCTION_KEYS = ("name", "arguments")


class PromptRenderer:
    """One model's tokenizer and chat template, rendering like vLLM's OpenAI server.

    ``tokenizer`` is a ``transformers`` tokenizer (vLLM loads the same class with
    ``AutoTokenizer``). ``chat_template`` overrides the tokenizer's, as the server's
    ``--chat-template`` does; ``default_chat_template_kwargs`` mirrors
    ``--default-chat-template-kwargs``; ``exclude_tools_when_tool_choice_none`` mirrors
    the server flag of the same name. ``processor_chat_template`` is the model's
    processor's template (multimodal models), which vLLM prefers to the tokenizer's for a
    request without tools (``renderers/hf.py`` ``resolve_chat_template``).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None,
                 default_chat_template_kwargs: Mapping[str, Any] | None = None,
                 exclude_tools_when_tool_choice_none: bool = False,
                 processor_chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._chat_template_override = chat_template
        self._processor_template = processor_chat_template
        self._default_kwargs = dict(default_chat_template_kwargs or {})
        self._exclude_tools_when_none = exclude_tools_when_tool_choice_none
        self._traits: dict[str, TemplateTraits] = {}  # per template text (at most a few)

    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | None = None,
                        default_chat_template_kwargs: Mapping[str, Any] | None = None,
                        exclude_tools_when_tool_choice_none: bool = False) -> PromptRenderer:
        """Load the tokenizer from a local folder (or a hub id, when the hub is reachable)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(tokenizer, chat_template, default_chat_template_kwargs,
                   exclude_tools_when_tool_choice_none,
                   processor_chat_template=processor_chat_template(path))

    # --- completions ------------------------------------------------------------------

    def completion_token_ids(self, body: Mapping[str, Any], first_only: bool = False
                             ) -> list[list[int]]:
        """Token ids of each prompt of a ``/v1/completions`` body (one per prompt).
        ``first_only``: of a batch's first prompt alone (the router routes a batch by it):
        the others are neither tokenized nor checked item by item."""
        _check_body(body)
        prompt = body.get("prompt")
        add_special = _flag(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            return [self._encode(prompt, add_special)]
        if isinstance(prompt, list) and prompt:
            if all(_is_token(t) for t in prompt):
                return [list(prompt)]
            prompts = prompt[:1] if first_only else prompt
            if all(isinstance(p, str) for p in prompt):
                return [self._encode(p, add_special) for p in prompts]
            if all(isinstance(p, list) for p in prompt) and all(
                    p and all(_is_token(t) for t in p) for p in prompts):
                return [list(p) for p in prompts]
        raise PromptRenderError(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (non-empty)")

    # --- chat -------------------------------------------------------------------------

    def chat_token_ids(self, body: Mapping[str, Any],
                       function_keys: tuple[str, ...] = CHAT_FUNCTION_KEYS) -> list[int]:
        """Token ids of a ``/v1/chat/completions`` body's prompt. ``function_keys``: the
        order of an assistant tool call's ``function`` keys the template sees (a
        Responses request's converted body: :data:`RESPONSES_FUNCTION_KEYS`)."""
        _check_body(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptRenderError("'messages' must be a non-empty list")
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        continue_final = _flag(body, "continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise PromptRenderError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        tools = self._tools(body)
        template = self._resolve_template(tools)
        traits = self._traits.get(template)
        if traits is None:
            traits = self._traits[template] = template_traits(template)
        conversation = [_conversation_message(m, traits.content_format, function_keys)
                        for m in messages]
        _decode_tool_call_arguments(conversation)
        if (any(m["role"] == "developer" for m in conversation)
                and not traits.supports_developer_role):
            conversation = _consolidate_system(_developer_to_system(conversation))
        kwargs = self._template_kwargs(body, template, traits.variables)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation=conversation, tools=tools, chat_template=template,
                tokenize=False, return_dict=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - templates raise anything (raise_exception)
            raise PromptRenderError(f"chat template rejected the request: {exc}") from exc
        return self._encode(text, _flag(body, "add_special_tokens", False))

    # --- internals --------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        backend = self._fast_backend
        if backend is not None:
            # encode_batch, not encode: the same ids, but it releases the GIL while the
            # Rust tokenizer works (encode holds it: 63k tokens stalled every other thread
            # for ~40 ms), so the router's loop keeps serving while a hashing thread waits.
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    @cached_property
    def _fast_backend(self) -> Any:
        """The Rust ``tokenizers.Tokenizer`` behind a fast HF tokenizer: the same ids as
        ``tokenizer(text)`` (no truncation, special tokens not split) without the
        ``BatchEncoding`` overhead (~10x faster for short prompts). None when the
        tokenizer is slow or splits special tokens."""
        if not getattr(self.tokenizer, "is_fast", False):
            return None
        if getattr(self.tokenizer, "split_special_tokens", False):
            return None
        return getattr(self.tokenizer, "_tokenizer", None)

    def _resolve_template(self, tools: Any) -> str:
        """vLLM's order: the server's ``--chat-template``, else the processor's template
        when the request has no tools (``None``: an empty list counts as tools), else the
        tokenizer's (its ``tool_use`` variant for a request with tools)."""
        if (self._chat_template_override is None and tools is None
                and self._processor_template is not None):
            return self._processor_template
        try:
            template = self.tokenizer.get_chat_template(
                self._chat_template_override, tools=tools if tools else None)
        except ValueError as exc:
            raise UnsupportedPrompt(f"model has no chat template: {exc}") from exc
        if not isinstance(template, str):
            raise UnsupportedPrompt("model has no usable chat template")
        return template

    def _tools(self, body: Mapping[str, Any]) -> Any:
        """The tools the template sees, with vLLM's precedence: the request's
        ``chat_template_kwargs["tools"]``, else its ``tools`` (unless excluded for
        ``tool_choice: "none"``), else ``--default-chat-template-kwargs``' ``tools``;
        None and ``"auto"`` never override."""
        request_kwargs = _request_template_kwargs(body)
        return _merge(_merge(self._default_kwargs, {"tools": self._tool_dicts(body)}),
                      {"tools": request_kwargs.get("tools")}).get("tools")

    def _tool_dicts(self, body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        tools = body.get("tools")
        if tools is None:
            return None
        if self._exclude_tools_when_none and body.get("tool_choice") == "none":
            return None
        if not isinstance(tools, list):
            raise PromptRenderError("'tools' must be a list")
        return [_tool_dict(t) for t in tools]

    def _template_kwargs(self, body: Mapping[str, Any], template: str,
                         template_vars: frozenset[str]) -> dict[str, Any]:
        request_kwargs = _request_template_kwargs(body)
        if {"chat_template", "tokenize"} & request_kwargs.keys():
            raise UnsupportedPrompt("chat_template_kwargs may not set chat_template/tokenize")
        extra: dict[str, Any] = {
            "add_generation_prompt": _flag(body, "add_generation_prompt", True),
            "continue_final_message": _flag(body, "continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        if body.get("reasoning_effort") is not None and "enable_thinking" not in request_kwargs:
            extra["enable_thinking"] = body["reasoning_effort"] != "none"
        # vLLM's merge_kwargs: later dicts win, but None and "auto" never override.
        merged = _merge(_merge(self._default_kwargs, dict(request_kwargs)), extra)
        accepted = (self._signature_params | template_vars) - {"chat_template", "tokenize",
                                                               "tools", "return_dict"}
        return {k: v for k, v in merged.items() if k in accepted}

    @cached_property
    def _signature_params(self) -> frozenset[str]:
        """Named parameters of ``apply_chat_template`` (this tokenizer's and the HF base
        class's): vLLM passes those even when the template does not use them."""
        names: set[str] = set()
        fns = [self.tokenizer.apply_chat_template]
        try:
            from transformers import PythonBackend

            fns.append(PythonBackend.apply_chat_template)
        except ImportError:  # older transformers: the tokenizer's own signature suffices
            pass
        for fn in fns:
            for p in inspect.signature(fn).parameters.values():
                if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
                    names.add(p.name)
        return frozenset(names)


def _check_body(body: Mapping[str, Any]) -> None:
    if not isinstance(body, Mapping):
        raise PromptRenderError("request body must be a JSON object")
    for name in _UNSUPPORTED_FIELDS:
        if body.get(name) is not None:
            raise UnsupportedPrompt(f"'{name}' changes the prompt in ways we do not reproduce")


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PromptRenderError(f"'{name}' must be a boolean")
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _request_template_kwargs(body: Mapping[str, Any]) -> Mapping[str, Any]:
    request_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(request_kwargs, Mapping):
        raise PromptRenderError("'chat_template_kwargs' must be an object")
    return request_kwargs


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    out.update({k: v for k, v in overrides.items() if v is not None and v != "auto"})
    return out


def _text_parts(role: str, content: Any) -> list[str | dict[str, Any]]:
    """The message's parts as vLLM parses them: strings and text-part dicts only."""
    if content is None:
        return []
    if isinstance(content, str):
        parts: list[Any] = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise PromptRenderError(f"{role} message 'content' must be a string, a list or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    out: list[str | dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, Mapping):
            raise PromptRenderError("content parts must be strings or objects")
        part_type = part.get("type")
        if not isinstance(part_type, str) or part_type not in _TEXT_PART_KEYS \
                or part.get("uuid") is not None:
            raise UnsupportedPrompt(
                f"content part type {part_type!r} is not text; multimodal prompts are not "
                "hashed by the router")
        text = part.get(_TEXT_PART_KEYS[part_type])
        if text is None and part_type in _SKIP_WHEN_NONE:
            continue
        if not isinstance(text, str):
            raise PromptRenderError(f"content part {part_type!r} needs a string")
        out.append(text)
    return out


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _conversation_message(message: Any, content_format: str,
                          function_keys: tuple[str, ...] = CHAT_FUNCTION_KEYS
                          ) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise PromptRenderError("every message must be an object with a string 'role'")
    role = message["role"]
    texts = _text_parts(role, message.get("content"))
    if content_format == "openai":
        result: dict[str, Any] = {"role": role,
                                  "content": [{"type": "text", "text": t} for t in texts]}
    else:
        result = {"role": role, "content": "\n".join(texts)}  # type: ignore[arg-type]
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise PromptRenderError("assistant 'tool_calls' must be a list")
            result["tool_calls"] = [_tool_call(c, function_keys) for c in calls]
        if message.get("reasoning") is not None:
            result["reasoning"] = message["reasoning"]
            result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(result["content"], list):
            result["content"] = "\n".join(p["text"] for p in result["content"])
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if isinstance(message.get("task"), str):
        result["task"] = message["task"]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _tool_call(call: Any, function_keys: tuple[str, ...] = CHAT_FUNCTION_KEYS
               ) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise PromptRenderError("assistant tool_calls entries must be objects.")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise PromptRenderError("chat completions only support assistant tool_calls of type "
                                "'function'.")
    # The order and the keys vLLM's validated request hands the template (openai's
    # TypedDicts: id, function {arguments, name}, type; unknown keys kept after): a
    # template that prints ``tool_call.function | tojson`` (Hermes/Qwen style) or the
    # whole call renders these bytes, and HF's tojson does not sort keys.
    def ordered(source: Mapping[str, Any], first: tuple[str, ...]) -> dict[str, Any]:
        out = {k: copy.deepcopy(source[k]) for k in first if k in source}
        out.update((k, copy.deepcopy(v)) for k, v in source.items() if k not in out)
        return out

    return ordered({**call, "function": ordered(function, function_keys)},
                   ("id", "function", "type"))


def _decode_tool_call_arguments(conversation: list[dict[str, Any]]) -> None:
    """vLLM's ``_postprocess_messages``: templates get tool-call arguments as dicts."""
    for message in conversation:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        if not message["tool_calls"]:
            del message["tool_calls"]
            continue
        for call in message["tool_calls"]:
            function = call["function"]
            arguments = function.get("arguments")
            if not arguments:
                function["arguments"] = {}
                continue
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError):  # not JSON, or nested too deep
                    arguments = None
            function["arguments"] = arguments if isinstance(arguments, dict) else {}


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        out.append(message)
    return out


def _consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    needs_merge = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        if i > 0 or system_texts:
            needs_merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, Mapping) else p for p in content)
        if content:
            system_texts.append(content)
    if not needs_merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def _tool_dict(tool: Any) -> dict[str, Any]:
    """What ``ChatCompletionToolsParam.model_dump()`` gives the template."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        raise PromptRenderError("each tool must be an object with a 'function' object")
    if tool.get("type", "function") != "function":
        raise PromptRenderError("only tools of type 'function' are supported")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str):
        raise PromptRenderError("tool function needs a string 'name'")
    defer = fn.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    out_fn: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                              "parameters": copy.deepcopy(fn.get("parameters"))}
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    if defer is not None:
        out_fn["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": out_fn}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out
