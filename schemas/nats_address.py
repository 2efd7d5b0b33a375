"""The NATS address the router and the plugins share: ``nats_url``, one server URL or a
comma-separated list of them (``nats://``, ``tls://``, ``ws://``, ``wss://``), which may
carry credentials (``nats://user:password@host:4222``, ``nats://token@host:4222``).

Contract: :func:`nats_servers` is what a client connects to; :func:`loggable_nats_url` is
the only form that reaches a log line, an error message or an admin answer: credentials in
a URL are as secret as the admin keys.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_URL_RE = re.compile(r"^(nats|tls|ws|wss)://[^\s]+$")
# nats-py refuses a server list that mixes these two families (every connect fails).
_WEBSOCKET_SCHEMES = frozenset({"ws", "wss"})


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


# Every secret in deploy/ (the Kubernetes Secrets, compose's router.yaml, and so the NATS
# password the workers get) is a public placeholder starting with this; the router and
# the plugin refuse to start with one.
PLACEHOLDER_SECRET_PREFIX = "change-me"


def is_placeholder_secret(value: str | None) -> bool:
    """Whether ``value`` is one of deploy/'s public placeholders (case ignored)."""
    return bool(value) and value.lower().startswith(PLACEHOLDER_SECRET_PREFIX)


def url_secret(url: str) -> str | None:
    """The password in one URL's user info, or its token (a user name alone); None."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return None
    return parts.password or parts.username


def nats_url_problem(url: str) -> str | None:
    """Why NATS's client (nats-py) cannot connect to ``url`` (a comma-separated list), or
    None. Each server needs a nats/tls/ws/wss scheme, a host and a port (if any) up to
    65535, and the list one kind of scheme. The message names a server only in its
    loggable form. Checked when the settings are read: nats-py refusing the URL later,
    in a connect loop, stopped that loop for good."""
    kinds = set()
    for server in nats_servers(url):
        problem = _server_problem(server)
        if problem:
            return f"{loggable_nats_url(server)!r} {problem}"
        kinds.add(urlsplit(server).scheme in _WEBSOCKET_SCHEMES)
    if len(kinds) > 1:
        return ("mixes ws/wss with nats/tls servers, which NATS's client refuses: list "
                "servers of one kind")
    return None


def _server_problem(url: str) -> str | None:
    if not _URL_RE.match(url):
        return "is not a nats:// (or tls/ws/wss) URL"
    parts = urlsplit(url)
    try:
        _ = parts.port  # parsing is the check: not a number, or past 65535
    except ValueError:
        return "has no valid port (a number up to 65535)"
    if not parts.hostname:
        return "has no host"
    return None
