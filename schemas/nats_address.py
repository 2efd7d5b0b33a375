"""The NATS address the router and the plugins share: ``nats_url``, one server URL or a
comma-separated list of them (``nats://``, ``tls://``, ``ws://``, ``wss://``), which may
carry credentials (``nats://user:password@host:4222``, ``nats://token@host:4222``).

A user name, password or token holding ``/``, ``#``, ``?``, ``@``, ``%``, ``,`` (or
``:`` in a user name) is written percent-encoded (``p%2Fa%23ss``), as in any URL: nats-py
does not decode user info (it would send ``%2F`` as is), unencoded ``/``, ``#`` or ``?``
end the URL's host part early (nats-py then connects to the wrong host), and ``,``
separates servers.

Contract: :func:`nats_connection` is what a client connects with: the servers without
their user info, and the decoded credentials, which nats-py's ``connect`` takes as
``user=``/``password=`` (or ``token=``) and sends to every server, those it discovers
from the cluster included. :func:`loggable_nats_url` is the only form that reaches a log
line, an error message or an admin answer: credentials in a URL are as secret as the
admin keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

_URL_RE = re.compile(r"^(nats|tls|ws|wss)://[^\s]+$")
# nats-py refuses a server list that mixes these two families (every connect fails).
_WEBSOCKET_SCHEMES = frozenset({"ws", "wss"})
_ENCODE_HINT = ("percent-encode '/', '#', '?', '@', '%' and ',' in a user name or password "
                "(%2F, %23, %3F, %40, %25, %2C)")


@dataclass(frozen=True)
class NatsConnection:
    """What nats-py's ``connect`` is given for one ``nats_url``: ``servers`` (no user
    info) and at most one set of credentials, ``user`` with ``password``, or ``token``
    (a URL's user name without a password, as nats-py reads it). Never logged: the
    secrets are left out of its repr."""

    servers: tuple[str, ...]
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)


def nats_servers(url: str | None) -> list[str]:
    """The server entries in ``url`` (a comma-separated list) as written, stripped; []
    for none. Connect with :func:`nats_connection`, not these."""
    return [part.strip() for part in (url or "").split(",") if part.strip()]


def loggable_nats_url(url: str | None) -> str:
    """``url`` with everything between each server's scheme and its last ``@`` (any user
    name, password or token, parsed or not) replaced by ``***``. Decided on the text,
    not on a parse: an unencoded ``/``, ``#`` or ``?`` in a password ends the URL's host
    part early, and a parse then sees no user info and would show the password."""
    shown = []
    for server in nats_servers(url):
        if "@" not in server:
            shown.append(server)
            continue
        scheme, sep, _ = server.partition("://")
        prefix = f"{scheme}://" if sep and scheme.isalnum() else ""
        shown.append(f"{prefix}***@{server.rpartition('@')[2]}")
    return ",".join(shown)


# Every secret in deploy/ (the Kubernetes Secrets, compose's router.yaml, and so the NATS
# password the workers get) is a public placeholder starting with this; the router and
# the plugin refuse to start with one.
PLACEHOLDER_SECRET_PREFIX = "change-me"


def is_placeholder_secret(value: str | None) -> bool:
    """Whether ``value`` is one of deploy/'s public placeholders (case ignored)."""
    return bool(value) and value.lower().startswith(PLACEHOLDER_SECRET_PREFIX)


def url_secret(url: str) -> str | None:
    """The password in one URL's user info, or its token (a user name alone),
    percent-decoded; None when there is none or the URL does not parse."""
    try:
        parts = urlsplit(url.strip())
        secret = parts.password or parts.username
        return unquote(secret, errors="strict") if secret else None
    except (ValueError, UnicodeDecodeError):
        return None


