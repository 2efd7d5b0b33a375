"""What the router answers browsers for, before routing a request (:class:`OriginPolicy`,
applied by ``app.RouterApp`` to every HTTP request).

1. DNS rebinding (dev mode only). With no key configured the router is open, and
   :mod:`cross_site` lets through what the browser calls same-origin. A page served from
   a name its owner's DNS later points at 127.0.0.1 *is* same-origin with the router as
   far as the browser knows (``Sec-Fetch-Site: same-origin``), and may read every answer.
   What gives it away is the ``Host`` header: the attacker's name. In dev mode a request
   is refused (403, ``kvhint_router_host_refusals_total``) unless its ``Host`` is
   ``localhost`` or ``*.localhost`` (browsers resolve those to loopback themselves), an
   IP address (an origin that is an address cannot be re-pointed), a name without a dot
   (``router`` from another container: resolved by the local resolver, docker's DNS or a
   hosts file, not by public DNS an attacker controls; a top-level domain's own records
   are not theirs either), or a name in ``allowed_hosts`` (``"*"``: any, the check off).
   A request without ``Host`` (HTTP/1.0) passes: every browser sends one. Outside dev
   mode every call needs a key, which a rebound page does not have: nothing is checked.
2. CORS, opt-in (``cors_allowed_origins``): a browser app on a listed origin may call
   the OpenAI-compatible endpoints (:data:`CORS_PATHS`) as it could call vLLM started
   with ``--allowed-origins``. Nothing else gets a CORS header, ever: not ``/admin``,
   ``/metrics``, the dashboard, nor the sessions API, so the preflight a page needs for
   any state-changing call there is still never granted, and :mod:`cross_site`'s rules
   hold for an allowed origin too. A preflight on those paths is answered 204 for a
   listed origin, the path's own method and well-formed header names (mirrored, as
   vLLM's default ``--allowed-headers '["*"]'`` does: OpenAI's JS SDK sends its own
   ``x-stainless-*`` headers), else 403, counted by reason
   (``kvhint_router_cors_refusals_total``). ``"*"`` allows every origin and cannot be
   combined with ``cors_allow_credentials`` (a browser would send cookies or HTTP
   authentication a proxy in front of the router checks, from any site).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import Message, Scope, Send

if TYPE_CHECKING:
    from kvhint.router.service.metrics import RouterMetrics
    from kvhint.router.service.settings import RouterSettings

log = logging.getLogger("kvhint.router")

# The paths a browser app may call across origins, and the methods each takes. Exact
# paths: /v1/sessions/... (the sessions API) is not among them.
CORS_PATHS: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/completions": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),  # HEAD: a 405 (app.py _no_head)
    "/v1/responses": frozenset({"POST"}),
}
# A stored response's own paths (responses_api.py): one path segment for its id.
_RESPONSE_ID_PATH = re.compile(r"/v1/responses/[^/]+")


def cors_methods(path: str) -> frozenset[str] | None:
    """The methods a browser app may call ``path`` with across origins; None: not a
    CORS path."""
    methods = CORS_PATHS.get(path)
    if methods is not None or not path.startswith("/v1/responses/"):
        return methods
    if _RESPONSE_ID_PATH.fullmatch(path):
        return frozenset({"GET"})
    if path.endswith("/cancel") and _RESPONSE_ID_PATH.fullmatch(path[:-len("/cancel")]):
        return frozenset({"POST"})
    return None
# Response headers a browser app may read beyond the CORS-safelisted ones.
_EXPOSED = "Retry-After, X-Kvhint-Worker"
_PREFLIGHT_MAX_AGE_S = "600"
# An HTTP header name (RFC 9110 token), lower-cased as browsers send them.
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9a-z]+$")
_LABEL = r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?"
_HOST_NAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_DEFAULT_PORTS = {"http": 80, "https": 443}

HOST_REFUSAL = (
    "refused: this router runs in dev mode (no API key configured) and answers only "
    "requests addressed to localhost, an IP address, a name without a dot or a name in "
    "allowed_hosts (KVHINT_ROUTER_ALLOWED_HOSTS), against DNS rebinding: add the name "
    "clients use to reach it there, or configure API keys")
# kvhint_router_cors_refusals_total{reason}: a bounded set; the 403 message for each.
CORS_REFUSALS = {
    "origin": "refused: CORS preflight from an origin not in cors_allowed_origins "
              "(KVHINT_ROUTER_CORS_ALLOWED_ORIGINS)",
    "method": "refused: CORS preflight for a method this endpoint does not take",
    "headers": "refused: CORS preflight naming a header that is not a valid header name",
}


def normalize_origin(value: str) -> str:
    """A ``cors_allowed_origins`` entry as a browser's ``Origin`` header spells it
    (lower case, no default port, no trailing ``/``), or ``"*"``; else ValueError."""
    value = value.strip()
    if value == "*":
        return value
    if value.lower() == "null":
        raise ValueError("cors_allowed_origins: 'null' is the origin of every sandboxed "
                         "frame and local file; it cannot be allowed")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (parts is None or parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname
            or parts.username is not None or parts.path not in ("", "/") or parts.query
            or parts.fragment):
        raise ValueError(f"cors_allowed_origins: {value!r} is not an origin: "
                         "http(s)://host[:port], no path (or '*')")
    scheme, host = parts.scheme.lower(), parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def normalize_host(value: str) -> str:
    """An ``allowed_hosts`` entry: a host name without port, lower case, or ``"*"``."""
    name = value.strip().lower().removesuffix(".")
    if name != "*" and not _HOST_NAME.match(name):
        raise ValueError(f"allowed_hosts: {value!r} is not a host name (no port, no "
                         "scheme; '*' allows any)")
    return name


CorsOrigin = Annotated[str, AfterValidator(normalize_origin)]
AllowedHost = Annotated[str, AfterValidator(normalize_host)]


def cors_problem(origins: list[str], credentials: bool) -> str | None:
    """What is wrong with these CORS settings together, or None."""
    if "*" in origins and credentials:
        return ("cors_allowed_origins '*' with cors_allow_credentials: every site could "
                "send the cookies or HTTP authentication of the router's users; list "
                "the origins")
    if "*" in origins and len(origins) > 1:
        return "cors_allowed_origins: '*' allows every origin; list it alone"
    return None


def host_served(host: str | None, allowed: frozenset[str]) -> bool:
    """Whether dev mode answers a request with this ``Host`` header (module doc, 1)."""
    if host is None:
        return True
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal, maybe with a port
        literal, bracket, _ = host[1:].partition("]")
        return bool(bracket) and _is_address(literal)
    name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
    if port and not port.isdigit():
        return False
    if name.endswith("."):  # absolute: "router." is a top-level name in public DNS
        name = name[:-1]
        if "." not in name and name != "localhost":
            return name in allowed
    if not _HOST_NAME.match(name):
        return False
    return (name == "localhost" or name.endswith(".localhost") or "." not in name
            or name in allowed or _is_address(name))


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class CorsGrant:
    """The CORS headers one request's answer gets (an allowed origin, a CORS path)."""

    def __init__(self, allow_origin: str, credentials: bool) -> None:
        self.allow_origin = allow_origin
        self.credentials = credentials

    def apply(self, headers: MutableHeaders) -> None:
        headers["access-control-allow-origin"] = self.allow_origin
        headers["access-control-expose-headers"] = _EXPOSED
        if self.credentials:
            headers["access-control-allow-credentials"] = "true"
        if self.allow_origin != "*":  # caches must not serve one origin's to another
            headers.add_vary_header("Origin")

    def wrap(self, send: Send) -> Send:
        """``send`` adding these headers to the answer's start (routes the app serves)."""
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.apply(MutableHeaders(scope=message))
            await send(message)
        return sending


