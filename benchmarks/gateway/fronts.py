"""What the gateway benchmark puts in front of the engines, one small class per kind: a front
starts (given the engines' URLs), has ``urls`` for the client, ``pids`` whose CPU and memory
are its own, and stops.

* :class:`Direct`: no front; the client round-robins over the engines itself.
* :class:`SGLangRouter`, :class:`VLLMRouter`: ``sglang-router`` 0.3.2 and ``vllm-router``
  0.1.17 from ``.venv-routers`` (``make routers``), round-robin policy, their other settings
  at their defaults; each also drives its router's worker API (``add_worker`` /
  ``remove_worker``, the routes and bodies each release answers to).
* :class:`Proxy`: a candidate server stack for the gateway (``benchmarks/gateway/proxy_*.py``).
* :class:`Gateway`: rollsafe's gateway (issue #35); a slot until it exists.

Process helpers (``spawn``, ``cpu_seconds``, ``rss_bytes``) live here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROUTERS_PYTHON = ROOT / ".venv-routers" / "bin" / "python"
NOFILE = 65536


class FrontUnavailable(RuntimeError):
    """The front cannot run here (the reason is the message)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raise_nofile() -> None:
    """The soft limit on open files up to the hard one (raising the hard one needs privileges
    a container may not have)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def raise_own_nofile() -> None:
    """Let this process hold many sockets (10,000 streams: the client's side)."""
    _raise_nofile()


def spawn(
    cmd: list[str], log: Path, ready_prefix: str | None, timeout: float = 60.0, env: Any = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start ``cmd`` in its own session (stderr to ``log``); with ``ready_prefix``, wait for that
    line on stdout and return its JSON."""
    logf = log.open("w")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE if ready_prefix else logf,
        stderr=logf,
        text=True,
        start_new_session=True,
        preexec_fn=_raise_nofile,
        env=env,
        cwd=str(ROOT),
    )
    logf.close()
    if ready_prefix is None:
        return proc, {}
    assert proc.stdout is not None
    got: dict[str, Any] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(ready_prefix):
                got.update(json.loads(line[len(ready_prefix) :]))
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not got:
        kill_group(proc)
        raise FrontUnavailable(f"{cmd[:3]} not ready in {timeout} s: {tail(log)}")
    return proc, got


def tail(path: Path, n: int = 800) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


def kill_group(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (each process's own, not its reaped children)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def http(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, str]:
    """One small HTTP call (status, text); connection errors are status 0."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


class Front:
    """A front: ``start(engine_urls)``, ``urls``, ``pids``, ``stop()``."""

    name = "front"
    #: the APIs it is measured with
    apis: tuple[str, ...] = ("generate", "completions")

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, engine_urls: list[str]) -> None:
        raise NotImplementedError

    @property
    def urls(self) -> list[str]:
        return [self.url]

    @property
    def pids(self) -> list[int]:
        return descendants(self.proc.pid) if self.proc is not None else []

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc, signal.SIGTERM)
            kill_group(self.proc)
            self.proc = None


class Direct(Front):
    name = "direct"

    def start(self, engine_urls: list[str]) -> None:
        self._urls = list(engine_urls)

    @property
    def urls(self) -> list[str]:
        return self._urls

    @property
    def pids(self) -> list[int]:
        return []


