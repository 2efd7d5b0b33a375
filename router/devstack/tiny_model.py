"""A deterministic tiny Llama for tests and the dev stack (DESIGN §6).

Hidden 256, 2 layers, 4 heads (head_dim 64: the CPU backend rejects 16), a 512-token
byte-level BPE tokenizer trained on a fixed corpus, seeded random weights and a chat
template that renders system/user/assistant/tool turns. Same version, same bytes: the
build is skipped when ``BUILD_INFO.json`` already names this recipe.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

RECIPE_VERSION = "tiny-llama-v1"
VOCAB_SIZE = 512
SEED = 1234

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|tool|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% elif message['content'] is none %}{% set content = '' %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ content }}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "[call {{ call['function']['name'] }} {{ call['function']['arguments'] }}]"
    "{% endfor %}{% endif %}"
    "<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A fixed training corpus: enough English-ish text and code for merges to be stable.
_CORPUS_LINES = [
    "You are a helpful assistant that uses tools to answer questions about files.",
    "The user asked for the weather in Paris; call the weather tool with the city name.",
    "def search(query: str, limit: int = 10) -> list[str]: return index.lookup(query)[:limit]",
    "Read the document carefully, then summarise each section in one sentence.",
    "Tool result: 42 files matched the pattern, 3 of them were modified today.",
    "The quick brown fox jumps over the lazy dog while the cache keeps every block.",
    "Session turns share a long system prompt, tool schemas and the conversation so far.",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { }",
]


def _corpus() -> list[str]:
    return [line for _ in range(20) for line in _CORPUS_LINES]


def is_built(model_dir: Path) -> bool:
    info = model_dir / "BUILD_INFO.json"
    if not info.exists():
        return False
    try:
        return json.loads(info.read_text()).get("recipe") == RECIPE_VERSION
    except (OSError, json.JSONDecodeError):
        return False


def build_tiny_model(model_dir: Path) -> Path:
    """Build the model into ``model_dir`` unless it is already there; returns the path.

    Built in a temporary sibling folder and renamed into place, so an interrupted build
    never leaves a half-written model that looks finished.
    """
    model_dir = Path(model_dir)
    if is_built(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=model_dir.parent))
    try:
        _write_tokenizer(staging)
        _write_weights(staging)
        (staging / "BUILD_INFO.json").write_text(
            json.dumps({"recipe": RECIPE_VERSION, "seed": SEED}, indent=2) + "\n"
        )
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def _write_tokenizer(out: Path) -> None:
    # One thread: BPE merges must not depend on scheduling.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _write_weights(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_json = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])}
    vocab_size = max([*vocab.values(), *added.values()]) + 1
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=added["<|bos|>"],
        eos_token_id=added["<|eos|>"],
        pad_token_id=added["<|pad|>"],
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(mean=0.0, std=0.05)
    model.save_pretrained(str(out), safe_serialization=True)
