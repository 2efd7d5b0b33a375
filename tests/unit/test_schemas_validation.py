"""Malformed input becomes a typed error (or an InvalidAction) a person can act on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvhint import schemas as s
from kvhint.schemas import releases
from kvhint.schemas.events import EventBatchMeta, EventSummaryDecoder

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _envelope(actions: list[dict], protocol_version: str = "1", message_id: str = "m") -> bytes:
    return json.dumps({"protocol_version": protocol_version, "message_id": message_id,
                       "actions": actions}).encode()


def _action(action_type: str, payload: dict, action_id: str = "a1",
            version: str = "1.0") -> dict:
    return {"action_id": action_id, "action_type": action_type, "action_version": version,
            "payload": payload}


def test_valid_actions_parse_to_typed_payloads() -> None:
    decoded = s.decode_hints(_envelope([
        _action("kv.pin", {"target": {"session_id": "x"}, "ttl_s": 10}),
        _action("kv.retain", {"target": {"block_hashes": [1, 2]}, "priority": 3}, "a2"),
    ]))
    assert decoded.error is None and decoded.message_id == "m"
    pin, retain = decoded.actions
    assert isinstance(pin, s.ParsedAction) and isinstance(pin.payload, s.PinPayload)
    assert pin.payload.ttl_s == 10.0 and pin.payload.target.session_id == "x"
    assert isinstance(retain.payload, s.RetainPayload) and retain.payload.priority == 3


def test_evict_rest_first_rides_on_version_1_1_and_only_there() -> None:
    rest = s.make_action("a1", s.RetainPayload(
        target=s.Target(session_id="x", prefix_tokens=64), priority=40, evict_rest_first=True))
    plain = s.make_action("a2", s.PinPayload(target=s.Target(session_id="x"), ttl_s=5.0))
    assert rest.action_version == s.EVICT_REST_VERSION == "1.1"
    assert plain.action_version == s.ACTION_VERSION == "1.0"
    assert "evict_rest_first" not in plain.payload  # a 1.0 worker reads it as before
    parsed = s.parse_action(rest)
    assert isinstance(parsed, s.ParsedAction) and parsed.payload.evict_rest_first
    # Workers say they take it by advertising 1.1 for both kv.retain and kv.pin.
    assert s.evict_rest_supported({"kv.retain": ["1.0", "1.1"], "kv.pin": ["1.0", "1.1"]})
    assert not s.evict_rest_supported({"kv.retain": ["1.0", "1.1"], "kv.pin": ["1.0"]})
    assert not s.evict_rest_supported({"kv.retain": ["1.0"]})
    # A 1.1 action without the field is still a plain retain.
    bare = s.parse_action(s.KvHintAction("a3", "kv.retain", "1.1",
                                         {"target": {"session_id": "x"}}))
    assert isinstance(bare, s.ParsedAction) and not bare.payload.evict_rest_first


def test_owner_rides_on_version_1_2_and_a_planners_action_is_sent_as_before() -> None:
    agent = s.make_action("a1", s.RetainPayload(
        target=s.Target(session_id="x", prefix_tokens=64), priority=40, evict_rest_first=True,
        owner=s.HintOwner.AGENT))
    planner = s.make_action("a2", s.DemotePayload(target=s.Target(session_id="x"),
                                                  owner=s.HintOwner.PLANNER))
    assert agent.action_version == s.OWNER_VERSION == "1.2"
    assert agent.payload["owner"] == "agent"
    assert planner.action_version == "1.0" and "owner" not in planner.payload
    parsed = s.parse_action(agent)
    assert isinstance(parsed, s.ParsedAction)
    assert parsed.payload.owner is s.HintOwner.AGENT and parsed.payload.evict_rest_first
    # A 1.2 action without the field is the planner's.
    bare = s.parse_action(s.KvHintAction("a3", "kv.demote", "1.2",
                                         {"target": {"session_id": "x"}}))
    assert isinstance(bare, s.ParsedAction) and bare.payload.owner is s.HintOwner.PLANNER
    # Per action type: a worker without a host tier offers no kv.demote at all.
    supported = {"kv.retain": ["1.0", "1.1", "1.2"], "kv.pin": ["1.0", "1.1"]}
    assert s.owner_supported(supported, "kv.retain")
    assert not s.owner_supported(supported, "kv.pin")
    assert not s.owner_supported(supported, "kv.demote")


@pytest.mark.parametrize(
    ("action", "fragment"),
    [
        (_action("kv.evict", {}), "unsupported action_type 'kv.evict'"),
        (_action("kv.pin", {"target": {"session_id": "x"}}, version="2.0"),
         "unsupported action_version '2.0'"),
        (_action("kv.pin", {"target": {"session_id": "x"}, "ttl_s": -1}), "`$.ttl_s`"),
        (_action("kv.retain", {"target": {"session_id": "x"}, "priority": 101}),
         "`$.priority`"),
        (_action("kv.pin", {"target": {}}), "give session_id, block_hashes"),
        (_action("kv.pin", {"target": {"prefix_tokens": 5}}), "prefix_tokens needs a session_id"),
        (_action("kv.pin", {"target": {"block_hashes": []}}), "block_hashes is empty"),
        (_action("kv.pin", {"target": {"block_hashes": [2**64]}}), "unsigned 64-bit"),
        (_action("kv.pin", {"target": {"block_hashes": [1], "session_id": "x"}}),
         "block_hashes alone"),
        (_action("kv.pin", {"target": {"session_id": "x"}, "colour": "red"}),
         "unknown field `colour`"),
        (_action("kv.share", {"target": {"session_id": "x"}}), "destination_worker"),
        (_action("kv.share", {"target": {"session_id": "x"}, "destination_worker": "a.b"}),
         "destination_worker"),
        (_action("kv.pin", {"target": {"session_id": "x"}}, action_id=""), "action_id is empty"),
        # evict_rest_first is 1.1, for session targets, and only on kv.retain and kv.pin.
        (_action("kv.retain", {"target": {"session_id": "x"}, "evict_rest_first": True}),
         "evict_rest_first needs action_version 1.1 or later"),
        (_action("kv.pin", {"target": {"block_hashes": [1]}, "evict_rest_first": True},
                 version="1.1"), "evict_rest_first needs a session target"),
        (_action("kv.demote", {"target": {"session_id": "x"}}, version="1.1"),
         "unsupported action_version '1.1' for kv.demote"),
        # owner is 1.2, on kv.retain, kv.pin and kv.demote, planner or agent.
        (_action("kv.pin", {"target": {"session_id": "x"}, "owner": "agent"}, version="1.1"),
         "owner needs action_version 1.2"),
        (_action("kv.demote", {"target": {"session_id": "x"}, "owner": "agent"}),
         "owner needs action_version 1.2"),
        (_action("kv.pin", {"target": {"session_id": "x"}, "owner": "someone"},
                 version="1.2"), "Invalid enum value 'someone'"),
        # kv.prefetch 1.2 takes owner (it ranks its retain); kv.share none.
        (_action("kv.prefetch", {"target": {"session_id": "x"}, "owner": "agent"}),
         "owner needs action_version 1.2"),
        (_action("kv.share", {"target": {"session_id": "x"}, "destination_worker": "w1",
                              "owner": "agent"}), "unknown field `owner`"),
        (_action("kv.demote", {"target": {"session_id": "x"}, "evict_rest_first": True}),
         "unknown field `evict_rest_first`"),
    ],
)
def test_bad_actions_become_invalid_with_reason(action: dict, fragment: str) -> None:
    decoded = s.decode_hints(_envelope([action]))
    assert decoded.error is None
    (result,) = decoded.actions
    assert isinstance(result, s.InvalidAction)
    assert fragment in result.reason
    assert result.action_id == action["action_id"]


def test_one_bad_action_does_not_sink_the_others() -> None:
    decoded = s.decode_hints(_envelope([
        {"action_id": "broken", "payload": 3},
        _action("kv.pin", {"target": {"session_id": "x"}}, "good"),
    ]))
    bad, good = decoded.actions
    assert isinstance(bad, s.InvalidAction) and bad.action_id == "broken"
    assert "actions[0]" in bad.reason
    assert isinstance(good, s.ParsedAction)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"not json", "not valid JSON"),
        (b'{"message_id": "m", "actions": []}', "protocol_version"),
        (b"[1, 2]", "invalid hints envelope"),
    ],
)
def test_unusable_messages_carry_an_error(data: bytes, fragment: str) -> None:
    decoded = s.decode_hints(data)
    assert decoded.error is not None and fragment in decoded.error
    assert decoded.actions == []


def test_wrong_protocol_version_rejects_every_action_by_id() -> None:
    decoded = s.decode_hints(_envelope([_action("kv.pin", {"target": {"session_id": "x"}})],
                                       protocol_version="9"))
    assert decoded.error and "protocol_version '9'" in decoded.error
    (result,) = decoded.actions
    assert isinstance(result, s.InvalidAction) and result.action_id == "a1"


def test_a_message_id_too_long_to_echo_rejects_every_action_by_id() -> None:
    """Each action's outcome echoes the message_id: one past MAX_MESSAGE_ID_CHARS is
    refused and not echoed (a 500 KB one on 6k actions made 3 GB of outcomes)."""
    limit = s.hints.MAX_MESSAGE_ID_CHARS
    action = _action("kv.pin", {"target": {"session_id": "x"}})
    decoded = s.decode_hints(_envelope([action], message_id="m" * (limit + 1)))
    assert decoded.message_id == "" and decoded.error == (
        f"message_id is longer than {limit} characters")
    (result,) = decoded.actions
    assert isinstance(result, s.InvalidAction) and result.action_id == "a1"
    fits = s.decode_hints(_envelope([action], message_id="m" * limit))
    assert fits.error is None and isinstance(fits.actions[0], s.ParsedAction)


def test_typed_decoders_raise_wire_decode_error() -> None:
    with pytest.raises(s.WireDecodeError, match="invalid hint outcome.*status"):
        s.decode_outcome(b'{"message_id":"m","action_id":"a","worker_id":"w",'
                         b'"status":7,"at":1}')
    with pytest.raises(s.WireDecodeError, match=r"invalid hint outcome.*applied\.blocks"):
        s.decode_outcome(b'{"message_id":"m","action_id":"a","worker_id":"w",'
                         b'"status":"maybe","applied":{"blocks":-1},"at":1}')
    with pytest.raises(s.WireDecodeError, match="worker status"):
        s.decode_status(b'{"worker_id": 5}')
    # An empty epoch is malformed: before, it was taken for an engine restart.
    good = s.WorkerStatus(
        worker_id="w0", epoch="e1", model="m", cache_namespace="ns", block_size=16,
        hash_algo="sha256", none_hash_seed=None, supported_actions={},
        budgets=s.Budgets(max_pinned_blocks=0, max_pin_ttl_s=0.5, max_retained_blocks=0,
                          max_retain_ttl_s=86_400),
        usage=s.Usage(gpu_blocks_total=1, gpu_blocks_free=1, kv_usage=0.0),
        interval_s=1.0, at=0.0)
    assert s.decode_status(s.encode_status(good)) == good
    for bad in (msgspec.structs.replace(good, epoch=""),
                msgspec.structs.replace(good, epoch="e 1"),
                msgspec.structs.replace(good, last_event_seq=-1)):
        with pytest.raises(s.WireDecodeError, match="worker status"):
            s.decode_status(s.encode_status(bad))
    # Budgets out of their bounds (a TTL of 0 or over a day, a negative or absurd block
    # budget) are malformed: before, the planner sent hints from them that every worker
    # refused, and repeated refusals switched Pin/Retain off.
    budgets = good.budgets
    for field, value in (("max_pin_ttl_s", 0.0), ("max_pin_ttl_s", 86_400.5),
                         ("max_retain_ttl_s", 0.0), ("max_retain_ttl_s", -1.0),
                         ("max_retain_ttl_s", 1e300), ("max_pinned_blocks", -1),
                         ("max_retained_blocks", -5), ("max_pinned_blocks", 2**40 + 1)):
        bad = msgspec.structs.replace(good, budgets=msgspec.structs.replace(
            budgets, **{field: value}))
        with pytest.raises(s.WireDecodeError, match=rf"worker status.*budgets\.{field}"):
            s.decode_status(s.encode_status(bad))
    with pytest.raises(s.WireDecodeError, match="donor advice"):
        s.decode_advice(b"{}")
    with pytest.raises(s.WireDecodeError, match="limit"):
        s.decode_snapshot_request(b'{"limit": 0}')
    assert s.decode_snapshot_request(b"") == s.SnapshotRequest()
    with pytest.raises(s.WireDecodeError, match="hold releases is not valid JSON"):
        s.decode_releases(b"{")
    with pytest.raises(s.WireDecodeError, match=r"invalid hold releases.*\$\.releases"):
        s.decode_releases(b'{"worker_id":"w","at":1,"releases":{}}')


def _release(action_id: str, reason: object, released: object = None) -> dict:
    entry = {"action_id": action_id, "action_type": "kv.retain", "session_id": "t/s",
             "released": {"blocks": 2, "tokens": 64} if released is None else released,
             "held": {"blocks": 1, "tokens": 32}}
    if reason is not None:
        entry["reason"] = reason
    return entry


def _releases(*entries: object) -> bytes:
    return json.dumps({"worker_id": "w0", "at": 1.5, "releases": list(entries)}).encode()


def test_a_release_with_an_unknown_reason_keeps_its_figures_and_spares_the_others() -> None:
    """Rolling upgrade: a newer plugin's reason. Before, the whole message was malformed
    ("Invalid enum value 'tier_moved'") and the known release beside it was lost too."""
    decoded = s.decode_releases(_releases(_release("p1", "pressure"),
                                          _release("p2", "tier_moved"),
                                          _release("p3", None),
                                          _release("p4", ["pressure"])))
    assert (decoded.worker_id, decoded.at, decoded.unreadable) == ("w0", 1.5, ())
    assert [(r.action_id, r.reason, r.released, r.held) for r in decoded.releases] == [
        ("p1", s.ReleaseReason.PRESSURE, s.Amount(2, 64), s.Amount(1, 32)),
        ("p2", s.ReleaseReason.OTHER, s.Amount(2, 64), s.Amount(1, 32)),
        ("p3", s.ReleaseReason.OTHER, s.Amount(2, 64), s.Amount(1, 32)),
        ("p4", s.ReleaseReason.OTHER, s.Amount(2, 64), s.Amount(1, 32))]
    assert sum(r.reason is s.ReleaseReason.OTHER for r in decoded.releases) == 3
    # The router stores the reason in a String(16) column.
    assert all(len(r.value) <= 16 for r in s.ReleaseReason)


def test_an_unreadable_release_is_dropped_and_reported_the_rest_kept() -> None:
    decoded = s.decode_releases(_releases(_release("p1", "displaced"),
                                          _release("bad", "pressure", {"blocks": -3}),
                                          "not a release", {"reason": "reset"}))
    assert [r.action_id for r in decoded.releases] == ["p1"]
    assert len(decoded.unreadable) == 3
    assert "releases[1]" in decoded.unreadable[0] and "released.blocks" in decoded.unreadable[0]
    assert "releases[2]" in decoded.unreadable[1]
    assert "action_id" in decoded.unreadable[2]


def test_what_a_plugin_sends_in_releases_reads_back_unchanged() -> None:
    message = s.HoldsReleased(worker_id="w0", at=2.0, releases=[
        s.HoldRelease(action_id=f"a{n}", action_type="kv.pin", reason=reason,
                      released=s.Amount(n + 1, 32), held=s.Amount())
        for n, reason in enumerate(r for r in s.ReleaseReason if r is not s.ReleaseReason.OTHER)])
    decoded = s.decode_releases(s.encode_releases(message))
    assert (decoded.worker_id, decoded.releases, decoded.at, decoded.unreadable) == (
        "w0", message.releases, 2.0, ())


# What a receiver of HoldsReleased 1.0 knows (OTHER included: what it reads for the rest).
_REASONS_1_0 = frozenset({"displaced", "pressure", "reset", "other"})


def test_this_version_reads_a_1_1_release_as_gone() -> None:
    """HoldsReleased 1.1 adds ``gone`` (vLLM dropped held blocks by another path; the
    plugin sent those as ``reset`` before): read as itself, beside the 1.0 reasons."""
    assert {r.value for r in s.ReleaseReason} == _REASONS_1_0 | {"gone"}
    decoded = s.decode_releases(_releases(_release("g", "gone"), _release("r", "reset")))
    assert [(r.action_id, r.reason) for r in decoded.releases] == [
        ("g", s.ReleaseReason.GONE), ("r", s.ReleaseReason.RESET)]
    golden = s.decode_releases((GOLDEN / "holds_released_v1_1.json").read_bytes())
    assert [r.reason for r in golden.releases] == [s.ReleaseReason.GONE]
    assert golden.unreadable == ()


def test_a_1_0_receiver_reads_gone_as_other_and_keeps_its_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rolling upgrade, a 1.1 plugin and a 1.0 router: the router's decode_releases is this
    one knowing only the 1.0 reasons. It must apply the release (its figures free the
    worker's and the tenant's budgets) under ``other``, not drop it as unreadable."""
    monkeypatch.setattr(releases, "_KNOWN_REASONS", _REASONS_1_0)
    decoded = s.decode_releases((GOLDEN / "holds_released_v1_1.json").read_bytes())
    assert decoded.unreadable == ()
    assert [(r.action_id, r.session_id, r.reason, r.released, r.held)
            for r in decoded.releases] == [
        ("a-pin", "tenant-a/sess-1", s.ReleaseReason.OTHER, s.Amount(2, 64), s.Amount(1, 32))]


