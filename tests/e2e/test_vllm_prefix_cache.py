"""A real vLLM CPU server with prefix caching reports cached prompt tokens."""

from __future__ import annotations

import httpx


def test_second_identical_prompt_reports_cached_tokens(vllm_server) -> None:
    prompt = "Summarise the following notes about caching. " * 30
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4, "temperature": 0, "session_id": "e2e-1"}
    first = httpx.post(f"{vllm_server.url}/v1/chat/completions", json=body, timeout=60).json()
    second = httpx.post(f"{vllm_server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens"] > 256
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
