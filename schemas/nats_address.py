"""The NATS address the router and the plugins share: ``nats_url``, one server URL or a
comma-separated list of them (``nats://``, ``tls://``, ``ws://``, ``wss://``), which may
carry credentials (``nats://user:password@host:4222``, ``nats://token@host:4222``).

Contract: :func:`nats_servers` is what a client connects to; :func:`loggable_nats_url` is
the only form that reaches a log line, an error message or an admin answer: credentials in
a URL are as secret as the admin keys.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def nats_servers(url: str | None) -> list[str]:
    """The server URLs in ``url`` (a comma-separated list), stripped; [] for none."""
    return [part.strip() for part in (url or "").split(",") if part.strip()]


def loggable_nats_url(url: str | None) -> str:
    """``url`` with any user name, password or token of each server replaced by ``***``;
    a part that does not parse as a URL is replaced whole (it might be a secret)."""
    shown = []
    for server in nats_servers(url):
        try:
            parts = urlsplit(server)
            if "@" not in parts.netloc:
                shown.append(server)
                continue
            host, port = parts.hostname, parts.port
        except ValueError:
            shown.append("***")
            continue
        netloc = "***@" + (f"[{host}]" if host and ":" in host else host or "")
        netloc += f":{port}" if port is not None else ""
        shown.append(urlunsplit((parts.scheme, netloc, parts.path, parts.query,
                                 parts.fragment)))
    return ",".join(shown)