def _outcome(status: str, reason: str = "") -> bytes:
    return json.dumps({"message_id": "m", "action_id": "a", "action_type": "kv.pin",
                       "worker_id": "w0", "status": status, "reason": reason,
                       "requested": {"blocks": 4, "tokens": 128},
                       "applied": {"blocks": 2, "tokens": 64}, "at": 3.0}).encode()


def test_an_unknown_outcome_status_is_a_terminal_transient_rejection() -> None:
    """Rolling upgrade: a newer plugin's terminal status. Before, the outcome was
    malformed and the router waited for the action to expire (120 s)."""
    outcome = s.decode_outcome(_outcome("superseded", "a newer pin took its blocks"))
    assert outcome.status is s.OutcomeStatus.REJECTED and outcome.status.is_terminal
    assert outcome.reason == "unknown status 'superseded': a newer pin took its blocks"
    assert s.is_unknown_status(outcome) and s.is_transient_rejection(outcome.reason)
    assert (outcome.action_id, outcome.action_type, outcome.worker_id, outcome.requested,
            outcome.applied, outcome.at) == ("a", "kv.pin", "w0", s.Amount(4, 128),
                                             s.Amount(2, 64), 3.0)
    assert s.decode_outcome(_outcome("")).reason == "unknown status ''"
    # Known statuses decode as before.
    for status in s.OutcomeStatus:
        known = s.decode_outcome(_outcome(status.value, "why"))
        assert known.status is status and known.reason == "why"
        assert not s.is_unknown_status(known)


