"""``GET /dashboard``: one static page that polls ``/admin/overview`` and draws the
cached-token share over time, prediction accuracy, workers, sessions and hints.

The page is public (it holds no data); the data endpoint needs an admin key, which the
page takes from ``?key=`` once and keeps in the browser's localStorage.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse


def build_dashboard_router() -> APIRouter:
    router = APIRouter(tags=["dashboard"])
    page = (files("kvhint.router.service") / "static" / "dashboard.html").read_text()
    headers = security_headers(page)

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=headers)

    return router


def security_headers(page: str) -> dict[str, str]:
    """The page's own inline script runs (by its hash), nothing else does; it loads
    nothing from elsewhere, is framed nowhere and leaks no URL (its ``?key=``) in a
    Referer. Inline styles stay allowed: the page sets bar widths and legend colours."""
    scripts = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
        for body in re.findall(r"<script>(.*?)</script>", page, re.DOTALL))
    policy = (f"default-src 'self'; script-src {scripts}; style-src 'self' 'unsafe-inline'; "
              "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
              "frame-ancestors 'none'")
    return {"Content-Security-Policy": policy, "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
