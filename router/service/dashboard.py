"""``GET /dashboard``: one static page that polls ``/admin/overview`` and draws the
cached-token share over time, prediction accuracy, workers, sessions and hints.

The page is public (it holds no data); the data endpoint needs an admin key, which the
page takes from its URL's fragment (``/dashboard#key=ADMIN_KEY``), keeps for the tab in
sessionStorage and sends as ``Authorization: Bearer``. A browser never sends a fragment,
so the key is in no request line, proxy log or access log. ``/dashboard?key=`` is
refused (400, ``drops_total{what="dashboard_key_in_query"}``): that key has travelled
in the request line already, and serving the page would let a bookmark go on leaking it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

# The refusal of /dashboard?key=: it names the fix and never echoes the key.
KEY_IN_QUERY = (
    "The dashboard no longer takes the admin key in the query string (?key=): a query "
    "travels in the request line, which proxies and access logs record. Open "
    "/dashboard#key=ADMIN_KEY instead (the fragment stays in the browser), and rotate a "
    "key that was sent as ?key=.\n")


def build_dashboard_router() -> APIRouter:
    router = APIRouter(tags=["dashboard"])
    page = (files("kvhint.router.service") / "static" / "dashboard.html").read_text()
    headers = security_headers(page)
    refusal_headers = {**headers, "Content-Security-Policy": "default-src 'none'"}

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        if "key" in request.query_params:
            request.app.state.runtime.metrics.drop("dashboard_key_in_query")
            return PlainTextResponse(KEY_IN_QUERY, status_code=400, headers=refusal_headers)
        return HTMLResponse(page, headers=headers)

    return router


def security_headers(page: str) -> dict[str, str]:
    """The page's own inline script runs (by its hash, computed here from the page as
    served: editing the script needs nothing else), nothing else does; it loads nothing
    from elsewhere, is framed nowhere, sends no Referer and is never content-sniffed
    (``nosniff``: a browser takes it, and the refusal of ``?key=``, as the type sent).
    Inline styles stay allowed: the page sets bar widths and legend colours."""
    scripts = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
        for body in re.findall(r"<script>(.*?)</script>", page, re.DOTALL))
    policy = (f"default-src 'self'; script-src {scripts}; style-src 'self' 'unsafe-inline'; "
              "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
              "frame-ancestors 'none'")
    return {"Content-Security-Policy": policy, "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-store"}
