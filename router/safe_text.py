"""Text a tenant writes that an operator reads (logs, the dashboard, the admin API):
which characters would let it pass for something else there.

A C0 or C1 control or DEL (Unicode ``Cc``) forges a log line or drives a terminal; a
format character (``Cf``: the bidi overrides and isolates U+202A-U+202E and
U+2066-U+2069, the LRM/RLM/ALM marks, zero-width U+200B-U+200D, U+FEFF) reorders or
hides what is shown; a line or paragraph separator (``Zl``/``Zp``) breaks a line where a
viewer reads one; a lone surrogate (``Cs``) is no text at all. Ids a client chooses
(session ids) holding one are refused (service/inbound.py); names the router only
observes (tool names in a model's answer) are shown with each escaped (:func:`escaped`).
Pure.
"""

from __future__ import annotations

import unicodedata

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def is_unsafe(ch: str) -> bool:
    return ch < " " or (ch >= "\x7f" and unicodedata.category(ch) in _UNSAFE_CATEGORIES)


def unsafe_char(value: str) -> str | None:
    """The first character of ``value`` that would spoof what an operator reads, or
    None."""
    for ch in value:
        if is_unsafe(ch):
            return ch
    return None


def escaped(value: str) -> str:
    """``value`` with each such character written as its escape (``\\u202e``): as
    readable, distinct for distinct values in practice, and shown as written."""
    if unsafe_char(value) is None:
        return value
    return "".join(ch.encode("unicode_escape").decode("ascii") if is_unsafe(ch) else ch
                   for ch in value)