def nats_connection(url: str) -> NatsConnection:
    """What to connect to ``url`` with (module doc). Raises ValueError, with
    :func:`nats_url_problem`'s message, for a URL it refuses; the settings of the router
    and the plugin have refused those already."""
    if problem := nats_url_problem(url):
        raise ValueError(problem)
    servers: list[str] = []
    # One set at most: nats_url_problem refuses servers with different ones.
    credentials: set[tuple[str | None, str | None, str | None]] = set()
    for server in nats_servers(url):
        parts = urlsplit(server)
        servers.append(urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])))
        if found := _credentials(parts):
            credentials.add(found)
    user, password, token = credentials.pop() if credentials else (None, None, None)
    return NatsConnection(tuple(servers), user=user, password=password, token=token)


def _credentials(parts: SplitResult) -> tuple[str | None, str | None, str | None] | None:
    """(user, password, token) of one server, decoded, as nats-py reads a URL's: a user
    name without a password is a token; an empty user info is none."""
    if "@" not in parts.netloc:
        return None
    if parts.password is None:
        if not parts.username:
            return None
        return None, None, unquote(parts.username, errors="strict")
    return (unquote(parts.username or "", errors="strict"),
            unquote(parts.password, errors="strict"), None)


def nats_url_problem(url: str) -> str | None:
    """Why NATS's client (nats-py) cannot connect to ``url`` (a comma-separated list), or
    None. Each server needs a nats/tls/ws/wss scheme, a host and a port (if any) up to
    65535, its user info percent-encoded (module doc), the list one kind of scheme and
    one set of credentials (nats-py sends one to every server). The message names a
    server by its position and loggable form, never its credentials. Checked when the
    settings are read: nats-py refusing the URL later, in a connect loop, stopped that
    loop for good."""
    servers = nats_servers(url)
    if not servers:
        # Blank, or only ',' and spaces (a templating slip): nats-py given an empty
        # server list has none to try, and the connect loop would retry it for ever.
        return "names no server (it is blank, or only ',' and spaces)"
    for number, server in enumerate(servers, 1):
        # First: the entry before such a one ends inside its user info, and is reported
        # as it reads, secret and all, were it checked first.
        if "@" in server and "://" not in server:
            return (f"server {number} of {len(servers)} ({loggable_nats_url(server)!r}) "
                    "has no nats:// (or tls/ws/wss) scheme; if a ',' in a user name or "
                    f"password split the URL there: {_ENCODE_HINT}")
    kinds = set()
    first_credentials: tuple[tuple[str | None, str | None, str | None], int] | None = None
    for number, server in enumerate(servers, 1):
        where = f"server {number} of {len(servers)} ({loggable_nats_url(server)!r})"
        if problem := _server_problem(server):
            return f"{where} {problem}"
        parts = urlsplit(server)
        kinds.add(parts.scheme in _WEBSOCKET_SCHEMES)
        found = _credentials(parts)
        if found is None:
            continue
        if first_credentials is None:
            first_credentials = (found, number)
        elif found != first_credentials[0]:
            return (f"{where} has other credentials than server {first_credentials[1]}: "
                    "NATS's client sends one user and password (or token) to every "
                    "server; give the servers the same ones, or none but one")
    if len(kinds) > 1:
        return ("mixes ws/wss with nats/tls servers, which NATS's client refuses: list "
                "servers of one kind")
    return None


def _server_problem(url: str) -> str | None:
    if not _URL_RE.match(url):
        spaced = "@" in url and re.search(r"\s", url)
        return "is not a nats:// (or tls/ws/wss) URL" + (
            " (a space in a user name or password is written %20)" if spaced else "")
    parts = urlsplit(url)
    if url.rfind("@") > url.find("://") + 2 + len(parts.netloc):
        # An '@' past the host part: the user info held '/', '#' or '?', which ended the
        # host part at that character (nats-py would connect to a host made of it).
        return (f"has a '/', '#' or '?' in its user name or password, which ends the URL's "
                f"host part there: {_ENCODE_HINT}")
    try:
        _ = parts.port  # parsing is the check: not a number, or past 65535
    except ValueError:
        return "has no valid port (a number up to 65535)"
    if not parts.hostname:
        return "has no host"
    try:
        _credentials(parts)
    except UnicodeDecodeError:
        return "has a %-escape in its user info that does not decode as UTF-8"
    return None
