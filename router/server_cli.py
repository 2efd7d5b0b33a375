"""``kvhint router``: serve the router (uvicorn) from a config file and/or environment.

    kvhint router --config router.yaml            # file, then KVHINT_ROUTER_* override it
    KVHINT_ROUTER_WORKERS=w0=http://127.0.0.1:8001 kvhint router

Registered by :mod:`kvhint.router.cli` through :func:`register`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvhint.router.service.log_throttle import LOG_EVERY_S, PerKeyLogThrottle

if TYPE_CHECKING:
    import uvicorn

    from kvhint.router.service.settings import RouterSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router", help="serve the OpenAI-compatible, session-aware router",
        description="Settings come from --config (YAML or JSON), overridden by KVHINT_ROUTER_* "
                    "environment variables, overridden by these flags.")
    parser.add_argument("--config", type=Path, default=None, help="YAML/JSON settings file")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--check-config", action="store_true",
                        help="validate the settings, print them (keys hidden) and exit")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError
    from pydantic_settings import SettingsError
    from sqlalchemy.engine import make_url

    from kvhint.router.service.settings import RouterSettings
    from kvhint.schemas.nats_address import loggable_nats_url

    overrides: dict[str, object] = {}
    if args.config is not None:
        overrides["config_file"] = args.config
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    try:
        settings = RouterSettings(**overrides)
    except ValidationError as exc:
        # Each problem's setting and message, never the value given: that may be a key.
        problems = "\n".join(
            f"  {'.'.join(map(str, error['loc'])) or '(settings)'}: {error['msg']}"
            for error in exc.errors(include_url=False, include_input=False))
        print(f"kvhint router: invalid settings:\n{problems}", file=sys.stderr)
        return 2
    except (SettingsError, FileNotFoundError, yaml.YAMLError) as exc:
        print(f"kvhint router: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if args.check_config:
        shown = settings.model_dump(mode="json")
        shown["admin_keys"] = ["***"] * len(settings.admin_keys)
        for tenant in shown["tenants"]:
            tenant["api_keys"] = ["***"] * len(tenant["api_keys"])
            tenant["admin_keys"] = ["***"] * len(tenant["admin_keys"])
        shown["salt_secret"] = "***"
        if settings.metrics_token is not None:
            shown["metrics_token"] = "***"
        # Credentials in either URL are as secret as the keys above.
        shown["nats_url"] = settings.nats_url and loggable_nats_url(settings.nats_url)
        shown["database_url"] = make_url(settings.database_url).render_as_string(
            hide_password=True)
        print(json.dumps(shown, indent=2))
        return 0
    return serve(settings)


def serve(settings: RouterSettings) -> int:
    import uvicorn

    from kvhint.router.service.app import create_app
    from kvhint.router.store.database import store_unreachable

    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if problem := store_unreachable(settings.database_url, settings.store_connect_timeout_s):
        print(f"kvhint router: {problem}", file=sys.stderr)
        return 1
    uvicorn.Server(uvicorn_config(create_app(settings), settings)).run()
    return 0


def uvicorn_config(app: Any, settings: RouterSettings) -> uvicorn.Config:
    """How the router's HTTP server runs. uvloop when installed; h11, not httptools,
    for its bound on a request's headers (httptools buffers headers of any size: the
    fix vLLM made for GHSA-rxc4-3w6r-4v47), with deadlines for slow clients
    (``client_deadlines.py``; plain h11, logged as an error, where uvicorn lacks the
    hooks they need)."""
    import uvicorn

    from kvhint.router.service.client_deadlines import deadline_protocol

    def timed_out(phase: str) -> None:
        # The runtime (and its metrics) exists once the app's lifespan has started it.
        runtime = getattr(getattr(app, "state", None), "runtime", None)
        if runtime is not None:
            runtime.metrics.client_timeouts.labels(phase).inc()

    def malformed() -> None:
        runtime = getattr(getattr(app, "state", None), "runtime", None)
        if runtime is not None:
            runtime.metrics.route_refusals.labels("malformed_request").inc()

    protocol = deadline_protocol(settings.http_header_timeout_s, settings.http_body_timeout_s,
                                 timed_out, malformed)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=False, loop="auto", http=protocol or "h11",
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=settings.http_keep_alive_s,
        timeout_graceful_shutdown=settings.http_shutdown_grace_s,
        limit_concurrency=settings.http_max_concurrency,
        proxy_headers=False, server_header=False)
    # After the Config: it (re)configures uvicorn's loggers (which leaves filters be).
    throttle_client_warnings(logging.getLogger("uvicorn.error"))
    return config


# uvicorn's warnings that any client causes, one per request it sends (uvicorn's
# h11_impl.py logs each on "uvicorn.error"), and what a throttled line adds.
CLIENT_CAUSED_WARNINGS = {
    "Invalid HTTP request received.":
        'each a 400, counted in kvhint_router_route_refusals_total{reason="malformed_request"}',
    "Unsupported upgrade request.": "each served as plain HTTP/1.1",
}


class ClientWarningThrottle(logging.Filter):
    """Of each of :data:`CLIENT_CAUSED_WARNINGS`, the first logged, then at most one per
    ``every_s``, saying how many were held back in between (log_throttle.py): before,
    every malformed request was a WARNING line, so a client could flood the log. Other
    records pass untouched."""

    def __init__(self, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._throttle = PerKeyLogThrottle(every_s, clock=clock)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg
        if not isinstance(message, str) or message not in CLIENT_CAUSED_WARNINGS:
            return True
        held = self._throttle.admit(message)
        if held is None:
            return False
        record.msg = (f"{message} (at most one such line per {self._throttle.every_s:g} s; "
                      f"{held} more since the last one; {CLIENT_CAUSED_WARNINGS[message]})")
        return True


def throttle_client_warnings(logger: logging.Logger) -> None:
    """:class:`ClientWarningThrottle` on ``logger``, in place of any earlier one (a
    logger outlives the Config that filtered it: one throttle, not one per Config)."""
    for earlier in [f for f in logger.filters if isinstance(f, ClientWarningThrottle)]:
        logger.removeFilter(earlier)
    logger.addFilter(ClientWarningThrottle())
