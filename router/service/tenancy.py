"""API keys -> tenants, and who may use the admin and hint endpoints.

A key identifies exactly one principal: a tenant's client (``api_keys``), a tenant's
admin (``admin_keys`` of that tenant: admin API and hints for that tenant's sessions
only), or a global admin (``admin_keys`` at the top). With no key configured anywhere the
router runs in single-tenant dev mode: every request belongs to tenant ``default`` and
the admin API is open.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from kvhint.router.service.settings import (
    DEFAULT_TENANT,
    ApiCallRate,
    RouterSettings,
    TenantBudget,
)

# DEFAULT_TENANT: a global admin's own traffic's tenant (settings.py: a tenant configured
# with that name may have no keys).


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    # None only in dev mode: requests then hash exactly as a direct call to vLLM would.
    cache_salt: str | None
    budget: TenantBudget
    # What it may use (served model names; None: every model).
    models: frozenset[str] | None = None
    # The most of one worker's pin and retain budgets its API claims may hold
    # (``TenantBudget.max_worker_share``, its default resolved).
    worker_share: float = 1.0
    # Its requests in flight at once (``TenantConfig.max_in_flight``; None: no cap).
    max_in_flight: int | None = None
    # The request ``priority`` values its keys may send, (min, max) (``TenantConfig.
    # priority``); None: any. A configured ``default`` (keyless: a global admin's own
    # traffic) is bounded as every configured tenant is, by its ``priority`` (0 to 0
    # unless set): the operator's choice for that traffic. None in dev mode, and for a
    # ``default`` not configured.
    priority_range: tuple[int, int] | None = None
    # Its keys' calls to the session and admin endpoints (``TenantConfig.api_calls``;
    # the default for a ``default`` not configured).
    api_calls: ApiCallRate = ApiCallRate()

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def worker_session_id(self, client_session_id: str) -> str:
        """The id workers see; hints target it (BRIEF: ``<tenant>/<client session id>``)."""
        return f"{self.name}/{client_session_id}"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from. ``tenant`` is None only for a global admin."""

    tenant: Tenant | None
    is_admin: bool

    def may_act_for(self, tenant_name: str) -> bool:
        return self.is_admin and (self.tenant is None or self.tenant.name == tenant_name)


class AuthError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class TenantDirectory:
    def __init__(self, settings: RouterSettings) -> None:
        self.dev_mode = settings.dev_mode
        self._tenants: dict[str, Tenant] = {}
        self._client_keys: dict[str, Tenant] = {}
        self._admin_keys: dict[str, Tenant | None] = {key: None for key in settings.admin_keys}
        # The tenants an equal share divides among (see _equal_share).
        self._sharing = max(len(settings.tenants), 1)
        self._max_sessions = {t.name: t.max_sessions for t in settings.tenants}
        equal_share = self._equal_share(1.0)
        for config in settings.tenants:
            salt = config.cache_salt or derive_salt(settings.salt_secret, config.name)
            share = config.budget.max_worker_share
            tenant = Tenant(config.name, salt, config.budget,
                            None if config.models is None else frozenset(config.models),
                            equal_share if share is None else share, config.max_in_flight,
                            # Dev mode has no tenants to keep apart: all is the operator's.
                            None if self.dev_mode
                            else (config.priority.min, config.priority.max),
                            config.api_calls)
            self._tenants[tenant.name] = tenant
            for key in config.api_keys:
                self._client_keys[key] = tenant
            for key in config.admin_keys:
                self._admin_keys[key] = tenant
        if DEFAULT_TENANT not in self._tenants:
            salt = None if self.dev_mode else derive_salt(settings.salt_secret, DEFAULT_TENANT)
            # A global admin's own traffic: one more tenant's equal share.
            self._tenants[DEFAULT_TENANT] = Tenant(DEFAULT_TENANT, salt, TenantBudget(),
                                                   worker_share=equal_share)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def session_cap(self, name: str, total: int) -> int:
        """The most sessions of tenant ``name`` kept in memory, of the router's ``total``:
        its ``max_sessions``, else an equal share (1 / the configured tenants). A tenant
        not configured (``default``, or one removed since its sessions were stored) gets
        an equal share too."""
        cap = self._max_sessions.get(name)
        return cap if cap is not None else max(int(self._equal_share(total)), 1)

    def _equal_share(self, whole: float) -> float:
        """A tenant's equal share of ``whole``: 1 / the configured tenants (all of it with
        none or one). The one rule behind a tenant's default share of each worker's
        budgets (``max_worker_share``) and of the sessions in memory (``max_sessions``);
        ``default`` when not configured (a global admin's own traffic) gets one too.
        (``int`` of a share of a count is its floor division: exact below 2**52.)"""
        return whole / self._sharing

    def charged(self, tenant: Tenant | None) -> Tenant:
        """The tenant a call of a key of ``tenant`` counts as (None: a global admin's
        key, or any call in dev mode): ``default``, the global admin's own traffic,
        whichever tenant the call names; a tenant key's own tenant else."""
        return tenant if tenant is not None else self._tenants[DEFAULT_TENANT]

    def budget(self, name: str) -> TenantBudget | None:
        tenant = self._tenants.get(name)
        return tenant.budget if tenant is not None else None

    def client(self, key: str | None) -> Tenant:
        """The tenant an inference request belongs to; raises :class:`AuthError`."""
        if self.dev_mode:
            return self._tenants[DEFAULT_TENANT]
        if not key:
            raise AuthError(401, "missing API key (Authorization: Bearer <key>)")
        tenant = self._client_keys.get(key)
        if tenant is not None:
            return tenant
        if key in self._admin_keys:
            # Admins may send inference too: their own tenant, or `default` when global.
            return self.charged(self._admin_keys[key])
        raise AuthError(401, "unknown API key")

    def principal(self, key: str | None) -> Principal:
        """Client or admin, for endpoints that accept both (end a session)."""
        if self.dev_mode:
            return Principal(None, is_admin=True)
        if key in self._admin_keys:
            return Principal(self._admin_keys[key], is_admin=True)
        return Principal(self.client(key), is_admin=False)

    def admin(self, key: str | None) -> Principal:
        principal = self.principal(key)
        if not principal.is_admin:
            raise AuthError(403, "this endpoint needs an admin key")
        return principal


def derive_salt(secret: str, tenant: str) -> str:
    """A stable per-tenant salt; hex, so it passes vLLM's salt rules."""
    return hmac.new(secret.encode(), tenant.encode(), hashlib.sha256).hexdigest()[:32]


def api_key_of(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: ``Authorization: Bearer <key>``, else ``X-API-Key``."""
    return api_key_from_headers(headers.get("authorization"), headers.get("x-api-key"))


def bearer_matches(authorization: str | None, secret: str) -> bool:
    """``Authorization: Bearer <secret>``, compared in constant time."""
    token = api_key_from_headers(authorization, None)
    return token is not None and hmac.compare_digest(token.encode(), secret.encode())


def api_key_from_headers(authorization: str | None, x_api_key: str | None) -> str | None:
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return x_api_key or None
