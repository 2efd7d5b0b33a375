"""Our event types decode the bytes vLLM 0.32's own classes encode."""

from __future__ import annotations

import msgspec

from kvhint import schemas as s


def test_decodes_vllm_encoded_batches() -> None:
    from vllm.distributed import kv_events as v

    big = 2**64 - 59
    vllm_batch = v.KVEventBatch(
        ts=1234.5,
        events=[
            v.BlockStored(block_hashes=[big, 3], parent_block_hash=9, token_ids=list(range(64)),
                          block_size=32, lora_id=None, medium=v.MEDIUM_GPU, lora_name=None,
                          extra_keys=[("salt-a",), None], group_idx=0,
                          kv_cache_spec_kind="full_attention", session_id="tenant/s1"),
            v.BlockRemoved(block_hashes=[big], medium=v.MEDIUM_CPU, group_idx=0),
            v.AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    data = msgspec.msgpack.Encoder().encode(vllm_batch)
    decoded = s.EventBatchDecoder().decode(data)
    assert decoded.ts == 1234.5 and decoded.data_parallel_rank == 2
    assert decoded.unknown_events == 0
    stored, removed, cleared = decoded.events
    assert isinstance(stored, s.BlockStored)
    assert stored.block_hashes == [big, 3] and stored.parent_block_hash == 9
    assert stored.token_ids == list(range(64)) and stored.block_size == 32
    assert stored.session_id == "tenant/s1" and stored.medium == "GPU"
    assert stored.group_idx == 0 and stored.extra_keys == [("salt-a",), None]
    assert isinstance(removed, s.BlockRemoved) and removed.medium == "CPU"
    assert removed.block_hashes == [big]
    assert isinstance(cleared, s.AllBlocksCleared)


def test_vllm_decodes_what_we_encode() -> None:
    from vllm.distributed import kv_events as v

    ours = s.KVEventBatch(ts=1.0, events=[
        s.BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[1], block_size=1,
                      lora_id=None, medium="GPU", lora_name=None, session_id="x"),
        s.BlockRemoved(block_hashes=[5], medium="GPU"),
    ])
    theirs = msgspec.msgpack.Decoder(v.KVEventBatch).decode(s.encode_event_batch(ours))
    assert theirs.events[0].session_id == "x" and theirs.events[0].block_hashes == [5]
    assert isinstance(theirs.events[1], v.BlockRemoved)


def test_envelope_matches_vllm_kv_hints_protocol() -> None:
    from vllm.v1.kv_hints import protocol as p

    ours = s.KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        s.make_action("a", s.PinPayload(target=s.Target(session_id="x"), ttl_s=5.0))])
    theirs = msgspec.json.decode(s.encode_hints(ours), type=p.KvHintsEnvelope)
    assert theirs.actions[0].action_type == "kv.pin"
    assert msgspec.json.encode(theirs) == s.encode_hints(ours)
