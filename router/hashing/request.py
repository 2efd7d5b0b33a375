"""One call per request: body -> token ids -> block-hash chain, as the worker computes it.

``RequestHasher`` owns a bounded cache of per-model :class:`PromptRenderer` (tokenizers are
slow to load, ~100 ms, and large) and of per-config :class:`BlockHasher`. Pass the body
exactly as it is forwarded to the worker: the ``cache_salt`` the router set is read from it.

Thread-safe: the router hashes long prompts on a thread while short ones are hashed on the
event loop. The caches are behind a lock; a loaded tokenizer is only read (the Rust
tokenizer's ``encode_batch`` takes a shared borrow, so two threads may encode at once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhint.router.hashing.blocks import BlockHasher, HashConfig
from kvhint.router.hashing.errors import PromptRenderError, UnknownModel
from kvhint.router.hashing.prompts import RESPONSES_FUNCTION_KEYS, PromptRenderer
from kvhint.router.hashing.responses_input import responses_chat_body


@dataclass(frozen=True, slots=True)
class PromptHashes:
    """A prompt's token ids and the 64-bit hashes of its full blocks."""

    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def hashed_tokens(self) -> int:
        """Tokens covered by full blocks (the most a cache can hold of this prompt)."""
        return len(self.block_hashes) * self.block_size


@dataclass(frozen=True, slots=True)
class ModelTokenizerSource:
    """Where a served model's tokenizer lives, and the server flags that shape prompts."""

    path: str | Path
    chat_template: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    exclude_tools_when_tool_choice_none: bool = False


class RequestHasher:
    """Hashes OpenAI request bodies for the models it knows.

    ``sources`` maps the served model name (the body's ``model``) to its tokenizer source.
    ``loader`` builds a renderer from a source (injectable for tests); at most
    ``max_loaded_models`` renderers stay loaded (least recently used dropped). Names
    with the same source (``--served-model-name`` aliases) share one renderer: keyed by
    name, ten aliases reloaded a tokenizer on every request.
    """

    def __init__(self, sources: Mapping[str, ModelTokenizerSource],
                 loader: Callable[[ModelTokenizerSource], PromptRenderer] | None = None,
                 max_loaded_models: int = 8) -> None:
        self._sources = dict(sources)
        self._loader = loader or _load_renderer
        self._max_loaded = max_loaded_models
        self._renderers: OrderedDict[tuple[Any, ...], PromptRenderer] = OrderedDict()
        self._hashers: dict[HashConfig, BlockHasher] = {}
        self._lock = threading.Lock()  # guards both caches (and loads a model once)

    def models(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def renderer(self, model: str) -> PromptRenderer:
        """The model's renderer, loading it on first use (raises :class:`UnknownModel`)."""
        with self._lock:
            source = self._sources.get(model)
            if source is None:
                raise UnknownModel(f"no tokenizer configured for model {model!r}")
            key = _source_key(source)
            renderer = self._renderers.get(key)
            if renderer is not None:
                self._renderers.move_to_end(key)
                return renderer
            renderer = self._loader(source)
            self._renderers[key] = renderer
            while len(self._renderers) > self._max_loaded:
                self._renderers.popitem(last=False)
            return renderer

    def block_hasher(self, config: HashConfig) -> BlockHasher:
        """Cached per config; raises :class:`UnsupportedHashConfig`."""
        with self._lock:
            hasher = self._hashers.get(config)
            if hasher is None:
                hasher = self._hashers[config] = BlockHasher(config)
            return hasher

    def hash_chat(self, body: Mapping[str, Any], config: HashConfig) -> PromptHashes:
        """Hashes of a ``/v1/chat/completions`` body for workers hashing with ``config``."""
        token_ids = self.renderer(_model_of(body)).chat_token_ids(body)
        return self._hash(token_ids, body, config)

    def hash_responses(self, body: Mapping[str, Any], config: HashConfig) -> PromptHashes:
        """Hashes of a ``/v1/responses`` body, rendered as vLLM renders it (through the
        chat template: responses_input.py); raises :class:`UnsupportedPrompt` for one
        whose prompt is not all in the body (``previous_response_id``) or not reproduced."""
        chat = responses_chat_body(body)
        token_ids = self.renderer(_model_of(chat)).chat_token_ids(
            chat, function_keys=RESPONSES_FUNCTION_KEYS)
        return self._hash(token_ids, chat, config)

    def hash_completion(self, body: Mapping[str, Any], config: HashConfig,
                        first_only: bool = False) -> list[PromptHashes]:
        """Hashes of each prompt of a ``/v1/completions`` body; ``first_only``: of its
        first prompt alone (the others are not even tokenized)."""
        prompts = self.renderer(_model_of(body)).completion_token_ids(body, first_only)
        return [self._hash(t, body, config) for t in prompts]

    def _hash(self, token_ids: list[int], body: Mapping[str, Any], config: HashConfig
              ) -> PromptHashes:
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise PromptRenderError("'cache_salt' must be a string")
        hashes = self.block_hasher(config).block_hashes(token_ids, cache_salt=salt)
        return PromptHashes(tuple(token_ids), tuple(hashes), config.block_size)


def _model_of(body: Mapping[str, Any]) -> str:
    if not isinstance(body, Mapping) or not isinstance(body.get("model"), str):
        raise PromptRenderError("request body needs a string 'model'")
    return body["model"]


def _load_renderer(source: ModelTokenizerSource) -> PromptRenderer:
    return PromptRenderer.from_pretrained(
        source.path, chat_template=source.chat_template,
        default_chat_template_kwargs=source.default_chat_template_kwargs,
        exclude_tools_when_tool_choice_none=source.exclude_tools_when_tool_choice_none)


def _source_key(source: ModelTokenizerSource) -> tuple[Any, ...]:
    """What makes two sources render alike (the kwargs mapping made hashable)."""
    kwargs = source.default_chat_template_kwargs
    return (str(source.path), source.chat_template,
            repr(sorted(kwargs.items())) if kwargs else None,
            source.exclude_tools_when_tool_choice_none)
