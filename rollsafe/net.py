"""Host and port helpers shared by the transports: which TCP port is free on a host.

Owns :func:`free_port` and :func:`is_loopback`. Imports only the standard library.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["free_port", "is_loopback"]


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (``""``/``localhost`` bind the loopback address;
    an IPv6 literal, bracketed or not, binds IPv6). Another process may take it before the
    caller binds it: use it where the binding side cannot report the port it picked."""
    bind = {"": "127.0.0.1", "localhost": "127.0.0.1"}.get(host, host).strip("[]")
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
