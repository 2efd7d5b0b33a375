"""Shared decoding helpers for the wire contract.

Every decoder here raises :class:`WireDecodeError` (never a bare msgspec error), whose
message names the field path and what was wrong, so a receiver can put it straight into
a ``rejected`` outcome or a 4xx body.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

U64_MAX = (1 << 64) - 1

# Worker ids and subject prefixes become NATS subject tokens: no dots, spaces or
# wildcards inside a worker id.
WORKER_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
_WORKER_ID_RE = re.compile(WORKER_ID_PATTERN)


class WireDecodeError(ValueError):
    """A message could not be decoded into its wire type; the text says where and why."""


# What else msgspec raises on hostile input, beyond its own errors: RecursionError for
# nesting deeper than the interpreter's limit (valid JSON of a few KB), UnicodeEncodeError
# for a ``str`` holding lone surrogates, TypeError for input that is not bytes or str.
# All are the sender's fault: the receiver must answer them like any malformed message.
HOSTILE_INPUT_ERRORS: tuple[type[Exception], ...] = (RecursionError, ValueError, TypeError)


def decode_json(data: bytes | str, type_: type[T], what: str) -> T:
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise WireDecodeError(f"invalid {what}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise WireDecodeError(f"{what} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise WireDecodeError(f"{what} is nested too deeply: {exc}") from exc
    except HOSTILE_INPUT_ERRORS as exc:
        raise WireDecodeError(f"{what} could not be decoded: {exc}") from exc


def convert(obj: Any, type_: type[T], what: str) -> T:
    try:
        return msgspec.convert(obj, type=type_)
    except msgspec.ValidationError as exc:
        raise WireDecodeError(f"invalid {what}: {exc}") from exc
    except RecursionError as exc:
        raise WireDecodeError(f"{what} is nested too deeply: {exc}") from exc
    except HOSTILE_INPUT_ERRORS as exc:
        raise WireDecodeError(f"invalid {what}: {exc}") from exc


# The longest action id, advice id or action type a receiver echoes (the router's are
# 20-126 characters: ``kve-<nonce>-<claim>`` at most). Each final answer is remembered
# with its id and type (the plugin's Mailbox.answered, up to 100,000 by count): before,
# 1 MB ids made a publisher's ~100k answers hold ~100 GB. One longer is answered
# ``rejected`` under an empty id (not remembered), its start quoted in the reason.
MAX_ID_CHARS = 256
# The longest session id the wire carries (a hint's target, donor advice, a hold
# release). A session-scoped hold keeps its session id in the plugin's memory for its
# TTL, so a 500 KB id per action made a publisher's holds cost gigabytes. The router's
# ids are ``<tenant>/<client session id>`` (Tenant.worker_session_id): a tenant name is
# 1-64 characters (settings_tenants._TENANT_RE) and a client session id at most 256
# (service/inbound.MAX_SESSION_ID_LEN), so at most 321: none is refused. One longer is
# rejected, its start only quoted in the reason.
MAX_SESSION_ID_CHARS = 600
# The longest ``evidence`` a donor advice carries (operator text such as
# "minhash:0.82 over 12 chunks"; the router sends none today).
MAX_EVIDENCE_CHARS = 1024
# The most of a sender's text a reason quotes (a msgspec error quotes the bad value).
MAX_QUOTED_CHARS = 64
MAX_REASON_CHARS = 1024


def quoted(value: str) -> str:
    """``value``'s repr, its start only when longer than MAX_QUOTED_CHARS."""
    if len(value) <= MAX_QUOTED_CHARS:
        return repr(value)
    return f"{value[:MAX_QUOTED_CHARS]!r}... ({len(value)} characters)"


def too_long(field: str, value: str | None, limit: int, what: str = "not echoed"
             ) -> str | None:
    """Why ``value`` of ``field`` is refused for being longer than ``limit``, or None."""
    if value is None or len(value) <= limit:
        return None
    return f"{field} is longer than {limit} characters (starts {quoted(value)}; {what})"


def clipped_reason(reason: str) -> str:
    """A reason made from a sender's input, at most MAX_REASON_CHARS long."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    return reason[:MAX_REASON_CHARS - 20] + f"... ({len(reason)} chars)"


def encode_json(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def is_valid_worker_id(worker_id: str) -> bool:
    return bool(_WORKER_ID_RE.match(worker_id))


def check_worker_id(worker_id: str) -> str:
    if not is_valid_worker_id(worker_id):
        raise WireDecodeError(
            f"invalid worker id {worker_id!r}: use 1-128 letters, digits, '_' or '-' "
            "(it becomes a NATS subject token)"
        )
    return worker_id
