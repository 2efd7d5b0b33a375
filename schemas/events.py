"""KV event batches: engine plugin -> router on ``<prefix>.v1.events.<worker>``.

The payload is vLLM's own msgpack ``KVEventBatch`` (``vllm/distributed/kv_events.py``,
0.32): ``[ts, [event, ...], data_parallel_rank]`` with each event a map tagged by
``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). These types decode
those bytes without importing vLLM; fields vLLM may add later are ignored, and an event
type we do not know is counted in :attr:`DecodedEventBatch.unknown_events`, not fatal.

The per-worker sequence number, the engine epoch and (a hybrid model's) KV-cache group to
follow travel as NATS headers (:class:`EventBatchMeta`, :func:`follows_group`), so the
payload stays byte-for-byte what vLLM would publish.
Block hashes are unsigned 64-bit ints (vLLM's default
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); a publisher that sends raw bytes is
normalised with :func:`external_hash_to_int`, the same low-64-bits rule vLLM applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import msgspec

from kvhint.schemas._codec import HOSTILE_INPUT_ERRORS, U64_MAX, WireDecodeError
from kvhint.schemas.status import epoch_problem

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


def cleared_medium(follows_a_clear: bool) -> str:
    """The medium an ``AllBlocksCleared`` clears; vLLM's names none. vLLM 0.32 emits one
    per pool ``reset_prefix_cache`` resets, into one queue: the GPU pool's, then with
    HiSparse its host pool's. So the first of a run of clears in one batch is the GPU
    tier's and each further one the CPU tier's; the plugin publishes such a pair itself
    when vLLM's connector reset empties its host tier. The plugin's index and every
    router read the stream by this one rule."""
    return MEDIUM_CPU if follows_a_clear else MEDIUM_GPU


HEADER_WORKER = "Kvhint-Worker"
HEADER_EPOCH = "Kvhint-Epoch"
HEADER_SEQ = "Kvhint-Seq"
# The KV-cache group whose block events the index follows; absent: group 0.
HEADER_GROUP = "Kvhint-Group"


def follows_group(group_idx: int | None, group: int) -> bool:
    """Whether an event of KV-cache group ``group_idx`` (None: vLLM named none, group 0)
    is one an index follows when it follows ``group``. A hybrid model's vLLM repeats each
    block hash once per group, and the groups evict apart: a sliding-window or Mamba
    group drops blocks the full-attention group keeps, and keeps ones it dropped. vLLM
    orders groups by the layer types' first appearance, so group 0 is the sliding-window
    group of Gemma 3 and gpt-oss and the Mamba group of most Mamba hybrids; the plugin
    follows the first full-attention group (the one its prefix lookups use) and names it
    in each batch's ``Kvhint-Group`` header. The plugin's index and every router read the
    stream by this one rule."""
    return (group_idx or 0) == group


def external_hash_to_int(value: int | bytes) -> int:
    """vLLM's external block hash as an int: ints pass, bytes keep their low 64 bits."""
    if isinstance(value, int):
        return value
    return int.from_bytes(value, byteorder="big") & U64_MAX


