"""Which worker holds each stored Responses API response, and for which tenant.

vLLM keeps a stored response (``store: true``, on a server started with
``VLLM_ENABLE_RESPONSES_API_STORE=1``) in its API server's memory only
(``OpenAIServingResponses.response_store``, never evicted, lost at a restart): a request
naming it (``previous_response_id``, ``GET /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``) works on the server that produced it and nowhere else. The
router learns ``id -> (tenant, worker, session, epoch)`` from the answers it relays and
keeps the most recent ``responses.max_ids`` (least recently used evicted, counted).

A lookup answers one of: the entry, or why there is none to use (:class:`IdMiss`):
``unknown`` (not in this map, nor in the router's form: a client's own, or an older
router's ``resp_<32 hex>``), ``other_tenant`` (another tenant's id: answered to the
client exactly as ``unknown``, as ``unverified`` is), ``worker_gone``
(the worker left the fleet), ``worker_restarted`` (its engine's epoch changed since: the
store went with the process), ``worker_down`` (marked down now; it may come back).

An id this map does not hold (another replica's, one from before this router's
restart, one forgotten past ``max_ids``) is read from the id itself
(responses_id_codec.py): its worker, its engine's epoch and whether it was made in a
session, sent on only when its tag checks out for the requesting tenant (``unverified``:
it checks out for no tenant this router serves; forged, or made under another
``salt_secret``). Only the session is lost that way: a follow-up that names none
continues none (counted, ``drops_total{what="response_session_unknown"}``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pydantic import BaseModel, Field

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.responses_id_codec import ResponseIdCodec, epoch_tag
from kvhint.router.service.workers import WorkerRegistry


class ResponsesSettings(BaseModel, frozen=True, extra="forbid"):
    # Stored-response ids remembered (id -> worker, tenant), least recently used evicted
    # past it (kvhint_router_response_ids_evicted_total); about 300 bytes each.
    max_ids: int = Field(100_000, ge=1)


@dataclass(frozen=True, slots=True)
class IdEntry:
    tenant: str
    worker_id: str
    # The client's session id the response was made in (None: none): a follow-up that
    # names no session of its own continues this one.
    session_id: str | None
    # The worker's engine epoch when it answered (None: no plugin heartbeat yet).
    epoch: str | None
    # Read from the id (not this map's): the tag of that epoch (responses_id_codec.py),
    # and whether it was made in a session (``session_id`` is then unknown, None).
    epoch_tag: str | None = None
    in_unknown_session: bool = False


@dataclass(frozen=True, slots=True)
class IdMiss:
    reason: str  # one of metrics.RESPONSE_ID_MISSES
    worker_id: str | None = None


class ResponseIds:
    """The bounded id -> :class:`IdEntry` map (loop thread only; no I/O)."""

    def __init__(self, max_ids: int, workers: WorkerRegistry, metrics: RouterMetrics,
                 codec: ResponseIdCodec, tenants: frozenset[str]) -> None:
        """``codec``: reads the ids this map does not hold; ``tenants``: the tenants this
        router serves (a miss on another's id is told from a forged one by them)."""
        self._max = max_ids
        self._workers = workers
        self._metrics = metrics
        self._codec = codec
        self._tenants = tenants
        self._entries: OrderedDict[str, IdEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, response_id: str, tenant: str, worker_id: str,
              session_id: str | None) -> None:
        """``worker_id`` answered ``response_id`` for ``tenant``."""
        worker = self._workers.get(worker_id)
        self._entries[response_id] = IdEntry(tenant, worker_id, session_id,
                                             worker.epoch if worker is not None else None)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
            self._metrics.response_ids_evicted.inc()
        self._metrics.response_ids.set(len(self._entries))

    def find(self, response_id: str, tenant: str) -> IdEntry | IdMiss:
        """Where ``tenant`` may reach ``response_id`` now, or why not (counted)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            found = self._miss(entry, tenant) or entry
            if found is entry:
                self._entries.move_to_end(response_id)
        else:
            found = self._read(response_id, tenant)
            if isinstance(found, IdEntry):
                self._metrics.response_ids_read.inc()
                found = self._miss(found, tenant) or found
        if isinstance(found, IdMiss):
            self._metrics.response_id_misses.labels(found.reason).inc()
        return found

    def _read(self, response_id: str, tenant: str) -> IdEntry | IdMiss:
        """An id this map does not hold, from what it says (module doc)."""
        minted = self._codec.read(response_id)
        if minted is None:
            return IdMiss("unknown")
        if not self._codec.binds(minted, tenant):
            others = any(self._codec.binds(minted, t) for t in self._tenants - {tenant})
            return IdMiss("other_tenant" if others else "unverified")
        return IdEntry(tenant, minted.worker_id, None, None, minted.epoch_tag,
                       minted.in_session)

    def _miss(self, entry: IdEntry, tenant: str) -> IdMiss | None:
        if entry.tenant != tenant:
            return IdMiss("other_tenant")
        worker = self._workers.get(entry.worker_id)
        if worker is None:
            return IdMiss("worker_gone", entry.worker_id)
        if worker.epoch is not None and (
                entry.epoch not in (None, worker.epoch)
                or entry.epoch_tag not in (None, epoch_tag(worker.epoch))):
            return IdMiss("worker_restarted", entry.worker_id)
        if not worker.routable:
            return IdMiss("worker_down", entry.worker_id)
        return None
