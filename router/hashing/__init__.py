"""vLLM-compatible prompt hashing for the router (DESIGN §4).

``RequestHasher(sources).hash_chat(body, HashConfig.from_status(status))`` gives the token
ids and the 64-bit block-hash chain a vLLM worker would compute for the request, so the
router can ask the cluster KV index how much of the prompt each worker already caches.
"""

from kvhint.router.hashing.blocks import (
    DEFAULT_NONE_HASH_SEED,
    SUPPORTED_HASH_ALGOS,
    BlockHasher,
    HashConfig,
)
from kvhint.router.hashing.errors import (
    HashingError,
    PromptRenderError,
    UnknownModel,
    UnsupportedHashConfig,
    UnsupportedPrompt,
)
from kvhint.router.hashing.prompts import PromptRenderer
from kvhint.router.hashing.request import ModelTokenizerSource, PromptHashes, RequestHasher

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "SUPPORTED_HASH_ALGOS",
    "BlockHasher",
    "HashConfig",
    "HashingError",
    "ModelTokenizerSource",
    "PromptHashes",
    "PromptRenderError",
    "PromptRenderer",
    "RequestHasher",
    "UnknownModel",
    "UnsupportedHashConfig",
    "UnsupportedPrompt",
]