class Router(Front):
    """A Rust router from ``.venv-routers``; ready once every worker is listed healthy."""

    module = ""
    log_level = "error"

    def command(self, port: int, engine_urls: list[str]) -> list[str]:
        return [
            str(ROUTERS_PYTHON),
            "-m",
            self.module,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *engine_urls,
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            self.log_level,
        ]

    def start(self, engine_urls: list[str]) -> None:
        if not ROUTERS_PYTHON.exists():
            raise FrontUnavailable(f"{ROUTERS_PYTHON} missing: run `make routers`")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc, _ = spawn(
            self.command(port, engine_urls), self.log_dir / f"{self.name}.log", None
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FrontUnavailable(
                    f"{self.name} exited: {tail(self.log_dir / f'{self.name}.log')}"
                )
            if sorted(self.healthy_workers()) == sorted(engine_urls):
                return
            time.sleep(0.2)
        self.stop()
        raise FrontUnavailable(f"{self.name}: workers not all healthy in 60 s")

    def workers(self) -> list[dict[str, Any]]:
        status, text = http("GET", self.url + "/workers")
        if status != 200:
            return []
        return list(json.loads(text).get("workers", []))

    def healthy_workers(self) -> list[str]:
        return [w["url"] for w in self.workers() if w.get("is_healthy")]

    def add_worker(self, url: str) -> dict[str, Any]:
        raise NotImplementedError

    def remove_worker(self, url: str) -> dict[str, Any]:
        raise NotImplementedError


class SGLangRouter(Router):
    """sglang-router 0.3.2. Worker API: ``POST /workers {"url": URL}`` answers 202 with a
    ``worker_id`` (a UUID; the worker is added by a background job), ``DELETE
    /workers/{worker_id}`` answers 202 (removed by a background job), ``GET /workers`` lists
    ``{"id", "url", "is_healthy", ...}``; the older ``/add_worker``, ``/remove_worker`` and
    ``/list_workers`` routes answer 404."""

    name = "sglang-router"
    module = "sglang_router.launch_router"
    apis = ("generate",)

    def add_worker(self, url: str) -> dict[str, Any]:
        status, text = http("POST", self.url + "/workers", {"url": url})
        return {"call": 'POST /workers {"url": URL}', "status": status, "answer": text[:300]}

    def remove_worker(self, url: str) -> dict[str, Any]:
        ids = [w["id"] for w in self.workers() if w["url"] == url]
        if not ids:
            return {"call": "DELETE /workers/{worker_id}", "status": None, "answer": "not listed"}
        status, text = http("DELETE", self.url + "/workers/" + ids[0])
        return {"call": "DELETE /workers/{worker_id}", "status": status, "answer": text[:300]}


class VLLMRouter(Router):
    """vllm-router 0.1.17. Worker API: ``POST /add_worker?url=URL`` and ``POST
    /remove_worker?url=URL`` (200, plain text, done when answered), ``GET /list_workers``
    (``{"urls": [...]}``); also ``POST /workers {"url": URL}`` and ``DELETE
    /workers/{url-encoded URL}`` (200, JSON ``{"success": true, ...}``)."""

    name = "vllm-router"
    module = "vllm_router.launch_router"
    apis = ("completions",)

    def add_worker(self, url: str) -> dict[str, Any]:
        q = urllib.parse.urlencode({"url": url})
        status, text = http("POST", f"{self.url}/add_worker?{q}")
        return {"call": "POST /add_worker?url=URL", "status": status, "answer": text[:300]}

    def remove_worker(self, url: str) -> dict[str, Any]:
        q = urllib.parse.urlencode({"url": url})
        status, text = http("POST", f"{self.url}/remove_worker?{q}")
        return {"call": "POST /remove_worker?url=URL", "status": status, "answer": text[:300]}


class Proxy(Front):
    """A candidate server stack: ``benchmarks/gateway/proxy_<stack>.py --upstream URL ...``
    prints ``PROXY_READY {"url": ...}``. Measured with ``/generate`` only (a proxy does not
    look at the route)."""

    apis = ("generate",)

    def __init__(
        self, log_dir: Path, stack: str, python: str, extra: list[str] | None = None
    ) -> None:
        super().__init__(log_dir)
        self.stack = stack
        self.python = python
        self.extra = extra or []
        self.name = f"proxy-{stack}" + "".join(f"-{e.strip('-')}" for e in self.extra)

    def start(self, engine_urls: list[str]) -> None:
        script = HERE / f"proxy_{self.stack.split('-')[0]}.py"
        cmd = [self.python, str(script), *self.extra]
        for u in engine_urls:
            cmd += ["--upstream", u]
        self.proc, ready = spawn(cmd, self.log_dir / f"{self.name}.log", "PROXY_READY ")
        self.url = ready["url"]


class Gateway(Front):
    """rollsafe's gateway (issue #35): not built yet. To fill the slot, ``start`` launches a
    process serving the gateway in front of ``engine_urls`` (both APIs), sets ``self.proc``
    (its CPU and memory are the front's: the whole process tree is counted) and ``self.url``;
    ``stop`` is inherited. The benchmark then measures it in every phase and checks issue #35's
    targets (``bench_gateway.gateway_targets``)."""

    name = "gateway"

    def start(self, engine_urls: list[str]) -> None:
        raise FrontUnavailable(
            "rollsafe's gateway is not built yet (issue #35): this slot is empty"
        )


def make_front(name: str, log_dir: Path, proxy_python: str = sys.executable) -> Front:
    """The front called ``name`` (see :data:`FRONT_NAMES`)."""
    if name == "direct":
        return Direct(log_dir)
    if name == "sglang-router":
        return SGLangRouter(log_dir)
    if name == "vllm-router":
        return VLLMRouter(log_dir)
    if name == "gateway":
        return Gateway(log_dir)
    if name.startswith("proxy-"):
        stack = name.removeprefix("proxy-")
        extra = ["--uvloop"] if stack.endswith("-uvloop") else []
        return Proxy(log_dir, stack.removesuffix("-uvloop"), proxy_python, extra)
    raise ValueError(name)


FRONT_NAMES = (
    "direct",
    "sglang-router",
    "vllm-router",
    "gateway",
    "proxy-aiohttp",
    "proxy-aiohttp-uvloop",
    "proxy-starlette",
    "proxy-raw",
)
