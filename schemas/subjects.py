"""NATS subject names, as functions of a prefix and a worker id.

``<prefix>.v1.<kind>.<worker>``; the ``v1`` segment is the wire version, so a v2 contract
can run beside v1 on the same server. One worker id per data-parallel rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvhint.schemas._codec import WireDecodeError, check_worker_id

WIRE_VERSION = "v1"

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")

# "cancels": router replica -> router replicas, a cancel a worker accepted
# (schemas/response_cancels.py), on the subject of the worker holding the response.
KINDS = ("hints", "outcomes", "releases", "events", "advice", "status", "snapshot",
         "cancels")
# The least history and size a JetStream stream of these subjects is created with (the
# router's settings and the plugin's config both hold to them): a history shorter than a
# minute is gone before a restarted router replays it (nats-server refuses under 100 ms);
# a stream smaller than 1 MiB (NATS's default payload) drops a large message as soon as
# it stores it.
MIN_STREAM_MAX_AGE_S = 60.0
MIN_STREAM_MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "kvhint"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise WireDecodeError(
                f"invalid subject prefix {self.prefix!r}: dot-separated tokens of letters, "
                "digits, '_' or '-'"
            )

    @property
    def base(self) -> str:
        return f"{self.prefix}.{WIRE_VERSION}"

    def _subject(self, kind: str, worker_id: str) -> str:
        return f"{self.base}.{kind}.{check_worker_id(worker_id)}"

    def hints(self, worker_id: str) -> str:
        return self._subject("hints", worker_id)

    def outcomes(self, worker_id: str) -> str:
        return self._subject("outcomes", worker_id)

    def releases(self, worker_id: str) -> str:
        return self._subject("releases", worker_id)

    def events(self, worker_id: str) -> str:
        return self._subject("events", worker_id)

    def advice(self, worker_id: str) -> str:
        return self._subject("advice", worker_id)

    def status(self, worker_id: str) -> str:
        return self._subject("status", worker_id)

    def snapshot(self, worker_id: str) -> str:
        return self._subject("snapshot", worker_id)

    def cancels(self, worker_id: str) -> str:
        return self._subject("cancels", worker_id)

    def all_of(self, kind: str) -> str:
        """Wildcard over every worker, e.g. ``kvhint.v1.events.*``."""
        if kind not in KINDS:
            raise ValueError(f"unknown subject kind {kind!r}")
        return f"{self.base}.{kind}.*"

    @property
    def events_stream(self) -> str:
        """JetStream stream that keeps the event batches for replay."""
        return re.sub(r"[^A-Za-z0-9_-]", "_", self.base).upper() + "_EVENTS"

    def worker_of(self, subject: str) -> str:
        """The worker id in one of our subjects."""
        head, _, worker = subject.rpartition(".")
        kind = head.rpartition(".")[2]
        if not head.startswith(self.base + ".") or kind not in KINDS:
            raise WireDecodeError(f"subject {subject!r} is not under {self.base}")
        return check_worker_id(worker)
