"""Golden tests: the exact JSON (or msgpack) of every wire message.

A change here is a wire-contract change: bump the version it belongs to, do not just
regenerate. To regenerate after an intended change: KVHINT_UPDATE_GOLDEN=1 pytest this file.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from kvhint import schemas as s

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
AT = 1_790_000_000.25
BIG_HASH = 18_446_744_073_709_551_557  # close to 2**64: must survive JSON exactly


def _envelope() -> s.KvHintsEnvelope:
    return s.KvHintsEnvelope(
        protocol_version="1",
        message_id="msg-1",
        actions=[
            s.make_action("a-retain", s.RetainPayload(
                target=s.Target(session_id="tenant-a/sess-1"), priority=80, ttl_s=120.0)),
            s.make_action("a-pin", s.PinPayload(
                target=s.Target(session_id="tenant-a/sess-1", prefix_tokens=4096), ttl_s=30.0,
                expires_at=AT + 5)),
            s.make_action("a-demote", s.DemotePayload(
                target=s.Target(block_hashes=[BIG_HASH, 7]))),
            s.make_action("a-prefetch", s.PrefetchPayload(
                target=s.Target(session_id="tenant-a/sess-2"), deadline_s=2.5)),
            s.make_action("a-share", s.SharePayload(
                target=s.Target(session_id="tenant-a/sess-2"), destination_worker="w1",
                ttl_s=60.0)),
        ],
    )


SAMPLES: dict[str, tuple[object, type]] = {
    "hints_envelope": (_envelope(), s.KvHintsEnvelope),
    # kv.retain / kv.pin 1.1: evict_rest_first (the 1.0 envelope above is unchanged).
    "hints_envelope_v1_1": (s.KvHintsEnvelope(protocol_version="1", message_id="msg-2", actions=[
        s.make_action("a-retain", s.RetainPayload(
            target=s.Target(session_id="tenant-a/sess-1", prefix_tokens=8192), priority=61,
            ttl_s=45.0, evict_rest_first=True)),
        s.make_action("a-pin", s.PinPayload(
            target=s.Target(session_id="tenant-a/sess-2", prefix_tokens=4096), ttl_s=12.0,
            evict_rest_first=True)),
    ]), s.KvHintsEnvelope),
    # kv.retain / kv.pin / kv.demote 1.2: owner (a planner's action is sent as before).
    "hints_envelope_v1_2": (s.KvHintsEnvelope(protocol_version="1", message_id="msg-3", actions=[
        s.make_action("a-pin", s.PinPayload(
            target=s.Target(session_id="tenant-a/sess-1"), ttl_s=600.0,
            owner=s.HintOwner.AGENT)),
        s.make_action("a-retain", s.RetainPayload(
            target=s.Target(session_id="tenant-a/sess-1", prefix_tokens=8192), priority=90,
            evict_rest_first=True, owner=s.HintOwner.AGENT)),
        s.make_action("a-demote", s.DemotePayload(
            target=s.Target(session_id="tenant-a/sess-1"), owner=s.HintOwner.AGENT)),
    ]), s.KvHintsEnvelope),
    # kv.prefetch 1.2: owner (ranks the retain that keeps its blocks in G1).
    "hints_envelope_v1_2_prefetch": (s.KvHintsEnvelope(
        protocol_version="1", message_id="msg-4", actions=[
            s.make_action("a-prefetch", s.PrefetchPayload(
                target=s.Target(session_id="tenant-a/sess-1"), deadline_s=10.0,
                owner=s.HintOwner.AGENT))]), s.KvHintsEnvelope),
    "hint_outcome": (s.HintOutcome(
        message_id="msg-1", action_id="a-pin", action_type="kv.pin", worker_id="w0",
        status=s.OutcomeStatus.CLIPPED, reason="pin budget: 64 of 128 blocks",
        requested=s.Amount(blocks=128, tokens=4096), applied=s.Amount(blocks=64, tokens=2048),
        at=AT), s.HintOutcome),
    # HintOutcome 1.1: waits_for, on the deferred of a Prefetch whose wait the prefetch
    # budget clipped (the 1.0 outcome above, which every other answer still is, is
    # unchanged).
    "hint_outcome_v1_1": (s.HintOutcome(
        message_id="msg-4", action_id="a-prefetch", action_type="kv.prefetch",
        worker_id="w0", status=s.OutcomeStatus.DEFERRED,
        reason="prefetch budget: 3 of 12 blocks may wait: waiting for the first 3",
        requested=s.Amount(blocks=12, tokens=384), applied=s.Amount(blocks=1, tokens=32),
        at=AT, waits_for=s.Amount(blocks=3, tokens=96)), s.HintOutcome),
    "holds_released": (s.HoldsReleased(worker_id="w0", releases=[
        s.HoldRelease(action_id="a-retain", action_type="kv.retain", session_id="tenant-a/sess-1",
                      reason=s.ReleaseReason.DISPLACED, released=s.Amount(blocks=3, tokens=96),
                      held=s.Amount(blocks=5, tokens=160)),
        s.HoldRelease(action_id="a-shared", action_type="kv.retain", session_id=None,
                      reason=s.ReleaseReason.PRESSURE, released=s.Amount(blocks=2, tokens=64),
                      held=s.Amount()),
    ], at=AT), s.HoldsReleased),
    # HoldsReleased 1.1: reason gone (the 1.0 message above is unchanged).
    "holds_released_v1_1": (s.HoldsReleased(worker_id="w0", releases=[
        s.HoldRelease(action_id="a-pin", action_type="kv.pin", session_id="tenant-a/sess-1",
                      reason=s.ReleaseReason.GONE, released=s.Amount(blocks=2, tokens=64),
                      held=s.Amount(blocks=1, tokens=32)),
    ], at=AT), s.HoldsReleased),
    "donor_advice": (s.DonorAdvice(
        advice_id="adv-1", session_id="tenant-a/sess-9", namespace="tiny|sha256|32|salt:a",
        donor_session_id="tenant-a/sess-3", donor_block_hashes=[1, 2, BIG_HASH],
        similarity=0.82, evidence="minhash 0.82 over 12 chunks", ttl_s=30.0, at=AT),
        s.DonorAdvice),
    "worker_status": (s.WorkerStatus(
        worker_id="w0", epoch="e-5f2c", model="tiny", cache_namespace="tiny|sha256|32",
        block_size=32, hash_algo="sha256", none_hash_seed="vllm-none-hash",
        data_parallel_rank=0,
        supported_actions={"kv.retain": ["1.0"], "kv.pin": ["1.0"], "kv.prefetch": ["1.0"]},
        host_tier=False,
        budgets=s.Budgets(max_pinned_blocks=51, max_pin_ttl_s=600.0, max_retained_blocks=256,
                          max_retain_ttl_s=3600.0),
        usage=s.Usage(gpu_blocks_total=512, gpu_blocks_free=100, kv_usage=0.8,
                      pinned_blocks=10, retained_blocks=20, indexed_blocks=400, sessions=7,
                      active_requests=2, pending_hints=1),
        last_event_seq=42, interval_s=1.0, at=AT), s.WorkerStatus),
    # WorkerStatus 1.1: http_dp_rank, rank 1 of a vLLM server's data-parallel ranks (the
    # 1.0 status above, which a single-rank worker still sends, is unchanged).
    "worker_status_v1_1": (s.WorkerStatus(
        worker_id="gpu-0-dp1", epoch="e-5f2c", model="tiny", cache_namespace="tiny|sha256|32",
        block_size=32, hash_algo="sha256", none_hash_seed="vllm-none-hash",
        data_parallel_rank=1, supported_actions={"kv.retain": ["1.0"], "kv.pin": ["1.0"]},
        host_tier=False,
        budgets=s.Budgets(max_pinned_blocks=51, max_pin_ttl_s=600.0, max_retained_blocks=256,
                          max_retain_ttl_s=3600.0),
        usage=s.Usage(gpu_blocks_total=512, gpu_blocks_free=100, kv_usage=0.8),
        last_event_seq=42, interval_s=1.0, at=AT, http_url="http://gpu-0:8000",
        http_dp_rank=1), s.WorkerStatus),
    # WorkerStatus 1.2: hash_block_size, a hybrid model's chain hashed per 16 tokens under
    # 32-token blocks (other workers send the 1.1 form above, unchanged).
    "worker_status_v1_2": (s.WorkerStatus(
        worker_id="w0", epoch="e-5f2c", model="tiny-hybrid",
        cache_namespace="tiny-hybrid|sha256|32", block_size=32, hash_algo="sha256",
        none_hash_seed="vllm-none-hash", data_parallel_rank=0,
        supported_actions={"kv.retain": ["1.0"]}, host_tier=False,
        budgets=s.Budgets(max_pinned_blocks=51, max_pin_ttl_s=600.0, max_retained_blocks=256,
                          max_retain_ttl_s=3600.0),
        usage=s.Usage(gpu_blocks_total=512, gpu_blocks_free=100, kv_usage=0.8),
        last_event_seq=42, interval_s=1.0, at=AT, hash_block_size=16), s.WorkerStatus),
    # WorkerStatus 1.3: claim_cost, Gemma 3's layout (one full-attention group, five
    # sliding-window groups of 2 blocks): a claim of n positions takes n + 5 x min(n, 2)
    # pool blocks (one-group workers send the 1.2 form above, unchanged).
    "worker_status_v1_3": (s.WorkerStatus(
        worker_id="w0", epoch="e-5f2c", model="tiny-gemma",
        cache_namespace="tiny-gemma|sha256|16", block_size=16, hash_algo="sha256",
        none_hash_seed="vllm-none-hash", data_parallel_rank=0,
        supported_actions={"kv.retain": ["1.0"], "kv.pin": ["1.0"]}, host_tier=False,
        budgets=s.Budgets(max_pinned_blocks=51, max_pin_ttl_s=600.0, max_retained_blocks=256,
                          max_retain_ttl_s=3600.0),
        usage=s.Usage(gpu_blocks_total=512, gpu_blocks_free=100, kv_usage=0.8),
        last_event_seq=42, interval_s=1.0, at=AT,
        claim_cost=s.ClaimCost(per_position=1, tails=[2, 2, 2, 2, 2])), s.WorkerStatus),
    "snapshot_request": (s.SnapshotRequest(cursor=2000, limit=1000, seq=41), s.SnapshotRequest),
    "response_cancelled": (s.ResponseCancelled(
        origin="3f2a9c0d1e7b4a65", response_id="resp_w0_" + "ab" * 16 + "s0000000012345678"
        + "9abcdef012345678", tenant="acme", worker_id="w0", at=AT), s.ResponseCancelled),
    "worker_snapshot": (s.WorkerSnapshot(
        worker_id="w0", epoch="e-5f2c", seq=42, block_size=32,
        blocks=[s.SnapshotBlock(11, None, "GPU"), s.SnapshotBlock(12, 11, "GPU")],
        sessions=[s.SnapshotSession("tenant-a/sess-1", [12])], next_cursor=None),
        s.WorkerSnapshot),
    "snapshot_refused": (s.SnapshotRefused(
        worker_id="w0", error="worker inbox full (1 messages waiting for the scheduler); "
                              "no snapshot taken, ask again"), s.SnapshotRefused),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_json_matches_golden(name: str) -> None:
    message, type_ = SAMPLES[name]
    encoded = msgspec.json.format(msgspec.json.encode(message), indent=2) + b"\n"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("KVHINT_UPDATE_GOLDEN") == "1":
        path.write_bytes(encoded)
    assert encoded == path.read_bytes(), f"wire form of {name} changed"
    assert msgspec.json.decode(path.read_bytes(), type=type_) == message


def test_event_batch_msgpack_matches_golden() -> None:
    batch = s.KVEventBatch(ts=AT, events=[
        s.BlockStored(block_hashes=[BIG_HASH], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                      block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                      session_id="tenant-a/sess-1"),
        s.BlockRemoved(block_hashes=[BIG_HASH], medium="GPU", group_idx=0),
        s.AllBlocksCleared(),
    ], data_parallel_rank=0)
    encoded = s.encode_event_batch(batch)
    path = GOLDEN / "kv_event_batch.msgpack.hex"
    if os.environ.get("KVHINT_UPDATE_GOLDEN") == "1":
        path.write_text(encoded.hex() + "\n")
    assert encoded.hex() == path.read_text().strip()
    decoded = s.EventBatchDecoder().decode(encoded)
    assert decoded.events == batch.events and decoded.data_parallel_rank == 0


def test_every_exported_message_has_a_golden() -> None:
    from kvhint.schemas.export import MESSAGES

    covered = {type_ for _, type_ in SAMPLES.values()} | {s.KVEventBatch}
    payloads = {s.RetainPayload, s.PinPayload, s.DemotePayload, s.PrefetchPayload,
                s.SharePayload}  # inside hints_envelope
    assert set(MESSAGES.values()) <= covered | payloads


def test_worker_status_1_0_and_1_1_say_which_data_parallel_header_to_send() -> None:
    """A 1.0 status (an older plugin's, or a single-rank worker's) asks for no
    X-data-parallel-rank header; 1.1 names the rank; null is read as no header."""
    old = s.decode_status((GOLDEN / "worker_status.json").read_bytes())
    new = s.decode_status((GOLDEN / "worker_status_v1_1.json").read_bytes())
    assert old.data_parallel_header is None and new.data_parallel_header == 1
    nulled = msgspec.json.decode((GOLDEN / "worker_status_v1_1.json").read_bytes())
    nulled["http_dp_rank"] = None
    assert s.decode_status(msgspec.json.encode(nulled)).data_parallel_header is None
    nulled["http_dp_rank"] = -1
    with pytest.raises(s.WireDecodeError):
        s.decode_status(msgspec.json.encode(nulled))


class _HintOutcome10(msgspec.Struct, frozen=True, kw_only=True):
    """HintOutcome as a 1.0 router declares it (no ``waits_for``)."""

    message_id: str
    action_id: str
    action_type: str = ""
    worker_id: str
    status: s.OutcomeStatus
    reason: str = ""
    requested: s.Amount = s.Amount()
    applied: s.Amount = s.Amount()
    at: float


def test_hint_outcome_1_0_and_1_1_read_both_ways() -> None:
    """A 1.0 router reads a 1.1 deferred, ignoring ``waits_for``; a 1.1 router reads a
    1.0 plugin's outcome as waiting for nothing less than it requested."""
    new = (GOLDEN / "hint_outcome_v1_1.json").read_bytes()
    old_reading = msgspec.json.decode(new, type=_HintOutcome10)
    assert (old_reading.status, old_reading.requested.blocks) == (s.OutcomeStatus.DEFERRED, 12)
    assert s.decode_outcome(new).waits_for == s.Amount(blocks=3, tokens=96)
    old = s.decode_outcome((GOLDEN / "hint_outcome.json").read_bytes())
    assert old.waits_for is msgspec.UNSET
    assert b"waits_for" not in s.encode_outcome(old)


