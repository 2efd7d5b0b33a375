"""Refusing what a page on another site can make the operator's browser send to the
router's state-changing endpoints (cross-site request forgery).

Why: in dev mode (no key configured) the admin API and the sessions API are open, and an
HTML form's POST (or a ``no-cors`` fetch) from any page the operator visits reaches them
with no CORS preflight: it could end sessions or send hints. Outside dev mode such a
request carries no key (a browser attaches no bearer key by itself; the router uses no
cookie and no HTTP authentication), so it is refused as unauthenticated before this
check.

The contract, for every method but GET and HEAD on the endpoints that call
:func:`cross_site_refusal` (after their key check: a request without a key outside dev
mode is still a 401):

1. ``Sec-Fetch-Site`` present and neither ``same-origin`` nor ``none``: refused
   (``cross_site``). The browser sets it, comparing the sending page's origin with the
   router's own; a page cannot (a forbidden header name). API clients (curl, SDKs) do not
   send it. It also refuses a same-site page (another port of the same host).
2. A POST must carry something a page of another origin cannot make a browser send
   without a CORS preflight, which the router never grants on these endpoints (it sends
   ``Access-Control-Allow-*`` headers only on the inference endpoints, and only when
   ``cors_allowed_origins`` is set: origin_policy.py): an ``Authorization`` or
   ``X-API-Key`` header, an ``X-Kvhint-Request`` header (any value: what the dashboard
   sends), or ``Content-Type: application/json``. Else refused (``no_marker``): a form can send only
   ``application/x-www-form-urlencoded``, ``multipart/form-data`` or ``text/plain`` and
   no header of its own. Other methods (PUT, PATCH, DELETE) are preflighted by
   themselves. This rule holds in browsers that send no ``Sec-Fetch-Site``.

Not compared: ``Origin`` with the request's ``Host``. Behind a proxy that terminates TLS
or rewrites ``Host`` the router does not know the origin its pages are served from, and
would refuse its own dashboard; ``Sec-Fetch-Site`` is that comparison, made by the browser.
It cannot see DNS rebinding (a page whose name was re-pointed at the router is
same-origin): in dev mode origin_policy.py refuses a ``Host`` it does not know.

A bearer client passes both rules: it sends ``Authorization`` and no ``Sec-Fetch-Site``.
A dev-mode client without a key sends JSON (the hints call) or ``X-Kvhint-Request: 1``.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvhint.router.service.metrics import RouterMetrics

REQUEST_HEADER = "x-kvhint-request"
# Methods that change nothing on these endpoints (and whose answers a page of another
# origin cannot read: no CORS headers), left unchecked.
SAFE_METHODS = frozenset({"GET", "HEAD"})
# Sec-Fetch-Site values of a request the router's own pages (or the user) made.
_OWN_SITE = frozenset({"same-origin", "none"})

# The 403 messages, by reason (kvhint_router_cross_site_refusals_total{reason}). They
# name the fix and echo nothing the request sent.
MESSAGES = {
    "cross_site": (
        "refused: a cross-site browser request (Sec-Fetch-Site is not same-origin). This "
        "endpoint changes state; it takes requests from the router's own pages and from "
        "API clients only"),
    "no_marker": (
        "refused: a POST to this endpoint without an API key must send "
        "'Content-Type: application/json' or an 'X-Kvhint-Request' header (an HTML form "
        "on another site can send neither)"),
}


def cross_site_reason(method: str, headers: Mapping[str, str]) -> str | None:
    """Why a request is refused (a key of :data:`MESSAGES`), or None (module doc)."""
    if method.upper() in SAFE_METHODS:
        return None
    site = headers.get("sec-fetch-site")
    if site is not None and site.strip().lower() not in _OWN_SITE:
        return "cross_site"
    if method.upper() == "POST" and not _preflighted(headers):
        return "no_marker"
    return None


def cross_site_refusal(method: str, headers: Mapping[str, str], metrics: RouterMetrics,
                       endpoint: str) -> str | None:
    """The 403 message for a refused request, counted under ``endpoint`` (one of
    ``metric_labels.CROSS_SITE_ENDPOINTS``) and its reason; None when it may go on."""
    reason = cross_site_reason(method, headers)
    if reason is None:
        return None
    metrics.cross_site_refusals.labels(endpoint, reason).inc()
    return MESSAGES[reason]


def _preflighted(headers: Mapping[str, str]) -> bool:
    """It carries what only a CORS-preflighted request (or no browser) can send."""
    if any(headers.get(name) for name in ("authorization", "x-api-key", REQUEST_HEADER)):
        return True
    media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    return media_type == "application/json"
