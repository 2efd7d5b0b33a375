"""The chat template of a model's processor, found as vLLM 0.32 finds it.

A multimodal model's processor may carry its own chat template (``chat_template.json``
or the processor's config), and vLLM renders a request without tools with it rather
than the tokenizer's (``renderers/hf.py`` ``resolve_chat_template``, second priority).
The router must render with the same one, or its prompt hashes name blocks the worker
never stores.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# A local model folder with none of these has no processor of its own: AutoProcessor
# would only load the tokenizer again (for a big tokenizer, seconds at every load).
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json",
                    "video_preprocessor_config.json", "chat_template.json")


def processor_chat_template(path: str | Path) -> str | None:
    """The template of the model's ``AutoProcessor`` when that is a ``ProcessorMixin``
    with one (vLLM's ``_try_get_processor_chat_template``); None for a text-only model,
    or when the processor cannot be loaded here, which vLLM treats the same way. A
    worker that can load it where the router cannot (a missing image library) renders
    differently: that is logged."""
    local = Path(path)
    if local.is_dir() and not any((local / name).exists() for name in _PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure: vLLM falls back to the tokenizer too
        log.warning("could not load the processor of %s (%r): rendering with the "
                    "tokenizer's chat template; a worker that loads the processor renders "
                    "requests without tools with the processor's, and their prompt hashes "
                    "will not match", path, exc)
        return None
    template = processor.chat_template if isinstance(processor, ProcessorMixin) else None
    return template if isinstance(template, str) else None