class _WorkerStatus12(msgspec.Struct, frozen=True, kw_only=True):
    """WorkerStatus as a 1.2 router declares it (no ``claim_cost``; the fields it
    ignores too are left out: unknown fields are ignored)."""

    worker_id: str
    block_size: int
    budgets: s.Budgets
    hash_block_size: int | msgspec.UnsetType = msgspec.UNSET


def test_worker_status_1_2_and_1_3_read_both_ways() -> None:
    """A 1.2 router reads a 1.3 status, ignoring ``claim_cost``; a 1.3 router reads a
    1.2 (or one-group) status as one pool block a position, and a one-group status
    encodes without the field."""
    new = (GOLDEN / "worker_status_v1_3.json").read_bytes()
    old_reading = msgspec.json.decode(new, type=_WorkerStatus12)
    assert (old_reading.worker_id, old_reading.budgets.max_pinned_blocks) == ("w0", 51)
    assert s.decode_status(new).claim_cost == s.ClaimCost(per_position=1, tails=[2] * 5)
    for name in ("worker_status", "worker_status_v1_1", "worker_status_v1_2"):
        old = s.decode_status((GOLDEN / f"{name}.json").read_bytes())
        assert old.claim_cost is msgspec.UNSET
        assert b"claim_cost" not in s.encode_status(old)
    for bad in ({"per_position": 0, "tails": []}, {"per_position": 1, "tails": [0]}):
        raw = msgspec.json.decode(new)
        raw["claim_cost"] = bad
        with pytest.raises(s.WireDecodeError):
            s.decode_status(msgspec.json.encode(raw))


