"""Session ids and donor evidence are bounded on the wire (``schemas._codec.
MAX_SESSION_ID_CHARS``, ``MAX_EVIDENCE_CHARS``): a session-scoped hold keeps its
session_id in the plugin's memory for its TTL, and advice waits in the worker's inbox, so
a 500 KB id per action made a publisher's holds cost gigabytes. No id the router makes
(``<tenant>/<client session id>``, at most 64 + 1 + 256 characters) is refused; a longer
one is rejected, the reason quoting its start only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint import schemas as s
from kvhint.schemas._codec import MAX_EVIDENCE_CHARS, MAX_QUOTED_CHARS, MAX_SESSION_ID_CHARS

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
HUGE = "s" * 500_000


def _pin(session_id: str) -> bytes:
    return json.dumps({"protocol_version": "1", "message_id": "m", "actions": [
        {"action_id": "a1", "action_type": "kv.pin", "action_version": "1.0",
         "payload": {"target": {"session_id": session_id, "prefix_tokens": 64}}}]}).encode()


def _advice(**fields: object) -> s.DonorAdvice:
    base: dict = dict(advice_id="d1", session_id="t/r", namespace="n",
                      donor_block_hashes=[1], similarity=0.5, at=0.0)
    return s.DonorAdvice(**{**base, **fields})


def test_the_bound_covers_every_session_id_the_router_makes() -> None:
    from kvhint.router.service.inbound import MAX_SESSION_ID_LEN
    from kvhint.router.service.settings_tenants import TenantConfig
    from kvhint.router.service.tenancy import Tenant
    from kvhint.router.service.settings import TenantBudget

    TenantConfig(name="t" * 64)  # the longest tenant name a config takes
    with pytest.raises(ValueError):
        TenantConfig(name="t" * 65)
    longest = Tenant("t" * 64, None, TenantBudget()).worker_session_id("c" * MAX_SESSION_ID_LEN)
    assert len(longest) == 321 < MAX_SESSION_ID_CHARS == 600
    parsed = s.decode_hints(_pin(longest)).actions[0]
    assert isinstance(parsed, s.ParsedAction) and parsed.payload.target.session_id == longest
    assert _advice(session_id=longest, donor_session_id=longest).problem() is None


def test_a_hint_target_with_a_session_id_too_long_is_rejected_not_echoed() -> None:
    (action,) = s.decode_hints(_pin(HUGE)).actions
    assert isinstance(action, s.InvalidAction) and action.action_id == "a1"
    assert action.reason.startswith(
        f"invalid payload: target: session_id is longer than {MAX_SESSION_ID_CHARS} "
        "characters (starts 'sss")
    assert "(500000 characters); not held)" in action.reason
    assert len(action.reason) < 150 + MAX_QUOTED_CHARS
    fits = s.decode_hints(_pin("x" * MAX_SESSION_ID_CHARS)).actions[0]
    assert isinstance(fits, s.ParsedAction)
    over = s.decode_hints(_pin("x" * (MAX_SESSION_ID_CHARS + 1))).actions[0]
    assert isinstance(over, s.InvalidAction) and "session_id is longer than" in over.reason


@pytest.mark.parametrize(("field", "limit"), [("session_id", MAX_SESSION_ID_CHARS),
                                              ("donor_session_id", MAX_SESSION_ID_CHARS),
                                              ("evidence", MAX_EVIDENCE_CHARS)])
def test_advice_with_text_too_long_is_refused(field: str, limit: int) -> None:
    advice = _advice(**{field: "e" * (limit + 1)})
    assert advice.problem().startswith(f"{field} is longer than {limit} characters")
    with pytest.raises(s.WireDecodeError, match=f"invalid donor advice: {field} is longer "
                                                f"than {limit} characters") as caught:
        s.decode_advice(s.encode_advice(_advice(**{field: HUGE})))
    assert len(str(caught.value)) < 150 + MAX_QUOTED_CHARS
    # Its id is short: the receiver's rejection echoes it (peek_advice_id).
    assert s.advice.echoed_advice_id("d1") == "d1"
    fits = _advice(**{field: "e" * limit})
    assert s.decode_advice(s.encode_advice(fits)) == fits and fits.problem() is None


def test_a_release_with_a_session_id_too_long_is_dropped_as_unreadable() -> None:
    golden = json.loads((GOLDEN / "holds_released_v1_1.json").read_text())
    good = golden["releases"][0]
    message = {**golden, "releases": [{**good, "session_id": HUGE}, good]}
    decoded = s.decode_releases(json.dumps(message))
    assert decoded.releases == s.decode_releases(json.dumps(golden)).releases  # the rest
    (why,) = decoded.unreadable
    assert why.startswith(f"invalid releases[0]: session_id is longer than "
                          f"{MAX_SESSION_ID_CHARS} characters")
    assert len(why) < 150 + MAX_QUOTED_CHARS


def test_the_goldens_session_ids_are_within_the_bound() -> None:
    hints = s.decode_hints((GOLDEN / "hints_envelope.json").read_bytes())
    assert all(isinstance(a, s.ParsedAction) for a in hints.actions)
    advice = s.decode_advice((GOLDEN / "donor_advice.json").read_bytes())
    assert advice.problem() is None
    for name in ("holds_released.json", "holds_released_v1_1.json"):
        assert not s.decode_releases((GOLDEN / name).read_bytes()).unreadable
