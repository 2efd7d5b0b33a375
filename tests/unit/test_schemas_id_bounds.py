"""Ids and types a receiver echoes are bounded (``schemas._codec.MAX_ID_CHARS``): each
final answer is remembered with its id and type (the plugin's ``Mailbox.answered``, up to
100,000 by count), so a 1 MB action_id, advice_id or action_type made the engine hold
~100k x 1 MB. One too long is answered ``rejected`` under an empty id or type (an outcome
of no id is remembered nowhere), the reason quoting its start only."""

from __future__ import annotations

import json

import pytest

from kvhint import schemas as s
from kvhint.schemas._codec import MAX_ID_CHARS, MAX_QUOTED_CHARS, MAX_REASON_CHARS

LIMIT = s.hints.MAX_ACTION_ID_CHARS


def _hints(actions: list) -> bytes:
    return json.dumps({"protocol_version": "1", "message_id": "m", "actions": actions}).encode()


def _action(action_id: str = "a1", action_type: str = "kv.pin", **extra) -> dict:
    return {"action_id": action_id, "action_type": action_type, "action_version": "1.0",
            "payload": {"target": {"session_id": "x"}}, **extra}


def test_the_bound_covers_the_routers_ids() -> None:
    # The router's ids are 20-126 characters (``kve-<nonce>-<claim>`` at most) and a
    # caller's at most MAX_CALLER_ACTION_ID_LEN: none is refused.
    from kvhint.router.service.hint_api_actions import MAX_CALLER_ACTION_ID_LEN

    assert LIMIT == s.advice.MAX_ADVICE_ID_CHARS == MAX_ID_CHARS == 256
    assert MAX_CALLER_ACTION_ID_LEN < 126 < LIMIT


@pytest.mark.parametrize("field", ["action_id", "action_type"])
def test_an_action_id_or_type_too_long_is_rejected_and_not_echoed(field: str) -> None:
    long = "x" * 600_000
    action = _action(**{field: long})
    (result,) = s.decode_hints(_hints([action, _action("a2")])).actions[:1]
    assert isinstance(result, s.InvalidAction)
    assert getattr(result, field) == ""
    other = "action_type" if field == "action_id" else "action_id"
    assert getattr(result, other) == action[other]  # the other one is short: echoed
    assert result.reason.startswith(f"{field} is longer than {LIMIT} characters")
    assert "not echoed" in result.reason and len(result.reason) < 200
    # One at the limit is taken (a type that long is unknown, rejected as such).
    fits = s.decode_hints(_hints([_action("a" * LIMIT)])).actions[0]
    assert isinstance(fits, s.ParsedAction) and fits.action_id == "a" * LIMIT


def test_a_malformed_action_with_a_long_id_is_not_echoed_either() -> None:
    bad = {"action_id": "y" * 10_000, "action_type": "kv.pin", "action_version": 7,
           "payload": {}}
    (result,) = s.decode_hints(_hints([bad])).actions
    assert isinstance(result, s.InvalidAction) and result.action_id == ""
    assert "action_id is longer than" in result.reason


def test_reasons_quote_only_the_start_of_a_senders_text() -> None:
    long = "v" * 100_000
    version = s.decode_hints(_hints([_action(action_version=long)])).actions[0]
    owner = s.decode_hints(_hints([_action(action_version="1.2", payload={
        "target": {"session_id": "x"}, "owner": long})])).actions[0]
    protocol = s.decode_hints(json.dumps({"protocol_version": long, "message_id": "m",
                                          "actions": [_action()]}).encode())
    for reason in (version.reason, owner.reason, protocol.error, protocol.actions[0].reason):
        assert len(reason) <= MAX_REASON_CHARS, reason[:80]
    assert f"({len(long)} characters)" in version.reason
    assert len(version.reason) < 100 + MAX_QUOTED_CHARS


def test_advice_with_an_id_too_long_is_refused() -> None:
    advice = s.DonorAdvice(advice_id="d" * (LIMIT + 1), session_id="r", namespace="n",
                           donor_block_hashes=[1], similarity=0.5, at=0.0)
    assert advice.problem().startswith(f"advice_id is longer than {LIMIT} characters")
    with pytest.raises(s.WireDecodeError, match="advice_id is longer than"):
        s.decode_advice(s.encode_advice(advice))
    assert s.advice.echoed_advice_id(advice.advice_id) == ""
    fits = s.DonorAdvice(advice_id="d" * LIMIT, session_id="r", namespace="n",
                         donor_block_hashes=[1], similarity=0.5, at=0.0)
    assert s.decode_advice(s.encode_advice(fits)) == fits and fits.problem() is None
