"""Ports for rendezvous that a launcher picks itself (standard library only)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on right now, chosen by the OS: bound on ``host`` ("" = every
    interface, for a port other nodes connect to; "127.0.0.1" for one on this machine only)
    and released at once, so another process may take it before the caller binds it (a rare
    race, which the callers accept)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
