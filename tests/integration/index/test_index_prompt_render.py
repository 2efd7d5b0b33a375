"""PromptRenderer / RequestHasher on the tiny model's real tokenizer: what it refuses, how
it fails, and that its fast tokenizer path gives the HF tokenizer's ids. (Equality with
the vLLM server's own rendering is proven in tests/e2e/index.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhint.router.hashing import (
    HashConfig,
    ModelTokenizerSource,
    PromptRenderError,
    PromptRenderer,
    RequestHasher,
    UnknownModel,
    UnsupportedHashConfig,
    UnsupportedPrompt,
)


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> PromptRenderer:
    return PromptRenderer.from_pretrained(tiny_model_dir)


def chat(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]} | extra


def test_fast_path_ids_equal_the_hf_tokenizer(renderer: PromptRenderer) -> None:
    assert renderer._fast_backend is not None
    texts = ["hello world", "<|user|>hi<|end|><|assistant|>", "  lead spaces\n\ttabs",
             "unicode: héllo — 你好 🙂", "", "{\"name\": \"get_weather\"}" * 20]
    for text in texts:
        for special in (True, False):
            hf = renderer.tokenizer(text, add_special_tokens=special)["input_ids"]
            assert renderer._encode(text, special) == list(hf)


@pytest.mark.parametrize("body, error", [
    ({"model": "tiny"}, "'messages' must be a non-empty list"),
    (chat(messages=[{"content": "no role"}]), "string 'role'"),
    (chat(messages=[{"role": "user", "content": 5}]), "must be a string, a list or null"),
    (chat(add_generation_prompt=True, continue_final_message=True), "Cannot set both"),
    (chat(add_generation_prompt="yes"), "must be a boolean"),
    (chat(tools={"not": "a list"}), "'tools' must be a list"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"type": "x", "function": {}}]}]),
     "of type 'function'"),
])
def test_malformed_chat_bodies_are_render_errors(renderer: PromptRenderer, body: dict,
                                                 error: str) -> None:
    with pytest.raises(PromptRenderError, match=error):
        renderer.chat_token_ids(body)


@pytest.mark.parametrize("body", [
    chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
    chat(truncate_prompt_tokens=10),
    chat(chat_template="{{ messages }}"),
    chat(chat_template_kwargs={"tokenize": True}),
])
def test_prompts_we_cannot_reproduce_are_refused(renderer: PromptRenderer, body: dict) -> None:
    with pytest.raises(UnsupportedPrompt):
        renderer.chat_token_ids(body)


def test_completion_prompt_shapes(renderer: PromptRenderer) -> None:
    one = renderer.completion_token_ids({"prompt": "hello"})
    assert len(one) == 1 and one[0]
    assert renderer.completion_token_ids({"prompt": ["hello", "bye"]})[0] == one[0]
    assert renderer.completion_token_ids({"prompt": [5, 6, 7]}) == [[5, 6, 7]]
    assert renderer.completion_token_ids({"prompt": [[5], [6, 7]]}) == [[5], [6, 7]]
    for bad in (None, [], [[]], [1, "x"], 3, [-1]):
        with pytest.raises(PromptRenderError):
            renderer.completion_token_ids({"prompt": bad})
    # A batch's first prompt alone (what the router routes it by); a bad first still
    # raises, a bad later one is not looked at item by item.
    assert renderer.completion_token_ids({"prompt": ["hello", "bye"]}, first_only=True) == one
    assert renderer.completion_token_ids({"prompt": [[5], [6, -1]]}, first_only=True) == [[5]]
    for bad in ([[]], [[5], "x"], [[-1], [5]]):
        with pytest.raises(PromptRenderError):
            renderer.completion_token_ids({"prompt": bad}, first_only=True)


def test_request_hasher_salt_models_and_configs(tiny_model_dir: Path) -> None:
    loads: list[str] = []

    def loader(source: ModelTokenizerSource) -> PromptRenderer:
        loads.append(str(source.path))
        return PromptRenderer.from_pretrained(source.path)

    hasher = RequestHasher({"tiny": ModelTokenizerSource(tiny_model_dir),
                            "alias": ModelTokenizerSource(tiny_model_dir),
                            "templated": ModelTokenizerSource(
                                tiny_model_dir, chat_template="{{ messages[0].content }}")},
                           loader=loader, max_loaded_models=1)
    config = HashConfig(block_size=4)
    text = "The quick brown fox jumps over the lazy dog. " * 4
    plain = hasher.hash_chat(chat(messages=[{"role": "user", "content": text}]), config)
    salted = hasher.hash_chat(chat(messages=[{"role": "user", "content": text}],
                                   cache_salt="t1"), config)
    assert plain.token_ids == salted.token_ids and len(plain.block_hashes) >= 4
    assert plain.hashed_tokens == 4 * len(plain.block_hashes) <= plain.num_tokens
    assert all(a != b for a, b in zip(plain.block_hashes, salted.block_hashes))
    for _ in range(3):  # an alias of the same source shares its renderer: no reload
        hasher.hash_chat(chat(model="alias"), config)
        hasher.hash_chat(chat(), config)
    assert len(loads) == 1
    hasher.hash_chat(chat(model="templated"), config)  # evicts the other (max 1 loaded)
    hasher.hash_chat(chat(), config)
    assert len(loads) == 3
    with pytest.raises(UnknownModel):
        hasher.hash_chat(chat(model="nope"), config)
    with pytest.raises(PromptRenderError, match="'model'"):
        hasher.hash_chat({"messages": []}, config)
    with pytest.raises(PromptRenderError, match="cache_salt"):
        hasher.hash_chat(chat(cache_salt=5), config)
    with pytest.raises(UnsupportedHashConfig, match="cannot reproduce"):
        hasher.hash_chat(chat(), HashConfig(4, "md5"))
    [completion] = hasher.hash_completion({"model": "tiny", "prompt": text}, config)
    assert completion.block_size == 4 and completion.block_hashes


def test_request_hasher_from_several_threads_gives_the_one_thread_hashes(
        tiny_model_dir: Path) -> None:
    """The router hashes long prompts on a thread while the loop hashes short ones: the
    same hasher, first use (model loading) included, from 4 threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [chat(messages=[{"role": "user", "content": f"prompt {n} " + "word " * (50 * n)}])
              for n in range(1, 13)]
    config = HashConfig(block_size=16)
    expected = [RequestHasher({"tiny": ModelTokenizerSource(tiny_model_dir)})
                .hash_chat(b, config) for b in bodies]
    loads = []

    def loader(source: ModelTokenizerSource) -> PromptRenderer:
        loads.append(source)
        return PromptRenderer.from_pretrained(source.path)

    shared = RequestHasher({"tiny": ModelTokenizerSource(tiny_model_dir)}, loader=loader)
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda b: shared.hash_chat(b, config), bodies * 4))
    assert got == expected * 4
    assert len(loads) == 1  # the model was loaded once, not once per thread


