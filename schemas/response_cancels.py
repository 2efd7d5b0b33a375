"""Response cancels: router replica -> router replicas on ``<prefix>.v1.cancels.<worker>``.

vLLM 0.32 sends no event after a background response is cancelled, so a router ends each
stream of that response it relays a grace after the cancel (the router's
responses_cancels.py). A cancel reaches one replica only, while streams of the response
may be open through others (the ``stream: true`` request that started it, any
``GET /v1/responses/{id}?stream=true``): the replica whose relayed cancel the worker
accepted publishes one :class:`ResponseCancelled` on the subject of the worker holding the
response, and every replica (subscribed to ``<prefix>.v1.cancels.*``) starts the grace of
its own streams of that response. Core NATS, not JetStream: a replica not connected at
that moment has no stream to end through this link either (its clients' streams went
with its connection) or ends them at its own bounds.

``origin``: the publishing replica's random instance id, so it skips its own notice (it
started its streams' grace when it relayed the cancel). ``tenant`` and ``response_id``:
receivers check the id was minted for that tenant under the fleet's ``salt_secret``
(router responses_id_codec.py) and names ``worker_id``, as the cancel itself was checked.

Versions: 1.0 (this). New optional fields may follow (a receiver ignores fields it does
not know: msgspec's default); a change a receiver must understand takes a new subject
version (:mod:`kvhint.schemas.subjects`). Golden JSON: ``tests/golden/response_cancelled.json``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvhint.schemas._codec import decode_json, encode_json

RESPONSE_CANCELLED_VERSION = "1.0"


class ResponseCancelled(msgspec.Struct, frozen=True, kw_only=True):
    """A worker accepted a cancel of ``response_id``, relayed by replica ``origin``."""

    version: str = RESPONSE_CANCELLED_VERSION
    origin: Annotated[str, Meta(min_length=1, max_length=64)]
    response_id: Annotated[str, Meta(min_length=1, max_length=512)]
    tenant: Annotated[str, Meta(min_length=1, max_length=256)]
    worker_id: str
    at: float


def encode_response_cancelled(notice: ResponseCancelled) -> bytes:
    return encode_json(notice)


def decode_response_cancelled(data: bytes | str) -> ResponseCancelled:
    return decode_json(data, ResponseCancelled, "response cancelled")
