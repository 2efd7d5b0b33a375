"""Cache namespaces (EngineIdentity.cache_namespace): engines whose NONE_HASH seed is known
and equal share one, so donor advice between them compares hashes; an engine whose seed
is secret (vLLM's xxhash without PYTHONHASHSEED: 32 random bytes per process) shares
its namespace with no other engine, nor with itself after a restart."""

from __future__ import annotations

from kvhint.engine_plugin.core import EngineIdentity


def test_a_known_seed_is_one_namespace_across_engines() -> None:
    a = EngineIdentity("w0", "m", "xxhash", "42")
    b = EngineIdentity("w1", "m", "xxhash", "42")
    assert a.cache_namespace(16) == b.cache_namespace(16)
    assert a.cache_namespace(16) != EngineIdentity("w1", "m", "xxhash", "43").cache_namespace(16)


def test_a_secret_seed_is_a_namespace_of_its_own() -> None:
    a = EngineIdentity("w0", "m", "xxhash", None)
    b = EngineIdentity("w1", "m", "xxhash", None)
    restarted = EngineIdentity("w0", "m", "xxhash", None)
    assert len({a.cache_namespace(16), b.cache_namespace(16),
                restarted.cache_namespace(16)}) == 3
    assert a.cache_namespace(16) == a.cache_namespace(16)
