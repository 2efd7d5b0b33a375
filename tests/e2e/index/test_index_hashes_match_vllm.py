"""Our prompt hashes equal the block hashes a real vLLM server publishes.

One real vLLM CPU server with vLLM's own ZMQ KV-event publisher. For chat and completion
requests, with and without ``cache_salt``, with tool calls, content parts and a second,
richer chat template (tools, developer role, documents, template kwargs), the
``BlockStored`` hashes the server publishes for the request's session must start with
exactly the chain ``RequestHasher`` computes from the request body. Its ``/tokenize``
endpoint (same rendering path) checks the token ids of more bodies without generating.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import zmq

from kvhint.router.devstack.nats_server import free_port
from kvhint.router.hashing import HashConfig, ModelTokenizerSource, PromptRenderer, RequestHasher
from kvhint.schemas.events import BlockStored, EventBatchDecoder

# "openai" content format (loops over content parts), tools as JSON, no developer role,
# documents and a custom kwarg: exercises what the tiny model's own template does not.
RICH_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>TOOLS {{ tools | tojson }}<|end|>{% endif %}"
    "{% if documents %}<|system|>DOCS{% for d in documents %} {{ d.title }}: {{ d.text }}"
    "{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}"
    "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endif %}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if reasoning_effort %}effort={{ reasoning_effort }}{% endif %}"
    "{% if style is defined %}style={{ style }}{% endif %}{% endif %}"
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


class EventCollector:
    """Subscribes to the server's ZMQ KV events (frames: topic, seq, msgpack batch)."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sock.connect(endpoint)
        self._decoder = EventBatchDecoder()
        self.stored: dict[str | None, list[BlockStored]] = defaultdict(list)
        self.batches = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            topic, _seq, payload = self._sock.recv_multipart()
            batch = self._decoder.decode(payload)
            with self._lock:
                self.batches += 1
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        self.stored[event.session_id].append(event)

    def chain(self, session_id: str, min_blocks: int, timeout_s: float = 20.0
              ) -> tuple[list[int], list[int]]:
        """The session's stored hash chain and its token ids, once it has min_blocks."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                events = list(self.stored.get(session_id, []))
            hashes = [h for e in events for h in e.block_hashes]
            if len(hashes) >= min_blocks or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for prev, nxt in zip(events, events[1:]):  # one parent-linked chain
            assert nxt.parent_block_hash == prev.block_hashes[-1]
        tokens = [t for e in events for t in e.token_ids]
        return hashes, tokens

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def kv_server(vllm_pool):
    port = free_port()
    spec = dataclasses.replace(
        vllm_pool.base_spec,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{port}", "topic": "kv"},
        extra_args=("--trust-request-chat-template",))
    server = vllm_pool.start("index-kv-events", spec)
    collector = EventCollector(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # ZMQ slow joiner: let the subscription reach the publisher
    try:
        yield server, collector
    finally:
        collector.close()
        server.stop()  # one server less held through the rest of the session


@pytest.fixture(scope="module")
def hasher(tiny_model_dir: Path) -> RequestHasher:
    return RequestHasher({"tiny": ModelTokenizerSource(tiny_model_dir)})


CONFIG = HashConfig(block_size=32, hash_algo="sha256", none_hash_seed="vllm-none-hash")


def long_text(nonce: str) -> str:
    # A unique lead (no prefix hit on earlier requests) and enough text for many blocks.
    return (f"Session {nonce}. Read the document carefully, then summarise each section. "
            + "The quick brown fox jumps over the lazy dog while the cache keeps every block. "
            * 8)


def generate(server, endpoint: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def assert_same_chain(collector: EventCollector, session_id: str, ours) -> None:
    assert len(ours.block_hashes) >= 4, "the prompt should span several blocks"
    theirs, tokens = collector.chain(session_id, len(ours.block_hashes))
    assert tokens[: ours.hashed_tokens] == list(ours.token_ids[: ours.hashed_tokens])
    assert theirs[: len(ours.block_hashes)] == list(ours.block_hashes)


def chat_body(nonce: str, **extra) -> dict:
    return {"model": "tiny", "max_tokens": 1, "temperature": 0,
            "session_id": f"t/{nonce}", "messages": [
                {"role": "system", "content": [{"type": "text", "text": "You are terse."},
                                               {"type": "text", "text": "Use tools."}]},
                {"role": "user", "content": long_text(nonce)},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
                {"role": "user", "content": "And tomorrow?"}]} | extra


def test_chat_hashes_with_and_without_salt(kv_server, hasher) -> None:
    server, collector = kv_server
    nonce = uuid.uuid4().hex[:8]
    plain = chat_body(nonce)
    salted = chat_body(nonce, cache_salt="tenant-a") | {"session_id": f"t/{nonce}-salted"}
    for body in (plain, salted):
        generate(server, "chat/completions", body)
        assert_same_chain(collector, body["session_id"], hasher.hash_chat(body, CONFIG))
    ours_plain, ours_salted = hasher.hash_chat(plain, CONFIG), hasher.hash_chat(salted, CONFIG)
    assert ours_plain.token_ids == ours_salted.token_ids
    assert set(ours_plain.block_hashes).isdisjoint(ours_salted.block_hashes)


def test_completion_hashes_text_and_token_prompts(kv_server, hasher) -> None:
    server, collector = kv_server
    nonce = uuid.uuid4().hex[:8]
    bodies = [
        {"prompt": long_text(nonce)},
        {"prompt": long_text(nonce), "cache_salt": "tenant-b"},
        {"prompt": list(range(3, 200))},
    ]
    for i, extra in enumerate(bodies):
        body = {"model": "tiny", "max_tokens": 1, "temperature": 0,
                "session_id": f"c/{nonce}-{i}"} | extra
        if i == 2:
            body["prompt"] = [(t * 7 + int(nonce[:4], 16)) % 500 + 1 for t in body["prompt"]]
        generate(server, "completions", body)
        [ours] = hasher.hash_completion(body, CONFIG)
        assert_same_chain(collector, body["session_id"], ours)


def test_chat_with_request_template_tools_and_developer(kv_server, tiny_model_dir) -> None:
    server, collector = kv_server
    nonce = uuid.uuid4().hex[:8]
    rich = RequestHasher({"tiny": ModelTokenizerSource(tiny_model_dir,
                                                       chat_template=RICH_TEMPLATE)})
    body = chat_body(nonce, tools=TOOLS, tool_choice="none", reasoning_effort="low",
                     documents=[{"title": "A", "text": "alpha"}],
                     chat_template_kwargs={"style": "terse"})
    body["messages"].insert(1, {"role": "developer", "content": "Prefer metric units."})
    generate(server, "chat/completions", body | {"chat_template": RICH_TEMPLATE})
    ours = rich.hash_chat(body, CONFIG)
    assert b"TOOLS" in rich.renderer("tiny").tokenizer.decode(ours.token_ids).encode()
    assert_same_chain(collector, body["session_id"], ours)


def tokenize(server, body: dict) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.mark.parametrize("template", [None, RICH_TEMPLATE], ids=["model-template", "rich"])
def test_token_ids_equal_the_servers_tokenize(kv_server, tiny_model_dir, template) -> None:
    server, _ = kv_server
    renderer = PromptRenderer.from_pretrained(tiny_model_dir, chat_template=template)
    base = chat_body("tok")
    variants = [
        base,
        base | {"add_generation_prompt": False},
        base | {"add_generation_prompt": False, "continue_final_message": True},
        base | {"add_special_tokens": True},
        base | {"tools": TOOLS, "tool_choice": "none"},
        # (reasoning_effort is not a /tokenize field; the generation test above covers it)
        base | {"chat_template_kwargs": {"style": "x"}},
        base | {"messages": [{"role": "developer", "content": "dev one"},
                             {"role": "user", "content": "u"},
                             {"role": "developer", "content": "dev two"},
                             {"role": "assistant", "content": [{"type": "text", "text": "a"}],
                              "tool_calls": []},
                             {"role": "tool", "tool_call_id": "x",
                              "content": [{"type": "text", "text": "r1"},
                                          {"type": "text", "text": "r2"}]},
                             {"role": "assistant", "content": "",
                              "tool_calls": [{"id": "y", "type": "function", "function": {
                                  "name": "f", "arguments": "not json"}}]}]},
    ]
    for body in variants:
        request = {k: v for k, v in body.items()
                   if k not in ("max_tokens", "temperature", "session_id")}
        if template is not None:
            request["chat_template"] = template
        assert renderer.chat_token_ids(body) == tokenize(server, request), body
    for prompt in ("hello world", "  spaces and <|user|> specials"):
        for special in (True, False):
            assert renderer.completion_token_ids(
                {"prompt": prompt, "add_special_tokens": special}) == [tokenize(
                    server, {"model": "tiny", "prompt": prompt,
                             "add_special_tokens": special})]
