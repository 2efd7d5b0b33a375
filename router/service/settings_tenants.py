"""The tenants' part of :class:`RouterSettings` (``tenants:``, a list of
:class:`TenantConfig`): each tenant's keys, cache salt, hint budget (TenantBudget),
request priorities (PriorityBounds), call rate (ApiCallRate) and limits. Frozen pydantic
models that forbid unknown keys; REFERENCE.md's settings table is held to them
(tests/unit/test_readme_reference.py). Nothing here reads the environment or a file of
settings: :mod:`kvhint.router.service.settings` composes them (and re-exports these
names, which callers import from there).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator

# vLLM rejects salts with these characters (entrypoints/generate/base/protocol.py).
_SALT_FORBIDDEN = re.compile(r"[@/\\\x00]")
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class TenantBudget(BaseModel, frozen=True, extra="forbid"):
    """What one tenant may hold through hints at any time, across all workers (distinct
    blocks). None: no cap of the tenant's own; the workers' budgets still bound every
    hold. A fixed default cap would bind long before a GPU fleet's retain budgets do
    (16,384 blocks of 16 tokens against ~50,000 retainable blocks per large worker) and
    leave the simulator, which has no tenant caps, planning another fleet than the
    router. Set them per tenant to share a fleet between tenants."""

    max_pinned_blocks: int | None = Field(None, ge=0)
    max_retained_blocks: int | None = Field(None, ge=0)
    max_hint_ttl_s: float = Field(600.0, gt=0, le=86_400)
    max_actions_per_minute: int = Field(600, ge=0)
    # The most of one worker's pin budget, and of its retain budget, that this tenant's
    # agent runtimes may hold there through the sessions API. A worker's budgets are
    # shared by every tenant, and an agent's Retain displaces any planner claim (workers
    # rank agents' Retains above the planner's) and any agent's of lower priority,
    # another tenant's included: without a share, one tenant's agents could take a
    # worker's whole pin budget, or push every other tenant's protections off it. None:
    # an equal share, 1 / the number of configured tenants (no limit with one tenant).
    # The planner's own protections are not counted here: it orders every tenant's
    # sessions by one value, and a tenant's whole holdings are capped above.
    max_worker_share: float | None = Field(None, gt=0, le=1)


class PriorityBounds(BaseModel, frozen=True, extra="forbid"):
    """The request ``priority`` values a tenant's keys may send (vLLM: lower is served
    first on a worker started with ``--scheduling-policy priority``, and may preempt
    requests running there; 0 when not sent). Both bounds take in 0, so a request
    without ``priority`` is always allowed. The default, 0 to 0: a tenant's keys may not
    move their requests ahead of (nor behind) any other tenant's (inbound.py)."""

    min: int = Field(0, le=0)
    max: int = Field(0, ge=0)


class ApiCallRate(BaseModel, frozen=True, extra="forbid"):
    """The calls a tenant's keys may make to the router's session and admin endpoints
    (``DELETE /v1/sessions/{id}``, ``POST /v1/sessions/{id}/hints``, ``/admin``), a token
    bucket: ``burst`` at once, refilled at ``per_s``. Each such call may read the store
    (a session id not in memory, an admin view) and send hint actions to a worker; the
    hints' own rate (``TenantBudget.max_actions_per_minute``) counts only the actions
    sent, not the calls refused after a read, and ends had no bound at all. One more is a
    429 with ``Retry-After`` (tenant_call_rate.py). The default is far above an agent's
    use (one end per session, a few hints calls per turn)."""

    per_s: float = Field(100.0, gt=0)
    burst: int = Field(1000, ge=1)


class TenantConfig(BaseModel, frozen=True, extra="forbid"):
    name: str
    # Keys a client sends as ``Authorization: Bearer <key>`` (or ``X-API-Key``).
    api_keys: list[str] = Field(default_factory=list)
    # Keys that may use the admin API and send hints, for this tenant only.
    admin_keys: list[str] = Field(default_factory=list)
    # Salt the router puts on every request (changes the hash of the first block), so
    # tenants never share KV. None: derived from the tenant name and ``salt_secret``.
    cache_salt: str | None = None
    budget: TenantBudget = TenantBudget()
    # The models (served names, LoRA adapters included) this tenant may use and see in
    # /v1/models; None: every model the workers serve.
    models: list[str] | None = None
    # Sessions of this tenant the router keeps in memory; past it, the tenant's own least
    # recently active one is evicted (it stays in the store and comes back with its next
    # turn), never another tenant's. None: an equal share of the router's 200,000, 1 /
    # the number of configured tenants (all of it with one tenant).
    max_sessions: int | None = Field(None, ge=1)
    # Inference requests of this tenant in flight at once; one more is answered 429 with
    # Retry-After. None: no cap of the tenant's own (http_max_concurrency bounds all).
    max_in_flight: int | None = Field(None, ge=1)
    # The request ``priority`` its keys may send; outside it, a 400 (PriorityBounds).
    priority: PriorityBounds = PriorityBounds()
    # Its keys' calls to the session and admin endpoints (ends, hints, /admin), a token
    # bucket (ApiCallRate); a global admin key's, and dev mode's, are ``default``'s.
    api_calls: ApiCallRate = ApiCallRate()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _TENANT_RE.match(value):
            raise ValueError(f"tenant name {value!r}: 1-64 letters, digits, '_', '.' or '-'")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value: str | None) -> str | None:
        if value is not None and (not value or len(value) > 128 or _SALT_FORBIDDEN.search(value)):
            raise ValueError("cache_salt: 1-128 characters, none of @ / \\ or NUL (vLLM rule)")
        return value
