"""The soak's ``port_blackhole`` (``benchmarks/soakparts/blackhole.py``, issue #36 item 1): a
black-holed port drops every packet both ways, for real, and nothing else.

Each test runs its steps in a child process on a network namespace of its own (``unshare
--net``), so the ``lo`` it changes is not the one the rest of the suite talks over. The child
reports what it saw as JSON; the test asserts. The ``tc`` way is the one this machine has
(iptables is not installed here); the iptables way is tested where it is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

PARTS = Path(__file__).resolve().parents[1] / "benchmarks" / "soakparts"

#: the child's common part: lo up, echo servers, and probes that say what a connection did
PRELUDE = textwrap.dedent(
    """
    import json, socket, subprocess, sys, threading, time
    sys.path.insert(0, PARTS)
    import blackhole

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

    def echo_server():
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)

        def serve(conn):
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

        def accept():
            while True:
                conn, _ = srv.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return srv.getsockname()[1]

    def connects(port, timeout=1.0):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=timeout).close()
            return True
        except OSError:
            return False

    def echoes(sock, word, timeout):
        sock.settimeout(timeout)
        sock.sendall(word)
        try:
            return sock.recv(4096) == word
        except OSError:
            return False

    def root_qdisc():
        out = subprocess.run(["tc", "qdisc", "show", "dev", "lo", "root"], capture_output=True,
                             text=True, check=True)
        return out.stdout.split()[1]

    seen = {}
    """
)


def _in_own_netns(body: str) -> dict[str, Any]:
    script = f"PARTS = {str(PARTS)!r}\n" + PRELUDE + textwrap.dedent(body)
    script += "\nprint(json.dumps(seen))\n"
    out = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return seen


needs_root_tools = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("tc", "unshare", "ip")),
    reason="the black hole needs root, tc, ip and unshare (a network namespace of the test's own)",
)


@needs_root_tools
def test_the_tc_way_drops_both_directions_of_one_port_and_nothing_else() -> None:
    seen = _in_own_netns(
        """
        held, other = echo_server(), echo_server()
        live = socket.create_connection(("127.0.0.1", held), timeout=2)
        seen["before"] = [connects(held), echoes(live, b"a", 2), root_qdisc()]
        hole = blackhole.Blackhole("tc")
        hole.block(held)
        seen["blocked"] = sorted(hole.blocked)
        seen["during"] = [connects(held), echoes(live, b"b", 1.5), connects(other), root_qdisc()]
        hole.unblock(held)
        # the held byte goes through on TCP's retransmission once the hole is lifted
        live.settimeout(30)
        seen["late"] = live.recv(4096).decode()
        seen["after"] = [connects(held), echoes(live, b"c", 2), root_qdisc()]
        hole.close()
        """
    )
    assert seen["before"] == [True, True, "noqueue"]
    assert seen["blocked"] == [seen["blocked"][0]]
    # a new connection hangs, the established one stops moving, another port is untouched
    assert seen["during"] == [False, False, True, "htb"]
    assert seen["late"] == "b"
    # lifted: everything moves again and lo is as it was
    assert seen["after"] == [True, True, "noqueue"]


@needs_root_tools
def test_two_holders_share_the_tc_qdisc_and_the_last_one_out_removes_it() -> None:
    seen = _in_own_netns(
        """
        p1, p2 = echo_server(), echo_server()
        first, second = blackhole.Blackhole("tc"), blackhole.Blackhole("tc")
        first.block(p1)
        second.block(p2)
        seen["both"] = [connects(p1), connects(p2)]
        first.close()
        seen["one_left"] = [connects(p1), connects(p2), root_qdisc()]
        second.unblock(p2)
        seen["none"] = [connects(p1), connects(p2), root_qdisc()]
        """
    )
    assert seen["both"] == [False, False]
    assert seen["one_left"] == [True, False, "htb"]
    assert seen["none"] == [True, True, "noqueue"]


@needs_root_tools
def test_a_root_qdisc_that_is_not_the_black_holes_is_refused_and_kept() -> None:
    seen = _in_own_netns(
        """
        port = echo_server()
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "pfifo"], check=True)
        hole = blackhole.Blackhole("tc")
        try:
            hole.block(port)
            seen["error"] = None
        except OSError as exc:
            seen["error"] = str(exc)
        seen["after"] = [sorted(hole.blocked), connects(port), root_qdisc()]
        """
    )
    assert seen["error"] is not None
    assert "lo has a root qdisc that is not the black hole's" in seen["error"]
    assert "pfifo" in seen["error"]
    assert seen["after"] == [[], True, "pfifo"]


@needs_root_tools
def test_a_holder_killed_outright_leaves_no_port_black_holed() -> None:
    """The holder is SIGKILLed with the port blocked (no atexit, no close): its warden lifts
    the block and removes the qdisc, and exits."""
    seen = _in_own_netns(
        """
        import os, signal
        port = echo_server()
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, time; sys.path.insert(0, %r); import blackhole; "
             "h = blackhole.Blackhole('tc'); h.block(%d); print(h._warden.pid, flush=True); "
             "time.sleep(600)" % (PARTS, port)],
            stdout=subprocess.PIPE, text=True)
        warden = int(holder.stdout.readline())
        seen["during"] = [connects(port), root_qdisc()]
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not connects(port, 0.5):
            time.sleep(0.1)
        seen["after"] = [connects(port), root_qdisc()]
        while time.monotonic() < deadline and os.path.exists(f"/proc/{warden}"):
            time.sleep(0.1)
        seen["warden_left"] = os.path.exists(f"/proc/{warden}")
        """
    )
    assert seen["during"] == [False, "htb"]
    assert seen["after"] == [True, "noqueue"]
    assert seen["warden_left"] is False


@needs_root_tools
def test_a_hole_ends_with_the_process_that_owned_the_port() -> None:
    """A port blocked with an ``owner`` stays blocked while the owner runs (a second port's
    owner lives on); once the owner is killed the hole is lifted and said why, so the freed
    number, bound again by a new server, is reachable; a bad owner is refused, nothing blocked."""
    seen = _in_own_netns(
        """
        import signal
        SERVE = (
            "import socket, sys, time; s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8); "
            "print(s.getsockname()[1], flush=True); time.sleep(600)"
        )

        def server(port=0):
            p = subprocess.Popen([sys.executable, "-c", SERVE, str(port)],
                                 stdout=subprocess.PIPE, text=True)
            return p, int(p.stdout.readline())

        owner, port = server()
        keeper, kept = server()
        hole = blackhole.Blackhole("tc")
        heard = []
        hole.block(port, owner=owner.pid, on_owner_exit=heard.append)
        hole.block(kept, owner=keeper.pid)
        time.sleep(5 * blackhole.OWNER_POLL_S)  # several looks at two live owners
        seen["owners_alive"] = [sorted(hole.blocked) == sorted([port, kept]),
                                connects(port), connects(kept)]
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 30
        # lifted, then said (the callback runs once the hole's lock is released)
        while time.monotonic() < deadline and (port in hole.blocked or not heard):
            time.sleep(0.05)
        again, _ = server(port)  # the freed number, bound by someone else
        seen["after"] = [sorted(hole.blocked) == [kept], connects(port), connects(kept), heard]
        seen["unblock_after"] = hole.unblock(port)
        try:
            hole.block(kept + 1, owner=owner.pid)
            seen["gone_owner"] = None
        except ProcessLookupError as exc:
            seen["gone_owner"] = str(exc)
        seen["still"] = sorted(hole.blocked) == [kept]
        hole.close()
        seen["closed"] = [connects(kept), root_qdisc(), hole.blocked == set()]
        for p in (again, keeper):
            p.kill()
        """
    )
    assert seen["owners_alive"] == [True, False, False]
    pid_said = seen["after"][3]
    assert seen["after"][:3] == [True, True, False]
    assert len(pid_said) == 1 and pid_said[0].startswith("its owner (pid ")
    assert pid_said[0].endswith(") exited")
    assert seen["unblock_after"] is False  # the hole was lifted already
    assert seen["gone_owner"] is not None and "is not running" in seen["gone_owner"]
    assert seen["still"] is True
    assert seen["closed"] == [True, "noqueue", True]


@needs_root_tools
def test_the_way_chosen_here_is_named_and_works() -> None:
    seen = _in_own_netns(
        """
        how, why = blackhole.method()
        seen["how"], seen["why"], seen["available"] = how, why, blackhole.available()
        port = echo_server()
        hole = blackhole.Blackhole()
        seen["chosen"] = hole.how
        hole.block(port)
        seen["during"] = connects(port)
        hole.close()
        seen["after"] = connects(port)
        """
    )
    assert seen["how"] in ("iptables", "tc"), seen["why"]
    assert seen["available"] is None
    assert seen["chosen"] == seen["how"]
    assert (seen["during"], seen["after"]) == (False, True)
    if shutil.which("iptables") is None:
        assert seen["how"] == "tc"


def test_an_unknown_way_is_refused_by_name() -> None:
    sys.path.insert(0, str(PARTS))
    try:
        import blackhole
    finally:
        sys.path.remove(str(PARTS))
    with pytest.raises(ValueError, match="how='nft'"):
        blackhole.Blackhole("nft")