class KVCacheEvent(msgspec.Struct, frozen=True, tag=True, omit_defaults=True, gc=False):
    """Base of the tagged event union (tag = class name, as in vLLM)."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    # Required (no default), as in vLLM, so vLLM's decoder accepts what we encode.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


KnownEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KnownEvent]
    data_parallel_rank: int | None = None


class _LooseBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class DecodedEventBatch:
    ts: float
    events: list[KnownEvent]
    data_parallel_rank: int | None
    unknown_events: int = 0


class EventBatchDecoder:
    """Decodes vLLM msgpack event batches; reuse one instance (it caches the decoder)."""

    def __init__(self) -> None:
        self._strict = msgspec.msgpack.Decoder(KVEventBatch)
        self._loose = msgspec.msgpack.Decoder(_LooseBatch)

    def decode(self, data: bytes) -> DecodedEventBatch:
        return DecodedEventBatch(*_decode_lenient(self._strict, self._loose, KnownEvent, data))


def _decode_lenient(strict: msgspec.msgpack.Decoder, loose: msgspec.msgpack.Decoder,
                    union: Any, data: bytes) -> tuple[float, list[Any], int | None, int]:
    """(ts, events, data_parallel_rank, unknown_events): the strict decoder first; if an
    event does not fit ``union``, keep every event that does and count the rest."""
    try:
        batch = strict.decode(data)
        return batch.ts, batch.events, batch.data_parallel_rank, 0
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    except HOSTILE_INPUT_ERRORS as exc:  # nested too deeply, not bytes
        raise WireDecodeError(f"invalid KV event batch: {exc}") from exc
    try:
        lenient = loose.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, *HOSTILE_INPUT_ERRORS) as exc:
        raise WireDecodeError(f"invalid KV event batch: {exc}") from exc
    events: list[Any] = []
    unknown = 0
    known_tags = _tags(union)
    for raw in lenient.events:
        try:
            events.append(msgspec.convert(raw, union))
        except msgspec.ValidationError as exc:
            tag = _tag_of(raw)
            if tag in known_tags:
                # A residency event we cannot read: skipping it would leave the index
                # wrong for good (a removal missed is a false hit forever), so the batch
                # is undecodable and its worker resyncs.
                raise WireDecodeError(f"invalid {tag} event: {exc}") from exc
            unknown += 1
    return lenient.ts, events, lenient.data_parallel_rank, unknown


def _tags(union: Any) -> frozenset[str]:
    return frozenset(t.__struct_config__.tag for t in get_args(union))


def _tag_of(raw: Any) -> Any:
    """A raw event's type tag: the first item of an array-like event (vLLM's form), or
    the ``type`` key of a map."""
    if isinstance(raw, list) and raw:
        return raw[0]
    if isinstance(raw, dict):
        return raw.get("type")
    return None


# --- Summaries: what a router's index reads, decoded without the token ids -------------
# A BlockStored carries block_size token ids per block; a router only needs the hashes,
# the parent, the medium, the group and the session. These structs name only those fields,
# so msgspec skips the rest of each event without allocating it (2-3x faster decoding).


class BlockStoredSummary(msgspec.Struct, frozen=True, tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    block_size: int
    medium: str | None = None
    group_idx: int | None = None
    session_id: str | None = None


class BlockRemovedSummary(msgspec.Struct, frozen=True, tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksClearedSummary(msgspec.Struct, frozen=True, tag="AllBlocksCleared", gc=False):
    pass


EventSummary = BlockStoredSummary | BlockRemovedSummary | AllBlocksClearedSummary


class _SummaryBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    ts: float
    events: list[EventSummary]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class DecodedEventSummaries:
    ts: float
    events: list[EventSummary]
    data_parallel_rank: int | None
    unknown_events: int = 0


class EventSummaryDecoder:
    """Decodes vLLM msgpack event batches into :data:`EventSummary` structs (no token
    ids); unknown event types are counted, as in :class:`EventBatchDecoder`."""

    def __init__(self) -> None:
        self._strict = msgspec.msgpack.Decoder(_SummaryBatch)
        self._loose = msgspec.msgpack.Decoder(_LooseBatch)

    def decode(self, data: bytes) -> DecodedEventSummaries:
        return DecodedEventSummaries(*_decode_lenient(self._strict, self._loose, EventSummary,
                                                      data))


def encode_event_batch(batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)


@dataclass(frozen=True, slots=True)
class EventBatchMeta:
    """Where a batch sits in its worker's stream. ``seq`` starts at 1 for each epoch;
    ``epoch`` changes whenever the engine (and so its cache) restarts."""

    worker_id: str
    epoch: str
    seq: int
    # The KV-cache group the batch's reader follows (:func:`follows_group`); sent only
    # when not 0, so a single-group engine's headers are what they were.
    group: int = 0

    def to_headers(self) -> dict[str, str]:
        headers = {HEADER_WORKER: self.worker_id, HEADER_EPOCH: self.epoch,
                   HEADER_SEQ: str(self.seq)}
        if self.group:
            headers[HEADER_GROUP] = str(self.group)
        return headers

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> EventBatchMeta:
        if not headers:
            raise WireDecodeError("KV event batch has no headers (need worker, epoch, seq)")
        try:
            seq = int(headers[HEADER_SEQ])
            group = int(headers.get(HEADER_GROUP) or 0)
            meta = cls(headers[HEADER_WORKER], headers[HEADER_EPOCH], seq, group)
        except KeyError as exc:
            raise WireDecodeError(f"KV event batch lacks header {exc.args[0]}") from exc
        except ValueError as exc:
            raise WireDecodeError(
                f"KV event batch has a non-integer {HEADER_SEQ} or {HEADER_GROUP}") from exc
        if seq < 1:
            raise WireDecodeError(f"KV event batch has {HEADER_SEQ} {seq} (they start at 1)")
        if group < 0:
            raise WireDecodeError(f"KV event batch has {HEADER_GROUP} {group} (a group index)")
        if (problem := epoch_problem(meta.epoch)) is not None:
            raise WireDecodeError(f"KV event batch: {problem}")
        return meta
