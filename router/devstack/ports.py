"""Ports for the servers the dev stack and the tests start on 127.0.0.1.

:func:`free_port` only finds a port free when it looks: another process may bind it
before the server it was meant for does (EADDRINUSE; a clean-clone CI run saw it). A
server in this process takes :func:`reserved_socket` instead, bound at once. A child
process cannot be handed a socket that simply, so :func:`on_free_port` starts it again on
another port when its start failed on a taken one (:class:`PortTaken`). Only ports picked
here move that way: a port a user chose stays that port, or the start fails.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import IO, TypeVar

T = TypeVar("T")

# How many ports :func:`on_free_port` tries.
START_TRIES = 3
# What a server writes when its bind failed on a taken port: nats-server (Go's "bind:
# address already in use") and Python servers ("[Errno 98] Address already in use").
_ADDRESS_IN_USE = "address already in use"


class PortTaken(RuntimeError):
    """A server could not listen on its port: another process had bound it first."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing was bound to just now; it may be taken before it is used."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reserved_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a port the kernel picked, not listening yet: no other process
    can take the port, and connections to it are refused until it is served (uvicorn's
    ``serve(sockets=[...])``, aiohttp's ``SockSite``, asyncio's ``start_server(sock=...)``,
    each of which closes it when it stops)."""
    sock = socket.socket()
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def listening(sock: socket.socket) -> socket.socket:
    """``sock`` (a :func:`reserved_socket`) listening, with SO_REUSEADDR as servers bind
    theirs: a server started again on its port later is not refused for the closed
    connections this one leaves (TIME_WAIT). Only now: bound but not listening, a socket
    with it would let another process's bind share its port."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.listen()
    return sock


def says_port_taken(output: IO[bytes], offset: int = 0) -> bool:
    """Whether what a server wrote to ``output`` (a file open for reading, from byte
    ``offset``: this start's part) says its bind failed on a taken port."""
    output.seek(offset)
    return _ADDRESS_IN_USE in output.read().decode(errors="replace").lower()


def log_says_port_taken(log_path: str | os.PathLike[str], offset: int = 0) -> bool:
    """:func:`says_port_taken` of the log file at ``log_path`` (False where it cannot be
    read)."""
    try:
        with open(log_path, "rb") as log:
            return says_port_taken(log, offset)
    except OSError:
        return False


def on_free_port(start: Callable[[int], T], first: int | None = None,
                 tries: int = START_TRIES) -> T:
    """``start(port)`` on ``first``, else on a port :func:`free_port` picks; when it raises
    :class:`PortTaken`, again on a new port, ``tries`` times in all (the last try's
    PortTaken is raised). ``first`` must be a port picked here too, not a user's."""
    port = first or free_port()
    for _ in range(tries - 1):
        try:
            return start(port)
        except PortTaken:
            port = free_port()
    return start(port)