class OriginPolicy:
    """The settings' browser policy (module doc). ``refuse(message, status)`` builds the
    app's error answer (app.py's, in the OpenAI error shape; this module is imported by
    settings.py, so it imports none of the modules that import the settings)."""

    def __init__(self, settings: RouterSettings,
                 refuse: Callable[[str, int], Response]) -> None:
        self._refuse = refuse
        self._hosts = frozenset(settings.allowed_hosts)
        self.checks_host = settings.dev_mode and "*" not in self._hosts
        self._origins = frozenset(settings.cors_allowed_origins)
        self._any_origin = "*" in self._origins
        self._credentials = settings.cors_allow_credentials
        self.active = self.checks_host or bool(self._origins)
        self._warned_host = False

    def screen(self, scope: Scope, metrics: RouterMetrics) -> Response | None:
        """The answer to give instead of routing this request: a Host refusal, or a CORS
        preflight's answer (granted or refused, counted); None: route it."""
        headers = Headers(scope=scope)
        if self.checks_host and not host_served(headers.get("host"), self._hosts):
            metrics.host_refusals.inc()
            if not self._warned_host:  # once: the 403 itself names the setting
                self._warned_host = True
                log.warning("dev mode: refused a request for Host %r (allowed_hosts; "
                            "counted in kvhint_router_host_refusals_total)",
                            headers.get("host"))
            return self._refuse(HOST_REFUSAL, 403)
        methods = cors_methods(scope["path"])
        if (not self._origins or methods is None or scope["method"] != "OPTIONS"
                or "access-control-request-method" not in headers or "origin" not in headers):
            return None
        reason = self._preflight_refusal(headers, methods)
        if reason is not None:
            metrics.cors_refusals.labels(reason).inc()
            return self._refuse(CORS_REFUSALS[reason], 403)
        response = Response(status_code=204)
        self._grant(headers["origin"]).apply(response.headers)
        response.headers["access-control-allow-methods"] = ", ".join(sorted(methods))
        response.headers["access-control-max-age"] = _PREFLIGHT_MAX_AGE_S
        if requested := _requested_headers(headers):
            response.headers["access-control-allow-headers"] = ", ".join(requested)
        return response

    def cors_grant(self, scope: Scope) -> CorsGrant | None:
        """The CORS headers for a request's answer: None unless CORS is on, the path is
        one of :data:`CORS_PATHS` and the request's ``Origin`` is allowed."""
        if not self._origins or cors_methods(scope["path"]) is None:
            return None
        origin = Headers(scope=scope).get("origin")
        if origin is None or not (self._any_origin or origin in self._origins):
            return None
        return self._grant(origin)

    def _grant(self, origin: str) -> CorsGrant:
        allow = "*" if self._any_origin and not self._credentials else origin
        return CorsGrant(allow, self._credentials)

    def _preflight_refusal(self, headers: Headers, methods: frozenset[str]) -> str | None:
        if not (self._any_origin or headers["origin"] in self._origins):
            return "origin"
        if headers["access-control-request-method"].strip().upper() not in methods:
            return "method"
        if not all(_TOKEN.match(name) for name in _requested_headers(headers)):
            return "headers"
        return None


def _requested_headers(headers: Headers) -> list[str]:
    requested = headers.get("access-control-request-headers", "")
    return [name.strip().lower() for name in requested.split(",") if name.strip()]

