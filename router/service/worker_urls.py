"""Which addresses a worker's heartbeat may give it.

A worker the router is not configured with (``workers``) is routed to at the ``http_url``
its plugin's heartbeat names, and gets the fleet's ``worker_api_key`` there. Whoever can
publish on ``<prefix>.v1.status.<w>`` names that URL: unchecked, one heartbeat pointed the
router (client prompts, and the key) anywhere. :class:`HeartbeatUrlPolicy` says whether
such a URL is taken; a refused one leaves the worker without an address (its heartbeat
still feeds the index and its liveness), never routed to, never sent the key.

- The form, always: ``http``/``https``, a host, no user or password, no query or
  fragment, printable ASCII, a valid port (schemas/worker_url.py: the plugin checks its
  own ``http_url`` by the same rule at start-up).
- The host: ``heartbeat_worker_hosts`` entries (an exact name, ``*.suffix``, an IP or a
  CIDR, ``*`` for any); none given: the addresses of a private network only (``localhost``,
  a name without a dot, a loopback, RFC 1918, link-local or unique-local IP), so a heartbeat can name a
  compose service or a pod on the router's network, never a public name or address.
- ``learn_workers_from_heartbeats`` false: no heartbeat gives a worker an address.

Pure: no I/O (no DNS lookup: a name is judged as written).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

# The URL's form is the plugin's rule too (it checks its own http_url at start-up).
from kvhint.schemas.worker_url import HOST_NAME_RE as _NAME_RE
from kvhint.schemas.worker_url import http_url_form as url_form
from kvhint.schemas.worker_url import ip_of as _ip

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# What heartbeat_worker_hosts unset allows of IP addresses: loopback, RFC 1918, link-local,
# IPv6 unique-local (ipaddress's is_private takes the documentation ranges too).
PRIVATE_NETWORKS: tuple[IpNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
    "::1/128", "fc00::/7", "fe80::/10"))


def parse_host_entry(entry: str) -> str:
    """``entry`` checked (a settings validator's): ``*``, ``*.suffix``, an IP, a CIDR or a
    host name; lower-cased. Raises ValueError."""
    value = entry.strip().lower()
    if value == "*":
        return value
    if value.endswith(".") and value != "*.":  # a fully qualified name's root dot
        value = value[:-1]
    if "/" in value or _ip(value) is not None:
        try:
            return str(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ValueError(f"heartbeat_worker_hosts entry {entry!r}: not an IP network")
    name = value[2:] if value.startswith("*.") else value
    if not name or not _NAME_RE.match(name):
        raise ValueError(f"heartbeat_worker_hosts entry {entry!r}: use a host name, "
                         "*.domain, an IP, a CIDR or *")
    return value


@dataclass(frozen=True, slots=True)
class HeartbeatUrlPolicy:
    learn: bool = True
    # parse_host_entry's values; empty: a private network's addresses only (module doc).
    hosts: tuple[str, ...] = ()

    @classmethod
    def from_entries(cls, learn: bool, entries: list[str]) -> HeartbeatUrlPolicy:
        return cls(learn, tuple(parse_host_entry(e) for e in entries))

    def refusal(self, url: str) -> str | None:
        """Why a heartbeat's ``url`` may not be a worker's address; None: it may."""
        if not self.learn:
            return "learn_workers_from_heartbeats is off"
        problem, host = url_form(url)
        if problem is not None:
            return problem
        assert host is not None
        if not self._allows(host):
            return (f"host {host!r} not in heartbeat_worker_hosts"
                    if self.hosts else f"host {host!r} is not a private-network address "
                    "(heartbeat_worker_hosts unset)")
        return None

    def _allows(self, host: str) -> bool:
        address = _ip(host)
        if not self.hosts:
            if address is not None:
                return any(address in network for network in PRIVATE_NETWORKS)
            return host == "localhost" or "." not in host
        for entry in self.hosts:
            if entry == "*" or entry == host:
                return True
            if entry.startswith("*.") and address is None and host.endswith(entry[1:]):
                return True
            if "/" in entry and address is not None \
                    and address in ipaddress.ip_network(entry):
                return True
        return False
