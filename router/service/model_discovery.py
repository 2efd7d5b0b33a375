"""The models a router serves and the hasher that predicts their prompts' blocks: each
worker's ``/v1/models`` (names, adapters, tokenizer paths) unless settings name a
tokenizer, and every model's tokenizer and chat template loaded once before the first
request (runtime.RouterRuntime: at start and at each discovery)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kvhint.router.hashing import HashConfig, ModelTokenizerSource, RequestHasher
from kvhint.router.service.settings import RouterSettings
from kvhint.router.service.settings_sections import ModelPromptSettings
from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.workers import WorkerRegistry

log = logging.getLogger(__name__)


async def warm_hasher(models: dict[str, str], block_size: int,
                      prompts: Mapping[str, ModelPromptSettings]) -> RequestHasher | None:
    """A hasher with every model's tokenizer and chat template loaded (seconds, once),
    so the first request does not pay for it, each rendering as its workers' flags say
    (``prompts``, by served name, "*" for the rest). A model whose tokenizer does not load
    is left out (routed without prompt hashes) rather than retried on every request."""
    sources = {}
    for name, path in models.items():
        flags = prompts.get(name) or prompts.get("*") or ModelPromptSettings()
        sources[name] = ModelTokenizerSource(
            path, chat_template=flags.chat_template,
            default_chat_template_kwargs=flags.default_chat_template_kwargs,
            exclude_tools_when_tool_choice_none=flags.exclude_tools_when_tool_choice_none)
    while sources:
        hasher = RequestHasher(sources)
        failed = None
        for name in sources:
            body = {"model": name, "messages": [{"role": "user", "content": "warm up"}]}
            try:
                await asyncio.to_thread(hasher.hash_chat, body, HashConfig(block_size=block_size))
            except Exception as exc:  # noqa: BLE001 - tokenizer loading raises anything
                log.warning("tokenizer for model %r not usable (%r); routing it without "
                            "prompt hashes", name, exc)
                failed = name
                break
        if failed is None:
            return hasher
        sources.pop(failed)
    return None


async def discover_models(settings: RouterSettings, workers: WorkerRegistry,
                          pool: UpstreamPool) -> dict[str, str]:
    """Served model name -> tokenizer path: from settings, else each worker's /v1/models
    (vLLM reports the model's ``root``, a local path when it serves one). Each worker
    that answers also gets its list of names (``served_models``, adapters included),
    which routing keeps requests to."""
    models: dict[str, str] = {}
    for worker in workers.routable():
        listing = await _listed_models(pool, worker.worker_id, worker.url or "")
        if listing is None:
            continue
        worker.served_models = frozenset(item["id"] for item in listing)
        for item in listing:
            # A LoRA adapter (it names a "parent") hashes its blocks with the adapter as
            # an extra key: the base model's hashes would predict hits it never has, so
            # its requests are routed without prompt hashes.
            if not item.get("parent"):
                models[item["id"]] = str(item.get("root") or item["id"])
    if settings.tokenizer:
        return {name: settings.tokenizer for name in (list(models) or ["default"])}
    return models


async def _listed_models(pool: UpstreamPool, worker_id: str, url: str
                         ) -> list[dict[str, Any]] | None:
    """The entries of ``url``'s /v1/models (worker ``worker_id``: its key goes with it)
    that name a model, or None when it did not answer one."""
    try:
        listing: Any = await pool.get_json(url + "/v1/models", timeout_s=5.0,
                                           worker_id=worker_id)
    except Exception as exc:  # noqa: BLE001 - any failure just means "not known yet"
        log.warning("could not list models at %s: %r", url, exc)
        return None
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        log.warning("%s/v1/models answered no model list", url)
        return None
    return [item for item in listing["data"]
            if isinstance(item, dict) and isinstance(item.get("id"), str)]
