"""The ``kvhint`` command. Subcommands import their code lazily so ``kvhint --help``
stays fast and each part needs only its own extra installed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _schemas_export(args: argparse.Namespace) -> int:
    from kvhint.schemas.export import export_schemas

    for path in export_schemas(Path(args.directory)):
        print(path)
    return 0


def _up(args: argparse.Namespace) -> int:
    from kvhint.router.devstack.up import DevStackOptions, run_dev_stack

    return run_dev_stack(
        DevStackOptions(
            state_dir=Path(args.state_dir),
            router_port=args.router_port,
            worker_base_port=args.worker_base_port,
            workers=args.workers,
            nats_url=args.nats_url,
            kv_cache_tokens=args.kv_cache_tokens,
        )
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start NATS, vLLM CPU workers with the plugin, and the router")
    up.add_argument("--state-dir", default=".kvhint", help="model, logs and database live here")
    up.add_argument("--router-port", type=int, default=8080)
    up.add_argument("--worker-base-port", type=int, default=8001)
    up.add_argument("--workers", type=_positive_int, default=2)
    up.add_argument("--nats-url", default="nats://127.0.0.1:4222",
                    help="used when a server answers there; else one is started")
    up.add_argument("--kv-cache-tokens", type=int, default=16_384)
    up.set_defaults(func=_up)

    schemas = sub.add_parser("schemas", help="the wire contract")
    schemas_sub = schemas.add_subparsers(dest="schemas_command", required=True)
    export = schemas_sub.add_parser("export", help="write JSON Schema for every message")
    export.add_argument("directory")
    export.set_defaults(func=_schemas_export)

    _add_optional_subcommands(sub)
    return parser


def _add_optional_subcommands(sub: argparse._SubParsersAction) -> None:
    """Subcommands whose code registers its own arguments (router, sim)."""
    from importlib import import_module
    from importlib.util import find_spec

    for name, module in (("router", "kvhint.router.server_cli"), ("sim", "kvhint.router.sim.cli")):
        if find_spec(module.rpartition(".")[0]) is None or find_spec(module) is None:
            missing = sub.add_parser(name, help=f"({name} is not built yet)")
            missing.set_defaults(func=lambda _args, _name=name: _not_built(_name))
            continue
        import_module(module).register(sub)


def _not_built(name: str) -> int:
    print(f"kvhint {name}: not available in this build yet", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
