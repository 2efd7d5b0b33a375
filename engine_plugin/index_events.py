"""The SessionPrefixIndex's domain events: what the vLLM adapter turns KV cache activity
into, what the index applies, and what a replay feeds to rebuild it. Plain values, no
vLLM, NATS or msgpack."""

from __future__ import annotations

from dataclasses import dataclass

GPU = "GPU"
# The host tier's medium (vLLM's MEDIUM_CPU: its OffloadingConnector's, HiSparse's pool).
CPU = "CPU"


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks ``hashes`` (a chain, root-most first) became resident after ``parent``."""

    hashes: tuple[int, ...]
    parent: int | None
    session_id: str | None = None
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block of ``medium`` is gone. vLLM's AllBlocksCleared names no medium: the
    first of a run of them is the GPU prefix cache's, each further one the CPU tier's (the
    router reads them so, and the vLLM adapter maps them the same way)."""

    medium: str = GPU


@dataclass(frozen=True, slots=True)
class Hit:
    """A request of ``session_id`` reused the resident chain ``hashes`` (root first) from
    the prefix cache. vLLM emits no BlockStored for this, yet it makes the session own the
    chain."""

    session_id: str
    hashes: tuple[int, ...]


IndexEvent = Stored | Removed | Cleared | Hit
