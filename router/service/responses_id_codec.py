"""Self-describing Responses API ids: any router replica reaches a stored response from
its id alone.

vLLM keeps a stored response in the memory of the server that made it, so a request
naming it must go to that worker; the id says which. The router names each response
(``request_id``, the id vLLM stores it under and answers with)::

    resp_<worker id>_<random: 32 hex><s|n><epoch tag: 8 hex><tag: 24 hex>

- ``worker id``: the worker the request was sent to (1-128 letters, digits, ``_``, ``-``,
  schemas' worker id rule). Not a secret: every answer names it (``x-kvhint-worker``).
- ``random``: 128 random bits, so no id can be guessed.
- ``s``/``n``: the response was made in a client session or not (the session itself is
  not in the id: client session ids may be long and say what they should not; a replica
  that did not relay the response reads it from the store, responses_sessions.py, for
  an ``s`` id only).
- ``epoch tag``: 8 hex of a digest of the worker's engine epoch when it was sent there
  (``00000000``: none known), so a worker restarted since (its store gone with its
  process) is told apart from an id it never held.
- ``tag``: HMAC-SHA256 over the tenant's name and everything before it, truncated to 96
  bits, with a key derived from ``salt_secret`` (which replicas share already: the tenants'
  cache salts are derived from it). A request is sent on only when the tag checks out for
  the requesting tenant: another tenant's id, one changed in any character, or one made
  under another ``salt_secret`` is never sent to a worker.

Tenants stay apart by the tag's tenant binding, not by the key's secrecy: vLLM looks a
response up by the whole id, so another tenant would have to present the very id the
response's tenant was given, whose tag checks out for that tenant only. What the key adds: no id is
forged at all (with the published default ``salt_secret``, a tenant can make ids of
its own that name any worker, which that worker answers 404) and no id tells which
tenant it belongs to.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from kvhint.schemas._codec import WORKER_ID_PATTERN

# Domain separation from the tenants' derived salts (tenancy.derive_salt takes a
# tenant name, which has no space or '/', as its message).
_KEY_LABEL = b"kvhint responses id key/1"
_TAG_HEX = 24
_NO_EPOCH = "0" * 8
_WORKER = WORKER_ID_PATTERN.strip("^$")
_ID = re.compile(f"resp_(?P<worker>{_WORKER})_(?P<random>[0-9a-f]{{32}})(?P<session>[sn])"
                 f"(?P<epoch>[0-9a-f]{{8}})(?P<tag>[0-9a-f]{{{_TAG_HEX}}})")


def epoch_tag(epoch: str | None) -> str | None:
    """What an id says of ``epoch`` (None: no epoch known)."""
    if epoch is None:
        return None
    tag = hashlib.sha256(epoch.encode()).hexdigest()[:8]
    # One epoch in 2**32 digests to the "none" tag: it takes the next one instead.
    return tag if tag != _NO_EPOCH else "00000001"


@dataclass(frozen=True, slots=True)
class MintedId:
    """An id in the router's form, read, not yet checked (:meth:`ResponseIdCodec.binds`)."""

    worker_id: str
    in_session: bool
    epoch_tag: str | None
    signed: str  # the id up to its tag
    tag: str


class ResponseIdCodec:
    """Mints response ids and reads them back (no I/O, no state but the key)."""

    def __init__(self, secret: str) -> None:
        self._key = hmac.new(secret.encode(), _KEY_LABEL, hashlib.sha256).digest()

    def mint(self, tenant: str, worker_id: str, epoch: str | None, in_session: bool) -> str:
        """A new id for ``tenant``'s response on ``worker_id`` (its engine at ``epoch``)."""
        signed = (f"resp_{worker_id}_{secrets.token_hex(16)}{'s' if in_session else 'n'}"
                  f"{epoch_tag(epoch) or _NO_EPOCH}")
        minted = f"{signed}{self._tag(tenant, signed)}"
        assert _ID.fullmatch(minted), f"worker id {worker_id!r} out of the id's form"
        return minted

    @staticmethod
    def read(response_id: str) -> MintedId | None:
        """What ``response_id`` says, or None where it is not in the router's form (a
        client's, or a router's from before this form: ``resp_<32 hex>``)."""
        match = _ID.fullmatch(response_id)
        if match is None:
            return None
        epoch = match["epoch"]
        return MintedId(match["worker"], match["session"] == "s",
                        None if epoch == _NO_EPOCH else epoch,
                        response_id[:-_TAG_HEX], match["tag"])

    def binds(self, minted: MintedId, tenant: str) -> bool:
        """Whether ``minted`` was made for ``tenant`` under this router's key."""
        return hmac.compare_digest(self._tag(tenant, minted.signed), minted.tag)

    def _tag(self, tenant: str, signed: str) -> str:
        # A tenant name has no '/' (settings' rule): "<tenant>/<id>" reads one way only.
        return hmac.new(self._key, f"{tenant}/{signed}".encode(),
                        hashlib.sha256).hexdigest()[:_TAG_HEX]
