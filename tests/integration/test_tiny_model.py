"""The tiny model is deterministic and has the shape the CPU backend accepts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvhint.router.devstack.tiny_model import build_tiny_model


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def test_rebuild_gives_identical_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_dir)


def test_shape_and_chat_template(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["head_dim"] == 64 and config["num_hidden_layers"] == 2
    assert config["vocab_size"] == 512
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"


def test_second_build_is_skipped(tiny_model_dir: Path) -> None:
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before
