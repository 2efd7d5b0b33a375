"""Which worker holds each stored Responses API response, and for which tenant.

vLLM keeps a stored response (``store: true``, on a server started with
``VLLM_ENABLE_RESPONSES_API_STORE=1``) in its API server's memory only
(``OpenAIServingResponses.response_store``, never evicted, lost at a restart): a request
naming it (``previous_response_id``, ``GET /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``) works on the server that produced it and nowhere else. The
router learns ``id -> (tenant, worker, session, epoch)`` from the answers it relays and
keeps at most ``responses.max_ids``, evicted fairly between tenants (counted): past the
bound, the tenant holding the most ids gives up its least recently used one, so one
tenant's churn of stored responses evicts its own ids, never those of a tenant holding
fewer (as the sessions registry bounds sessions per tenant: sessions.py).

A lookup answers one of: the entry, or why there is none to use (:class:`IdMiss`):
``unknown`` (not in this map, nor in the router's form: a client's own, or an older
router's ``resp_<32 hex>``), ``other_tenant`` (another tenant's id this map holds:
answered to the client exactly as ``unknown``, as ``unverified`` is), ``worker_gone``
(the worker left the fleet), ``worker_restarted`` (its engine's epoch changed since: the
store went with the process), ``worker_down`` (marked down now; it may come back).

An id this map does not hold (another replica's, one from before this router's
restart, one forgotten past ``max_ids``) is read from the id itself
(responses_id_codec.py): its worker, its engine's epoch and whether it was made in a
session, sent on only when its tag checks out for the requesting tenant (``unverified``:
it does not; another tenant's, forged, changed, or made under another ``salt_secret``).
The tag is checked for the requesting tenant only, one HMAC: telling another tenant's id
from a forged one would take one per tenant served (1,000 tenants: milliseconds of the
event loop), at every such request any key can send, for a metric's word alone (the
client's answer is the same 404). The session is not in the id: a follow-up that names
none reads it from the store (responses_sessions.py), where the replica that relayed the
response wrote it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

from pydantic import BaseModel, Field

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.responses_id_codec import ResponseIdCodec, epoch_tag
from kvhint.router.service.workers import WorkerRegistry


class ResponsesSettings(BaseModel, frozen=True, extra="forbid"):
    # Stored-response ids remembered (id -> worker, tenant); past it the tenant holding
    # the most gives up its least recently used (kvhint_router_response_ids_evicted_total);
    # about 350 bytes each (its usage included).
    max_ids: int = Field(100_000, ge=1)
    # How long a follow-up naming no session waits for the store to say which session a
    # response this router did not relay was made in (responses_sessions.py); past it,
    # it continues none (kvhint_router_response_session_reads_total{outcome="timeout"}).
    session_read_timeout_s: float = Field(0.5, gt=0, le=10)
    # How long the store keeps a response's session row (``response_sessions``, one per
    # stored response made in a session), deleted at the hourly retention
    # (router/store/retention.py). A follow-up by ``previous_response_id`` comes within
    # minutes to hours, and only works while the worker that made the response still
    # holds it (vLLM keeps it in memory, lost at its restart): a day covers a follow-up
    # the next morning at a seventh of the rows of ``store_retention_s`` (7 days). At most
    # ``store_retention_s``: a longer value keeps them that long, no longer.
    session_retention_s: float = Field(86_400.0, gt=0)
    # After the router relayed a cancel of a background response, how long each stream
    # of it it relays waits for a terminal event before the router ends it itself with
    # one (vLLM sends none after a cancel: responses_cancels.py), counted
    # (kvhint_router_responses_cancel_ends_total).
    cancel_grace_s: float = Field(5.0, gt=0, le=300)
    # How long each stream of a background response the router relays waits for its
    # worker's next event before the router ends it with response.failed (vLLM leaves it
    # open, silent, for good once its background task died of an error other than a
    # generation error: responses_cancels.py), counted
    # (kvhint_router_responses_router_ends_total{reason="background_idle"}). None: no
    # bound but request_timeout_s, as any stream.
    background_idle_s: float | None = Field(300.0, gt=0)


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
    # The response's usage once its answer ended (None: not yet, not stored, a
    # background one's, or an id read from the id itself): ``prompt_tokens`` its
    # prompt's, ``context_tokens`` the conversation a follow-up continues on its worker
    # (prompt + completion, without its reasoning or tool calls: responses_api.py
    # ``_measure``). What routing books for a follow-up's load (``follow_up_of``).
    prompt_tokens: int | None = None
    context_tokens: int | None = None
    # Its worker accepted a cancel of it (relayed here): a stream of it opened later
    # gets no terminal event from vLLM either (responses_cancels.py).
    cancelled: bool = False
    # A background response this router answered queued and has not seen end (None:
    # not one, or seen ended: a terminal status or event relayed, a cancel accepted):
    # when it was answered (s since 1970) and the model it was asked of, what a GET
    # answering it ``failed`` says (responses_background.py).
    running_since: int | None = None
    model: str | None = None
    # Its stream relayed vLLM's ``error`` event (a failed generation): vLLM keeps it
    # ``queued`` for good; (code, message), the GET's ``failed`` answer's error.
    error: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class IdMiss:
    reason: str  # one of metric_labels.RESPONSE_ID_MISSES
    worker_id: str | None = None


class ResponseIds:
    """The bounded id -> :class:`IdEntry` map (loop thread only; no I/O), evicted fairly
    between tenants (module doc) at a constant cost per id learnt: each tenant's ids are
    kept in use order, and the tenants by how many ids each holds, so the one to give an
    id up is found without scanning tenants or ids."""

    def __init__(self, max_ids: int, workers: WorkerRegistry, metrics: RouterMetrics,
                 codec: ResponseIdCodec) -> None:
        """``codec``: reads the ids this map does not hold."""
        self._max = max_ids
        self._workers = workers
        self._metrics = metrics
        self._codec = codec
        self._entries: dict[str, IdEntry] = {}
        # Each tenant's ids, least recently used first: its eviction takes the first.
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        # n -> the tenants holding n ids (n >= 1), and the largest such n. Counts move by
        # one at a time, so the largest is kept exactly without a scan.
        self._holding: dict[int, dict[str, None]] = {}
        self._most = 0

    def __len__(self) -> int:
        return len(self._entries)

    def held_by(self, tenant: str) -> int:
        """How many ids of ``tenant`` the map holds."""
        return len(self._by_tenant.get(tenant, ()))

    def learn(self, response_id: str, tenant: str, worker_id: str,
              session_id: str | None) -> None:
        """``worker_id`` answered ``response_id`` for ``tenant``. Past ``max_ids`` the
        tenant holding the most ids (this one, on a tie) forgets its least recently used,
        counted: a tenant holding fewer than another loses none to that one's churn."""
        worker = self._workers.get(worker_id)
        if response_id in self._entries:  # learnt again: counted once, as the newest
            self._remove(response_id)
        self._entries[response_id] = IdEntry(tenant, worker_id, session_id,
                                             worker.epoch if worker is not None else None)
        own = self._by_tenant.setdefault(tenant, OrderedDict())
        own[response_id] = None
        self._recount(tenant, len(own) - 1)
        while len(self._entries) > self._max:
            most = self._holding[self._most]
            victim = tenant if tenant in most else next(iter(most))
            self._remove(next(iter(self._by_tenant[victim])))
            self._metrics.response_ids_evicted.inc()
        self._metrics.response_ids.set(len(self._entries))

    def measured(self, response_id: str, prompt_tokens: int, context_tokens: int) -> None:
        """``response_id``'s usage, read once its answer ended (a stream's, after its id
        was learnt): kept on its entry while the map holds it; its use order unchanged."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries[response_id] = replace(entry, prompt_tokens=prompt_tokens,
                                                 context_tokens=context_tokens)

    def cancelled(self, response_id: str) -> None:
        """``response_id``'s worker accepted a cancel of it: kept on its entry while the
        map holds it (:attr:`IdEntry.cancelled`); its use order unchanged."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries[response_id] = replace(entry, cancelled=True, running_since=None,
                                                 error=None)

    def running(self, response_id: str, model: str | None, since: int) -> None:
        """``response_id`` was answered queued (a background response) at ``since``:
        running, as far as this router knows, until :meth:`settled`."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries[response_id] = replace(entry, running_since=since, model=model)

    def settled(self, response_id: str) -> None:
        """A terminal status or event of ``response_id`` was relayed: no longer running."""
        entry = self._entries.get(response_id)
        if entry is not None and entry.running_since is not None:
            self._entries[response_id] = replace(entry, running_since=None, error=None)

    def failed(self, response_id: str, code: str, message: str) -> None:
        """A stream of running ``response_id`` relayed vLLM's ``error`` event."""
        entry = self._entries.get(response_id)
        if entry is not None and entry.running_since is not None:
            self._entries[response_id] = replace(entry, error=(code, message))

    def held(self, response_id: str, tenant: str) -> IdEntry | None:
        """``tenant``'s entry for ``response_id`` where this map holds it (not counted,
        its use order unchanged)."""
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def _remove(self, response_id: str) -> None:
        tenant = self._entries.pop(response_id).tenant
        own = self._by_tenant[tenant]
        del own[response_id]
        if not own:
            del self._by_tenant[tenant]
        self._recount(tenant, len(own) + 1)

    def _recount(self, tenant: str, was: int) -> None:
        """``tenant`` held ``was`` ids and holds one more or one fewer now."""
        now = self.held_by(tenant)
        if was:
            bucket = self._holding[was]
            del bucket[tenant]
            if not bucket:
                del self._holding[was]
        if now:
            self._holding.setdefault(now, {})[tenant] = None
        if now > self._most or (was == self._most and was not in self._holding):
            # A new largest, or the only tenant holding the most gave one up: it still
            # holds the most (every other held fewer than ``was``).
            self._most = now

    def find(self, response_id: str, tenant: str) -> IdEntry | IdMiss:
        """Where ``tenant`` may reach ``response_id`` now, or why not (counted)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            found = self._miss(entry, tenant) or entry
            if found is entry:
                self._by_tenant[entry.tenant].move_to_end(response_id)
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
        if not self._codec.binds(minted, tenant):  # for this tenant only (module doc)
            return IdMiss("unverified")
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
