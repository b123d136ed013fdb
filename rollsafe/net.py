"""Host and port helpers shared by the transports: which TCP port is free on a host.

Owns :func:`free_port`. Imports only the standard library.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (``""``/``localhost`` bind the loopback address;
    an IPv6 literal, bracketed or not, binds IPv6). Another process may take it before the
    caller binds it: use it where the binding side cannot report the port it picked."""
    bind = {"": "127.0.0.1", "localhost": "127.0.0.1"}.get(host, host).strip("[]")
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return int(s.getsockname()[1])
