"""Text a tenant writes that an operator reads (logs, the dashboard, the admin API):
which characters would let it pass for something else there.

A C0 or C1 control or DEL (Unicode ``Cc``) forges a log line or drives a terminal; a
format character (``Cf``: the bidi overrides and isolates U+202A-U+202E and
U+2066-U+2069, the LRM/RLM/ALM marks, zero-width U+200B-U+200D, U+FEFF, the tag
characters U+E0020-U+E007F) reorders or hides what is shown; a line or paragraph
separator (``Zl``/``Zp``) breaks a line where a viewer reads one; a lone surrogate
(``Cs``) is no text at all. Ids a client chooses (session ids, service/inbound.py) and
names in the admin API's paths and queries (service/admin_api.py) holding one are
refused, by :func:`unsafe_at`; names the router only observes (tool names in a model's
answer) are shown with each escaped (:func:`escaped`).

One joiner is text: U+200D (ZWJ) between two pictographs (pictographic.py) is an emoji
ZWJ sequence ("👨‍👩‍👧", "🏳️‍🌈", "👩🏽‍💻"), which an agent may well put in an id. The
pictograph before it may carry its variation selector U+FE0F or a skin tone (U+1F3FB-
U+1F3FF), both visible or no-ops (not ``Cf``: never refused). Drawn, such a sequence is
one emoji or its pictographs side by side, so it hides no letter nor reorders any: a ZWJ
anywhere else ("ad\\u200dmin") is refused as before. Like a combining accent, it may
make two distinct ids look alike; it cannot make one read as different text. Pure.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator

from kvhint.router.pictographic import is_pictographic

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_ZWJ = "\u200d"
_EMOJI_PRESENTATION = "\ufe0f"
_SKIN_TONES = ("\U0001f3fb", "\U0001f3ff")  # EMOJI MODIFIER FITZPATRICK 1-2 .. 6


def is_unsafe(ch: str) -> bool:
    """``ch`` is a character of an unsafe category, wherever it stands (a ZWJ too: see
    :func:`unsafe_at` for the one place it is text)."""
    return ch < " " or (ch >= "\x7f" and unicodedata.category(ch) in _UNSAFE_CATEGORIES)


def _joins_pictographs(value: str, at: int) -> bool:
    """The ZWJ at ``at`` stands between two pictographs (an emoji ZWJ sequence)."""
    if at + 1 >= len(value) or not is_pictographic(value[at + 1]):
        return False
    before = at - 1
    if before >= 0 and (value[before] == _EMOJI_PRESENTATION
                        or _SKIN_TONES[0] <= value[before] <= _SKIN_TONES[1]):
        before -= 1
    return before >= 0 and is_pictographic(value[before])


def _unsafe_positions(value: str) -> Iterator[int]:
    for at, ch in enumerate(value):
        if is_unsafe(ch) and not (ch == _ZWJ and _joins_pictographs(value, at)):
            yield at


def unsafe_at(value: str) -> int | None:
    """The index of the first character of ``value`` that would spoof what an operator
    reads, or None."""
    return next(_unsafe_positions(value), None)


def unsafe_char(value: str) -> str | None:
    """The first character of ``value`` that would spoof what an operator reads, or
    None."""
    at = unsafe_at(value)
    return None if at is None else value[at]


def unsafe_refusal(value: str) -> str | None:
    """Why ``value`` may not name anything (the first unsafe character, escaped, and its
    index: ``'\\u202e' at 4``), or None: the message for a refusal, the same wherever a
    name is refused, that never echoes the character raw."""
    at = unsafe_at(value)
    return None if at is None else f"{value[at]!r} at {at}"


def escaped(value: str) -> str:
    """``value`` with each such character written as its escape (``\\u202e``): as
    readable, distinct for distinct values in practice, and shown as written."""
    unsafe = set(_unsafe_positions(value))
    if not unsafe:
        return value
    return "".join(ch.encode("unicode_escape").decode("ascii") if at in unsafe else ch
                   for at, ch in enumerate(value))