class _WorkerSnapshotBefore(msgspec.Struct, frozen=True, kw_only=True):
    """WorkerSnapshot as a router before SnapshotRefused declares it (its decoder)."""

    worker_id: str
    epoch: str
    seq: int
    block_size: int
    blocks: list[s.SnapshotBlock]
    sessions: list[s.SnapshotSession]
    next_cursor: int | None = None


# The whole reply of a plugin before SnapshotRefused 1.0 to a request it could not serve.
_REFUSAL_BEFORE_1_0 = (b'{"error":"worker inbox full (1 messages waiting for the scheduler)'
                       b'; no snapshot taken, ask again"}')


def test_snapshot_refused_1_0_and_the_error_reply_before_it_read_both_ways() -> None:
    """A router before 1.0 reads a 1.0 refusal as no page (a failed request: asked again,
    as it did the ``{"error"}`` reply); a 1.0 router reads the ``{"error"}`` reply of a
    plugin before it as a refusal, its reason kept, and a page as a page."""
    new = (GOLDEN / "snapshot_refused.json").read_bytes()
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(new, type=_WorkerSnapshotBefore)
    with pytest.raises(s.WireDecodeError):
        s.decode_snapshot(new)
    assert s.decode_snapshot_reply(new) == SAMPLES["snapshot_refused"][0]
    old = s.decode_snapshot_reply(_REFUSAL_BEFORE_1_0)
    assert old == s.SnapshotRefused(worker_id=None, error=SAMPLES["snapshot_refused"][0].error)
    page = (GOLDEN / "worker_snapshot.json").read_bytes()
    assert s.decode_snapshot_reply(page) == SAMPLES["worker_snapshot"][0]
    for bad in (b'{"error": 5}', b'{"worker_id": "w0"}', b"[]", b"not json"):
        with pytest.raises(s.WireDecodeError, match="worker snapshot"):
            s.decode_snapshot_reply(bad)
