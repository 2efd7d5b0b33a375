"""The form of a worker's ``http_url``: the address a plugin's heartbeat advertises and
a router routes to (and sends its ``worker_api_key`` to). One rule for both sides: the
plugin checks its configured ``http_url`` at start-up (engine_plugin/config.py), so a
typo fails there with a message instead of being refused by every router that reads its
heartbeats (router/service/worker_urls.py adds which hosts it takes).

The form: ``http``/``https``, a host (a name or an IP), no user or password, no query or
fragment, printable ASCII, a valid port, at most :data:`MAX_URL_CHARS` characters.
Pure: no I/O (no DNS lookup: a name is judged as written).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_CHARS = 2048
HOST_NAME_RE = re.compile(
    r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")


def http_url_form(url: str) -> tuple[str | None, str | None]:
    """(why ``url`` is no worker address, None) or (None, its host, lower-cased)."""
    if len(url) > MAX_URL_CHARS:
        return f"http_url longer than {MAX_URL_CHARS} characters", None
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        return "http_url has spaces, control or non-ASCII characters", None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"http_url unreadable ({exc})", None
    del port  # read for its check only
    if parts.scheme not in ("http", "https"):
        return f"http_url scheme {parts.scheme or '(none)'!r}: http or https only", None
    if parts.username is not None or parts.password is not None:
        return "http_url carries a user or password", None
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "http_url has a query or fragment", None
    host = (parts.hostname or "").rstrip(".")
    if not host:
        return "http_url names no host", None
    if ip_of(host) is None and not HOST_NAME_RE.match(host):
        return f"http_url host {host!r} is no host name", None
    return None, host


def ip_of(host: str) -> IpAddress | None:
    """``host`` as an IP address (an IPv4-mapped IPv6 one as its IPv4), or None."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
