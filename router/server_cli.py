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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

    from kvhint.router.service.settings import RouterSettings

    overrides: dict[str, object] = {}
    if args.config is not None:
        overrides["config_file"] = args.config
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    try:
        settings = RouterSettings(**overrides)
    except (ValidationError, SettingsError, FileNotFoundError, yaml.YAMLError) as exc:
        print(f"kvhint router: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if args.check_config:
        shown = settings.model_dump(mode="json")
        shown["admin_keys"] = ["***"] * len(settings.admin_keys)
        for tenant in shown["tenants"]:
            tenant["api_keys"] = ["***"] * len(tenant["api_keys"])
            tenant["admin_keys"] = ["***"] * len(tenant["admin_keys"])
        shown["salt_secret"] = "***"
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
    app = create_app(settings)
    # uvloop + httptools when installed (they are with uvicorn[standard] / vLLM): the
    # proxy's added latency is a benchmark target.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False, loop="auto", http="auto", timeout_keep_alive=60,
                proxy_headers=False, server_header=False)
    return 0
