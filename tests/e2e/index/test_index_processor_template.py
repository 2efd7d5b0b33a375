"""A model whose processor has its own chat template (as vision-language models ship):
the router's token ids equal the vLLM server's, with tools and without."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest

from kvhint.router.hashing import PromptRenderer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def processor_server(vllm_pool, processor_model_dir: Path):
    server = vllm_pool.start("processor-template", dataclasses.replace(
        vllm_pool.base_spec, model_dir=processor_model_dir))
    try:
        yield server
    finally:
        server.stop()  # one server less held through the rest of the session


def tokenize(server, body: dict) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_token_ids_equal_the_servers_with_a_processor_template(
        processor_server, processor_model_dir: Path) -> None:
    renderer = PromptRenderer.from_pretrained(processor_model_dir)
    base = {"model": "tiny", "messages": [{"role": "system", "content": "You are terse."},
                                          {"role": "user", "content": "What is the weather?"}]}
    bodies = [base, base | {"add_generation_prompt": False}, base | {"tools": TOOLS},
              base | {"tools": []}, base | {"tools": TOOLS, "tool_choice": "none"}]
    for body in bodies:
        assert renderer.chat_token_ids(body) == tokenize(processor_server, body), body
    # The server did render with the processor's template (not a vacuous equality).
    assert renderer.tokenizer.decode(tokenize(processor_server, base)).startswith("PROCESSOR")
