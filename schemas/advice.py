"""Semantic donor advice: router -> engine plugin on ``<prefix>.v1.advice.<worker>``.

Discovery is evidence, not authority: the router found an earlier prompt (the donor) in
the same namespace whose KV may help ``session_id``. The worker checks that the donor's
blocks are still resident, may retain them for ``ttl_s``, and answers with a
:class:`~kvhint.schemas.outcomes.HintOutcome` whose ``action_type`` is ``kv.donor`` and
``action_id`` is ``advice_id``: accepted (all resident), clipped (some), missing (none),
rejected (malformed or another namespace). Non-identical KV is never reported as an exact
prefix hit.

Versioning: like the hints envelope, a receiver ignores fields it does not know, so a
newer router may add a field to DonorAdvice and older plugins still act on the advice
(before, they rejected all of it as malformed). A field added later must therefore be
safe to ignore: what an older plugin must not act on without understanding it needs a
new message version (a new subject version, see :mod:`kvhint.schemas.subjects`), not
just a new field.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvhint.schemas._codec import (
    MAX_EVIDENCE_CHARS,
    MAX_ID_CHARS,
    MAX_SESSION_ID_CHARS,
    U64_MAX,
    WireDecodeError,
    decode_json,
    encode_json,
    too_long as field_too_long,
)

DONOR_ACTION_TYPE = "kv.donor"
# The longest advice_id a worker echoes (schemas._codec.MAX_ID_CHARS): advice with a
# longer one is answered ``rejected`` under an empty id (remembered by no receiver).
MAX_ADVICE_ID_CHARS = MAX_ID_CHARS


def echoed_advice_id(advice_id: str) -> str:
    """What an answer to advice of ``advice_id`` carries: "" for one too long to echo."""
    return "" if len(advice_id) > MAX_ADVICE_ID_CHARS else advice_id


def length_problem(advice: DonorAdvice) -> str | None:
    """Why the advice is refused for a field's length, or None: an advice_id too long to
    echo (schemas._codec.MAX_ID_CHARS: the rejection carries no id,
    :func:`echoed_advice_id`), session ids or evidence too long to keep
    (MAX_SESSION_ID_CHARS, MAX_EVIDENCE_CHARS: an advice waits in the worker's inbox, and
    its retain is kept for its TTL; the rejection echoes the advice_id)."""
    return (field_too_long("advice_id", advice.advice_id, MAX_ADVICE_ID_CHARS)
            or field_too_long("session_id", advice.session_id, MAX_SESSION_ID_CHARS,
                              "not held")
            or field_too_long("donor_session_id", advice.donor_session_id,
                              MAX_SESSION_ID_CHARS, "not held")
            or field_too_long("evidence", advice.evidence, MAX_EVIDENCE_CHARS, "not held"))


class DonorAdvice(msgspec.Struct, frozen=True, kw_only=True):
    advice_id: str
    # The session the advice is for (the recipient of the placement).
    session_id: str
    namespace: str
    donor_session_id: str | None = None
    donor_block_hashes: list[Annotated[int, Meta(ge=0)]]
    similarity: Annotated[float, Meta(ge=0.0, le=1.0)]
    # How the donor was found, for operators ("minhash:0.82 over 12 chunks", ...).
    evidence: str = ""
    ttl_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    at: float

    def problem(self) -> str | None:
        """Why a worker must reject this advice, or None."""
        if not self.advice_id:
            return "advice_id is empty"
        if (long := length_problem(self)) is not None:
            return long
        if not self.donor_block_hashes:
            return "donor_block_hashes is empty"
        if any(h > U64_MAX for h in self.donor_block_hashes):
            return "donor_block_hashes must be unsigned 64-bit integers"
        return None


def encode_advice(advice: DonorAdvice) -> bytes:
    return encode_json(advice)


def decode_advice(data: bytes | str) -> DonorAdvice:
    """Raises WireDecodeError also for a field too long (:func:`length_problem`)."""
    advice = decode_json(data, DonorAdvice, "donor advice")
    if (long := length_problem(advice)) is not None:
        raise WireDecodeError(f"invalid donor advice: {long}")
    return advice
