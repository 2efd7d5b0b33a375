"""``GET /dashboard``: one static page that polls ``/admin/overview`` and draws the
cached-token share over time, prediction accuracy, workers, sessions and hints.

The page is public (it holds no data); the data endpoint needs an admin key, which the
page takes from ``?key=`` once and keeps in the browser's localStorage.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse


def build_dashboard_router() -> APIRouter:
    router = APIRouter(tags=["dashboard"])
    page = (files("kvhint.router.service") / "static" / "dashboard.html").read_text()

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    return router