def test_tool_calls_reach_the_template_as_vllm_hands_them(tiny_model_dir: Path) -> None:
    """A Hermes/Qwen-style template prints ``tool_call.function | tojson``: the router
    must hand it the call's keys in the order vLLM's validated request has them
    (arguments before name; extra keys kept), or every block after the first tool call
    misses. Compared with vLLM's own renderer on the tiny model (no server)."""
    template = ("{% for message in messages %}<|{{ message.role }}|>{{ message.content or '' }}"
                "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}"
                "{{ call | tojson }}</tool_call>{% endfor %}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    body = {"model": "tiny", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "type": "function", "id": "call_1", "index": 0,
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}]}
    ours = PromptRenderer.from_pretrained(tiny_model_dir, chat_template=template)
    assert ours.chat_token_ids(body) == _vllm_chat_token_ids(tiny_model_dir, template, body)


def test_tools_in_chat_template_kwargs_reach_the_template_as_in_vllm(
        tiny_model_dir: Path) -> None:
    """vLLM hands the template ``chat_template_kwargs["tools"]`` when a request sets it,
    over the request's own ``tools``. The router used to drop it, so a client passing
    its tools that way (some agent SDKs do) missed every block after them."""
    template = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
                "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}"
                "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    schema = {"type": "function", "function": {"name": "search", "parameters": {}}}
    other = {"type": "function", "function": {"name": "fetch", "parameters": {}}}
    base = {"model": "tiny", "messages": [{"role": "user", "content": "Find kvhint."}]}
    # tool_choice "none": "auto" needs a server started with a tool-call parser.
    with_tools = base | {"tools": [other], "tool_choice": "none"}
    ours = PromptRenderer.from_pretrained(tiny_model_dir, chat_template=template)
    for body in (base | {"chat_template_kwargs": {"tools": [schema]}},
                 with_tools | {"chat_template_kwargs": {"tools": [schema]}},
                 with_tools | {"chat_template_kwargs": {"tools": None}}):
        assert ours.chat_token_ids(body) == _vllm_chat_token_ids(tiny_model_dir, template,
                                                                 body), body


def _vllm_chat_token_ids(model_dir: Path, template: str, body: dict) -> list[int]:
    """The prompt token ids vLLM's own OpenAI renderer makes of ``body`` (no server)."""
    import asyncio

    from vllm.config import ModelConfig, VllmConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                               max_model_len=4096, enforce_eager=True)
    online = OnlineRenderer(model_config, renderer_from_config(VllmConfig(
        model_config=model_config)), request_logger=None, chat_template=template,
        chat_template_content_format="auto")
    _conversation, prompts = asyncio.run(online.render_chat(ChatCompletionRequest(**body)))
    return list(prompts[0]["prompt_token_ids"])


def test_the_processors_chat_template_renders_requests_without_tools(
        processor_model_dir: Path, tiny_model_dir: Path) -> None:
    """vLLM renders a request without tools with the processor's template when the model
    has one (a vision-language model), with the tokenizer's otherwise; before, the router
    always used the tokenizer's, and every hash of such a model missed. (Equality with
    the server's own rendering: tests/e2e/index/test_index_processor_template.py.)"""
    renderer = PromptRenderer.from_pretrained(processor_model_dir)
    plain = PromptRenderer.from_pretrained(tiny_model_dir)
    decode = renderer.tokenizer.decode
    assert decode(renderer.chat_token_ids(chat())).startswith("PROCESSOR[user]hello")
    assert plain._processor_template is None  # a text-only model has no processor
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for with_tools in (chat(tools=tools), chat(tools=[])):  # tools, even none: the tokenizer's
        assert renderer.chat_token_ids(with_tools) == plain.chat_token_ids(with_tools)
    # The server's --chat-template comes first.
    templated = PromptRenderer.from_pretrained(processor_model_dir,
                                               chat_template="{{ messages[0].content }}")
    assert decode(templated.chat_token_ids(chat())) == "hello"
