"""pictographic.py's table is Unicode's Extended_Pictographic property, as the ``regex``
module reads it (a test-only check: the router does not depend on ``regex``)."""

from __future__ import annotations

import pytest

from kvhint.router.pictographic import _RANGES, is_pictographic


def test_the_table_is_ordered_and_disjoint() -> None:
    for (first, last), (following, _) in zip(_RANGES, _RANGES[1:]):
        assert first <= last < following - 1  # adjacent ranges would be one


def test_the_table_is_extended_pictographic() -> None:
    regex = pytest.importorskip("regex")
    pictographic = regex.compile(r"\p{Extended_Pictographic}")
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        assert is_pictographic(ch) == bool(pictographic.match(ch)), hex(cp)


def test_emoji_and_not_letters() -> None:
    # Elements of emoji ZWJ sequences, the text-default ones (U+2194, U+2764) too.
    for ch in ("\U0001f468", "\U0001f3f3", "\U0001f308", "\u2764", "\u2194", "\u2642",
               "\U0001f9b0", "\u00a9", "\U0001fae8"):
        assert is_pictographic(ch), hex(ord(ch))
    # Skin tones, the variation selector, regional indicators and text are not.
    for ch in ("a", "\u00e9", "\u65e5", "\U0001f3fb", "\ufe0f", "\U0001f1e6", "\u200d",
               "\x00", "\U0010ffff"):
        assert not is_pictographic(ch), hex(ord(ch))
