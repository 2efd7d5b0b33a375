"""Errors of the prompt-hashing layer; all are ``ValueError`` with a message a router can
put into a log line, a metric label or (for :class:`PromptRenderError`) a 4xx body."""

from __future__ import annotations


class HashingError(ValueError):
    """Base of every hashing error."""


class UnsupportedHashConfig(HashingError):
    """The worker hashes in a way we cannot reproduce (algorithm, secret seed)."""


class PromptRenderError(HashingError):
    """The request body is malformed for its endpoint (vLLM would answer 400 too)."""


class UnsupportedPrompt(HashingError):
    """A valid request whose tokens we cannot reproduce exactly (images, prompt embeds,
    truncation, LoRA...): route it without predicted overlap."""


class UnknownModel(HashingError):
    """No tokenizer is configured for the requested model."""