def test_donor_advice_from_a_newer_router_keeps_working() -> None:
    """DonorAdvice has no version of its own: like the hints envelope, a receiver ignores
    the fields it does not know. Before, an older plugin rejected the whole advice."""
    advice = s.DonorAdvice(advice_id="adv", session_id="t/s", namespace="ns",
                           donor_block_hashes=[1, 2], similarity=0.5, at=1.0)
    newer = {**msgspec.to_builtins(advice), "donor_tier": "host", "ranking": [0.9, 0.4]}
    assert s.decode_advice(json.dumps(newer).encode()) == advice
    # Known fields are still checked.
    with pytest.raises(s.WireDecodeError, match="similarity"):
        s.decode_advice(json.dumps({**newer, "similarity": 2.0}).encode())


def test_donor_advice_problems() -> None:
    advice = s.DonorAdvice(advice_id="a", session_id="s", namespace="n",
                           donor_block_hashes=[], similarity=0.5, at=1.0)
    assert advice.problem() == "donor_block_hashes is empty"


def test_event_batch_garbage_is_a_wire_error() -> None:
    with pytest.raises(s.WireDecodeError, match="invalid KV event batch"):
        s.EventBatchDecoder().decode(b"\x01\x02")


def test_unknown_event_types_are_counted_not_fatal() -> None:
    import msgspec

    raw = msgspec.msgpack.encode([1.0, [
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
        {"type": "BlockTeleported", "block_hashes": [5]},
    ], None])
    decoded = s.EventBatchDecoder().decode(raw)
    assert decoded.unknown_events == 1
    assert decoded.events == [s.BlockRemoved(block_hashes=[5], medium="GPU")]


