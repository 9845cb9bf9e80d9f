"""A free TCP port on this host, for rendezvous and test servers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port no process listens on now (the OS picks it; another process may take it before
    the caller binds, which is why callers bind it at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
