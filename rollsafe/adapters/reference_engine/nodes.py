"""The engine's ranks on several nodes: ``--nnodes N --node-rank R --dist-init-addr HOST:PORT``.

Owns the multi-node form of the reference engine, shaped like SGLang's (``--nnodes``,
``--node-rank``, ``--dist-init-addr``; ``--ranks`` is the whole group's, as SGLang's
``--tp-size``): node rank 0, the **head**, serves HTTP and runs ranks ``0..k-1`` (``k = ranks //
nnodes``); node rank ``R`` > 0 runs ranks ``R*k..R*k+k-1`` and no server. Their ranks are one
rank group across the nodes, driven by rank 0 exactly as on one node (:mod:`.ranks`):

* the head listens on ``--dist-init-addr`` (:class:`NodeListener`, a ``multiprocessing``
  listener with an authentication key, opened before its own load) and accepts, from every
  other node, one connection per rank (each rank's control channel, the protocol of
  :mod:`.bootstrap` over a socket instead of a pipe) and one **node link** from the node's own
  process (:func:`slice_main`); the rank group's ``TCPStore`` then listens on the head's address
  and each rank's gloo device is its interface towards the head (:func:`local_address`);
* a node's process spawns its ranks, connects its link (retrying until the head listens or the
  start timeout passes), prints its ready line once the head accepted it, and then watches: one
  of its ranks dying is reported over the link (``("died", rank, exitcode)``) and ends the node's
  process; the link closing (the head gone or stopping) ends it too, with its ranks;
* at the head, a remote rank is a :class:`RemoteRank` whose liveness is its node's link: a
  node lost (its process killed, its machine gone) fails the whole engine at once, as a dead
  local rank does, never after a collective's timeout.

The key is ``ROLLSAFE_DIST_INIT_KEY`` (the launcher sets one per group for all its slices); an
address that is not loopback without one is refused (anyone reaching it could drive the ranks).
Real engines have no such key; this one is a reference engine's, and rollsafe's launcher keeps it
off the command line.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollsafe.adapters.reference_engine.bootstrap import RankChild, RankOptions, die_with_parent
from rollsafe.adapters.reference_engine.errors import RankFailure, StartupError
from rollsafe.net import is_loopback

__all__ = [
    "DIST_KEY_ENV",
    "NodeLink",
    "NodeListener",
    "RemoteRank",
    "dist_key",
    "local_address",
    "node_ranks",
    "parse_dist_init_addr",
    "slice_main",
]

#: the environment variable holding the key every node of one group shares
DIST_KEY_ENV = "ROLLSAFE_DIST_INIT_KEY"
#: the key of a loopback address when none is set (any local user may reach it anyway)
_LOOPBACK_KEY = b"rollsafe-dist-init-loopback"
#: how often a node retries connecting to the head while it is not listening yet
_RETRY_S = 0.2
#: how long the head waits for a connection's hello (sent right after connecting)
_HELLO_S = 10.0


def parse_dist_init_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as ``(host, port)``; :class:`StartupError` naming the
    flag otherwise."""
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise StartupError(f"--dist-init-addr must be HOST:PORT (port 1..65535), got {text!r}")
    return host, int(port)


def dist_key(host: str, environ: Any = None) -> bytes:
    """The group's key: :data:`DIST_KEY_ENV`, or the loopback key on a loopback ``host``;
    :class:`StartupError` for another address without one."""
    env = os.environ if environ is None else environ
    key = env.get(DIST_KEY_ENV, "")
    if key:
        return str(key).encode()
    if is_loopback(host):
        return _LOOPBACK_KEY
    raise StartupError(
        f"--dist-init-addr {host} is not a loopback address and ${DIST_KEY_ENV} is not set: "
        "anyone who can reach it could drive the engine's ranks"
    )


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The ranks node ``node_rank`` of ``nnodes`` runs (``world_size // nnodes`` each)."""
    per_node = world_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (the head): what a rank's gloo device
    binds, so the head's ranks reach it (loopback for a loopback head)."""
    if is_loopback(host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: no packet is sent, only the route is chosen
        return str(probe.getsockname()[0])


def _connect(address: tuple[str, int], key: bytes, deadline: float) -> Any:
    """A connection to the head, retried while it does not listen yet, until ``deadline``."""
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            return mpc.Client(address, authkey=key)
        except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError) as exc:
            last = exc
            time.sleep(_RETRY_S)
    raise StartupError(
        f"the head at {address[0]}:{address[1]} did not accept this node within the start "
        f"timeout: {last!r}"
    )


# ------------------------------------------------------------------------------------- head
@dataclass
class NodeLink:
    """The head's end of one other node's link: closed (or a message on it) means the node is
    gone; ``reason`` says how."""

    node_rank: int
    conn: Any
    pids: dict[int, int] = field(default_factory=dict)
    reason: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sentinel(self) -> int:
        return int(self.conn.fileno())

    def alive(self) -> bool:
        with self._lock:
            if self.reason is not None:
                return False
            try:
                if not self.conn.poll(0):
                    return True
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.reason = f"node {self.node_rank} lost (its link to the head closed)"
                return False
            if isinstance(msg, tuple) and msg and msg[0] == "died":
                self.reason = f"rank {msg[1]} on node {self.node_rank} exited with code {msg[2]}"
            else:
                self.reason = f"node {self.node_rank} reported {msg!r}"
            return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("shutdown",))
        with contextlib.suppress(Exception):
            self.conn.close()


