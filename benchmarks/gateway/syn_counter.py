"""Count the TCP connection attempts (SYN packets) to one port on the loopback interface,
without touching them: after an engine is SIGKILLed its port refuses connections (the kernel
answers RST), so nothing at the engine can count what a front still sends it; this can.

A raw ``AF_PACKET`` socket on ``lo`` (needs root or ``CAP_NET_RAW``) with a classic BPF filter
(IPv4, TCP, destination port, SYN without ACK) attached, so the kernel hands this thread only
those packets. Each attempt is one connection a front opened to the dead engine: a forwarded
request, a retry or a health probe (the routers probe every 60 s by default).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

SO_ATTACH_FILTER = 26
PACKET_OUTGOING = 4
ETH_P_ALL = 0x0003


def _filter(port: int) -> bytes:
    """``ip and tcp and dst port PORT and tcp[13] & (SYN|ACK) == SYN`` (no fragments)."""
    ins = [
        (0x28, 0, 0, 12),  # ldh [12]            ethertype
        (0x15, 0, 10, 0x0800),  # jeq IPv4
        (0x30, 0, 0, 23),  # ldb [23]            protocol
        (0x15, 0, 8, 6),  # jeq TCP
        (0x28, 0, 0, 20),  # ldh [20]            flags + fragment offset
        (0x45, 6, 0, 0x1FFF),  # jset fragment -> drop
        (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf)   IP header length
        (0x48, 0, 0, 16),  # ldh [x+16]          TCP destination port
        (0x15, 0, 3, port),  # jeq PORT
        (0x50, 0, 0, 27),  # ldb [x+27]          TCP flags
        (0x54, 0, 0, 0x12),  # and SYN|ACK
        (0x15, 1, 0, 0x02),  # jeq SYN -> accept
        (0x06, 0, 0, 0),  # drop
        (0x06, 0, 0, 0x40000),  # accept
    ]
    return b"".join(struct.pack("HBBI", *i) for i in ins)


class SynCounter:
    """``start()``, then ``times`` holds the monotonic time of each SYN to ``port`` and
    ``sources`` (same order) the source address it came from (all of ``127.0.0.0/8`` is
    loopback: a client bound to ``127.0.0.2`` is told apart); ``stop()``. ``error`` is set (and
    nothing counted) where a raw socket is not allowed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.times: list[float] = []
        self.sources: list[str] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self) -> SynCounter:
        try:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            prog = _filter(self.port)
            import ctypes

            cbuf = ctypes.create_string_buffer(prog)
            fprog = struct.pack("HL", len(prog) // 8, ctypes.addressof(cbuf))
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            sock.bind(("lo", 0))
            # drain what arrived before the filter was attached
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    sock.recv(65536)
            self._keep = cbuf
        except (OSError, AttributeError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return self
        self._sock = sock
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sock], [], [], 0.1)
            if not ready:
                continue
            with contextlib.suppress(BlockingIOError):
                while True:
                    data, addr = self._sock.recvfrom(128)
                    if addr[2] != PACKET_OUTGOING and self._is_syn(data):
                        self.times.append(time.monotonic())
                        self.sources.append(socket.inet_ntoa(data[26:30]))

    def _is_syn(self, data: bytes) -> bool:
        # the kernel filter already matched; re-check in case it let something else through
        if len(data) < 34 or data[12:14] != b"\x08\x00" or data[23] != 6:
            return False
        ihl = (data[14] & 0x0F) * 4
        off = 14 + ihl
        if len(data) < off + 14:
            return False
        dport = int.from_bytes(data[off + 2 : off + 4], "big")
        return dport == self.port and data[off + 13] & 0x12 == 0x02

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self._sock is not None:
            self._sock.close()