def test_event_meta_headers_round_trip_and_errors() -> None:
    meta = EventBatchMeta("w0", "epoch-1", 17)
    assert EventBatchMeta.from_headers(meta.to_headers()) == meta
    with pytest.raises(s.WireDecodeError, match="no headers"):
        EventBatchMeta.from_headers(None)
    with pytest.raises(s.WireDecodeError, match="Kvhint-Epoch"):
        EventBatchMeta.from_headers({"Kvhint-Worker": "w0", "Kvhint-Seq": "1"})
    with pytest.raises(s.WireDecodeError, match="non-integer"):
        EventBatchMeta.from_headers({"Kvhint-Worker": "w", "Kvhint-Epoch": "e",
                                     "Kvhint-Seq": "x"})


def test_external_hash_to_int_matches_vllm_rule() -> None:
    digest = bytes(range(32))
    assert s.external_hash_to_int(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert s.external_hash_to_int(12) == 12


# --- hostile input: every decoder answers with WireDecodeError -----------------------------

_DEEP = "[" * 5000 + "]" * 5000  # valid JSON; msgspec raises RecursionError decoding it


@pytest.mark.parametrize("decode", [
    s.decode_advice, s.decode_snapshot_request, s.decode_outcome, s.decode_releases,
    s.decode_status, s.decode_snapshot, s.decode_snapshot_refused, s.decode_snapshot_reply])
@pytest.mark.parametrize("data", [
    ('{"x": ' + _DEEP + "}").encode(),  # deeply nested (an unknown field, or anywhere)
    '{"x": "\ud800"}',  # a str with a lone surrogate (UnicodeEncodeError)
    12,  # not bytes or str at all (TypeError)
], ids=["deep", "surrogate", "not-bytes"])
def test_hostile_input_is_a_wire_error_in_every_decoder(decode: Any, data: Any) -> None:
    """Before, msgspec's RecursionError (and the others) escaped the decoders: a receiver
    that catches WireDecodeError (the plugin's pump, the router's feeds) was left with an
    exception it did not expect."""
    with pytest.raises(s.WireDecodeError):
        decode(data)


def test_a_deeply_nested_hints_message_is_unusable_not_an_exception() -> None:
    decoded = s.decode_hints(b'{"protocol_version": "1", "message_id": "m", "actions": '
                             + _DEEP.encode() + b"}")
    assert decoded.error is not None and "nested too deeply" in decoded.error
    assert decoded.actions == []
    nested = json.loads("[" * 500 + "]" * 500)  # within the limit: a normal rejection
    (action,) = s.decode_hints(_envelope([_action("kv.pin", {"target": {"x": nested}})])).actions
    assert isinstance(action, s.InvalidAction) and action.action_id == "a1"


def test_a_deeply_nested_event_batch_is_a_wire_error_and_the_router_resyncs() -> None:
    """The router's feed of a plugin's events: a batch it cannot decode makes it resync
    that worker (before, the RecursionError escaped the ingestor), and a heartbeat it
    cannot decode is counted as malformed."""
    deep = b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" * 5000 + b"\x90" + b"\xc0"
    for decoder in (s.EventBatchDecoder(), EventSummaryDecoder()):
        with pytest.raises(s.WireDecodeError, match="invalid KV event batch"):
            decoder.decode(deep)
    from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor, RequestSnapshot

    ingestor = KvEventIngestor(InMemoryClusterKvIndex(), lambda: 1000.0)
    ok = s.encode_event_batch(s.KVEventBatch(ts=1.0, events=[s.BlockRemoved(
        block_hashes=[1], medium="GPU")]))
    ingestor.on_event_message(EventBatchMeta("w0", "e1", 1).to_headers(), ok)
    actions = ingestor.on_event_message(EventBatchMeta("w0", "e1", 2).to_headers(), deep)
    assert [type(a) for a in actions] == [RequestSnapshot]
    assert ingestor.on_status_message(('{"x": ' + _DEEP + "}").encode()) == []
    assert ingestor.stats().malformed_messages == 1


def test_an_internal_error_is_a_transient_rejection() -> None:
    assert s.is_transient_rejection(f"{s.REJECTED_INTERNAL_ERROR} in the kvhint plugin")


def test_status_budget_bounds_hold_every_plugin_config() -> None:
    """The heartbeat's budget bounds refuse nothing a plugin can be configured to send:
    its TTL bounds lie within them, and they are a hint's TTL bounds."""
    from kvhint.engine_plugin.config import PluginConfig
    from kvhint.schemas.hints import MAX_TTL_S
    from kvhint.schemas.status import MAX_BUDGET_TTL_S

    assert MAX_BUDGET_TTL_S == MAX_TTL_S
    for name in ("max_pin_ttl_s", "max_retain_ttl_s"):
        bounds = {type(m).__name__: m for m in PluginConfig.model_fields[name].metadata}
        assert bounds["Ge"].ge > 0 and bounds["Le"].le == MAX_BUDGET_TTL_S