class RemoteRank:
    """A rank on another node, as rank 0's :class:`~.ranks.RankSet` sees a child process: its
    ``pid`` (on its node), alive while its node's link is, ``sentinel`` the link's socket."""

    def __init__(self, rank: int, pid: int, link: NodeLink) -> None:
        self.rank = rank
        self.pid = pid
        self.link = link

    @property
    def sentinel(self) -> int:
        return self.link.sentinel

    @property
    def exitcode(self) -> int | None:
        """Not known at the head (its node reports a death in :attr:`NodeLink.reason`)."""
        return None

    def is_alive(self) -> bool:
        return self.link.alive()

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 0.0)
        while self.link.alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def kill(self) -> None:
        self.link.close()


class NodeListener:
    """The head's listener on ``--dist-init-addr``: accepts the other nodes' ranks and links on
    a thread of its own from :meth:`open` on (before the head loads), and hands them over as
    :class:`~.bootstrap.RankChild` s (:meth:`children`) once every one arrived."""

    def __init__(self, opts: RankOptions, host: str, port: int, key: bytes) -> None:
        self.opts = opts
        self.address = (host, port)
        self._key = key
        self._listener: Any = None
        self._lock = threading.Lock()
        self._ranks: dict[int, tuple[int, Any]] = {}  # rank -> (pid, conn)
        self._links: dict[int, NodeLink] = {}
        self._problem: str | None = None
        self._closed = False
        self._arrived = threading.Condition(self._lock)

    @property
    def expected_ranks(self) -> list[int]:
        per_node = self.opts.world_size // self.opts.nnodes
        return list(range(per_node, self.opts.world_size))

    def open(self) -> NodeListener:
        try:
            self._listener = mpc.Listener(self.address, family="AF_INET", authkey=self._key)
        except OSError as exc:
            raise StartupError(
                f"--dist-init-addr {self.address[0]}:{self.address[1]}: cannot listen: {exc}"
            ) from exc
        threading.Thread(target=self._accept, name="dist-init-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        expected = set(self.expected_ranks)
        nodes = set(range(1, self.opts.nnodes))
        while True:
            with self._lock:
                if self._closed or (expected <= set(self._ranks) and nodes <= set(self._links)):
                    return
            try:
                conn = self._listener.accept()
                if not conn.poll(_HELLO_S):  # a silent peer never holds the listener
                    conn.close()
                    continue
                hello = conn.recv()
            except (OSError, EOFError, mp.AuthenticationError) as exc:
                with self._lock:
                    if self._closed:
                        return
                print(f"rollsafe engine: refused a node connection: {exc!r}", file=sys.stderr)
                continue
            with self._arrived:
                problem = self._take(hello, conn, expected, nodes)
                if problem is not None:
                    self._problem = problem
                self._arrived.notify_all()

    def _take(self, hello: Any, conn: Any, expected: set[int], nodes: set[int]) -> str | None:
        """Record one arrival (caller holds the lock); a malformed or duplicate one is a
        problem that fails the start, naming it."""
        if not isinstance(hello, tuple) or len(hello) != 3:
            conn.close()
            return f"a node sent {hello!r} instead of its hello"
        kind, which, pid = hello
        if kind == "rank" and which in expected and which not in self._ranks:
            self._ranks[which] = (int(pid), conn)
            return None
        if kind == "node" and which in nodes and which not in self._links:
            self._links[which] = NodeLink(which, conn, dict(pid))
            conn.send(("welcome",))
            return None
        conn.close()
        return f"unexpected {kind} {which!r} at the head (a second one, or out of range)"

    def children(self, deadline: float) -> list[RankChild]:
        """Every other node's ranks once all arrived, in rank order; :class:`RankFailure`
        naming what is missing at ``deadline``."""
        per_node = self.opts.world_size // self.opts.nnodes
        nodes = set(range(1, self.opts.nnodes))
        with self._arrived:
            while True:
                if self._problem is not None:
                    raise RankFailure(self._problem)
                missing = [r for r in self.expected_ranks if r not in self._ranks]
                lost = sorted(nodes - set(self._links))
                if not missing and not lost:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankFailure(
                        f"node(s) {lost or sorted({r // per_node for r in missing})} did not "
                        f"join the head at {self.address[0]}:{self.address[1]} within the "
                        f"start timeout (ranks missing: {missing})"
                    )
                self._arrived.wait(min(left, 0.2))
            out = []
            for rank in self.expected_ranks:
                pid, conn = self._ranks[rank]
                link = self._links[rank // per_node]
                out.append(RankChild(rank, RemoteRank(rank, pid, link), conn))
            return out

    def links(self) -> list[NodeLink]:
        with self._lock:
            return list(self._links.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
            ranks = [conn for _, conn in self._ranks.values()]
        for link in links:
            link.close()
        for conn in ranks:
            with contextlib.suppress(Exception):
                conn.close()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                self._listener.close()


# ------------------------------------------------------------------------------- other nodes
def remote_rank_entry(
    rank: int, opts: RankOptions, address: tuple[str, int], key: bytes, parent_pid: int
) -> None:
    """A rank on a node other than the head's: connect its control channel to the head, then
    live as every rank does (:func:`~.ranks.child_main`)."""
    die_with_parent(parent_pid)
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.torch_threads()))
    deadline = time.monotonic() + opts.start_timeout_s
    try:
        conn = _connect(address, key, deadline)
        conn.send(("rank", rank, os.getpid()))
    except BaseException as exc:
        print(f"rollsafe engine: rank {rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    from rollsafe.adapters.reference_engine.ranks import child_main

    child_main(rank, opts, conn)


def slice_main(opts: RankOptions, address: tuple[str, int], key: bytes, method: str) -> int:
    """Node rank > 0: spawn this node's ranks, link to the head, print the ready line, watch
    (see the module). Returns the exit status: 0 when the head closed the link, 1 when a rank
    died or the head never accepted."""
    from rollsafe.wire.lines import READY_PREFIX

    ranks = node_ranks(opts.world_size, opts.nnodes, opts.node_rank)
    ctx: Any = mp.get_context(method)
    procs: dict[int, Any] = {}
    link: Any = None
    try:
        for r in ranks:
            p = ctx.Process(
                target=remote_rank_entry,
                args=(r, opts, address, key, os.getpid()),
                name=f"rollsafe-engine-rank{r}",
                daemon=True,
            )
            p.start()
            procs[r] = p
        deadline = time.monotonic() + opts.start_timeout_s
        link = _connect(address, key, deadline)
        link.send(("node", opts.node_rank, {r: int(p.pid) for r, p in procs.items()}))
        if not link.poll(max(0.1, deadline - time.monotonic())):
            raise StartupError("the head did not welcome this node within the start timeout")
        link.recv()
        ready = {
            "url": None,
            "pid": os.getpid(),
            "rank_pids": [int(p.pid) for p in procs.values()],
            "ranks": list(ranks),
            "node_rank": opts.node_rank,
            "nnodes": opts.nnodes,
            "head": f"{address[0]}:{address[1]}",
        }
        sys.stdout.write(f"{READY_PREFIX}{json.dumps(ready)}\n")
        sys.stdout.flush()
        return _watch_slice(procs, link)
    except BaseException as exc:
        print(f"rollsafe engine: node {opts.node_rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for p in procs.values():
            with contextlib.suppress(Exception):
                p.kill()
        if link is not None:
            with contextlib.suppress(Exception):
                link.close()


def _watch_slice(procs: dict[int, Any], link: Any) -> int:
    """Wait for a rank of this node to die (report it to the head: 1) or the head's link to
    close or say shutdown (0)."""
    by_sentinel = {p.sentinel: r for r, p in procs.items()}
    waitables: Sequence[Any] = [link, *by_sentinel]
    while True:
        ready = mpc.wait(waitables)
        if link in ready:
            return 0  # "shutdown" or EOF: the head stopped or is gone
        for s in ready:
            rank = by_sentinel[s]
            proc = procs[rank]
            proc.join(timeout=1)
            with contextlib.suppress(Exception):
                link.send(("died", rank, proc.exitcode))
            print(
                f"rollsafe engine: rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}",
                file=sys.stderr,
                flush=True,
            )
            return 1
