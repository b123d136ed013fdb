"""What the gateway benchmark puts in front of the engines, one small class per kind: a front
starts (given the engines' URLs), has ``urls`` for the client, ``pids`` whose CPU and memory
are its own, and stops.

* :class:`Direct`: no front; the client round-robins over the engines itself.
* :class:`SGLangRouter`, :class:`VLLMRouter`: ``sglang-router`` 0.3.2 and ``vllm-router``
  0.1.17 from ``.venv-routers`` (``make routers``), round-robin policy, their other settings
  at their defaults; each also drives its router's worker API (``add_worker`` /
  ``remove_worker``, the routes and bodies each release answers to).
* :class:`Proxy`: a candidate server stack for the gateway (``benchmarks/gateway/proxy_*.py``).
* :class:`Gateway`: rollsafe's gateway (issue #35): ``gateway_front.py`` in a process of its
  own.

Process helpers (``spawn``, ``cpu_seconds``, ``rss_bytes``, ``open_fds``) live here too.
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


#: the CPUs the fronts spawned from here run on (None: every CPU); the benchmark sets it for
#: its reference-engine phase, whose engines run on the others (``bench_gateway --reference-cpus``)
FRONT_CPUS: set[int] | None = None


def _child_setup(cpus: set[int] | None) -> Any:
    """The spawned child's set-up before it runs: the open-files limit raised, and pinned to
    ``cpus`` (every thread and process it starts inherits them)."""

    def setup() -> None:
        _raise_nofile()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def raise_own_nofile() -> None:
    """Let this process hold many sockets (10,000 streams: the client's side)."""
    _raise_nofile()


def spawn(
    cmd: list[str],
    log: Path,
    ready_prefix: str | None,
    timeout: float = 60.0,
    env: Any = None,
    cpus: set[int] | None = None,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start ``cmd`` in its own session (stderr to ``log``), on ``cpus`` (default:
    :data:`FRONT_CPUS`); with ``ready_prefix``, wait for that line on stdout and return its
    JSON."""
    logf = log.open("w")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE if ready_prefix else logf,
        stderr=logf,
        text=True,
        start_new_session=True,
        preexec_fn=_child_setup(cpus if cpus is not None else FRONT_CPUS),
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


def open_fds(pids: list[int]) -> int:
    """Open file descriptors of ``pids`` (sockets included)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/fd"))
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
    """rollsafe's gateway (issue #35): ``benchmarks/gateway/gateway_front.py``, a process of its
    own (its CPU and memory are the front's) building what ``RolloutFleet`` builds around running
    engines: one registry group per engine URL with the real client of ``dialect``, the router,
    the data plane, the health manager's probes and request health, and
    ``rollsafe.gateway.app.Gateway`` on uvloop. Serves both APIs whatever the engines' dialect
    (the gateway sends token ids in the engines' own dialect). ``model_path``: the tokenizer's
    model (None: a tiny model made once in ``log_dir``, whose token id 7 is the stub's, with a
    context long enough for the open-streams phase: the stub has none). ``profile``: cProfile
    the serving loop into ``<log_dir>/gateway-<n>.prof`` (listed in ``profiles``). Started, it
    has answered one request (warm, as a router is once its workers are healthy). After
    ``stop``, ``last_stats`` holds the router's, the request health's and the gateway's
    counters and the groups' states. ``root``: run the gateway of another checkout of rollsafe
    (its ``gateway_front.py`` and package; default this one), for a before/after comparison."""

    name = "gateway"

    def __init__(
        self,
        log_dir: Path,
        dialect: str = "sglang",
        model_path: Path | None = None,
        profile: bool = False,
        root: Path | None = None,
    ) -> None:
        super().__init__(log_dir)
        self.root = ROOT if root is None else Path(root)
        self.dialect = dialect
        self.model_path = model_path
        self.profile = profile
        self.last_stats: dict[str, Any] = {}
        self.profiles: list[Path] = []
        self._stats_path: Path | None = None
        self._runs = 0

    def stub_model(self) -> Path:
        """The stub's tokenizer model (made once per ``log_dir``)."""
        path = self.log_dir / "gateway-stub-model"
        if not (path / "config.json").exists():
            from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

            make_tiny_model(path, seed=0, max_position_embeddings=1 << 20)
        return path

    def start(self, engine_urls: list[str]) -> None:
        model = self.model_path if self.model_path is not None else self.stub_model()
        self._runs += 1
        self._stats_path = self.log_dir / f"gateway-{self._runs}.stats.json"
        script = self.root / "benchmarks" / "gateway" / "gateway_front.py"
        cmd = [sys.executable, str(script), "--dialect", self.dialect]
        cmd += ["--model-path", str(model), "--stats", str(self._stats_path)]
        if self.profile:
            prof = self.log_dir / f"gateway-{self._runs}.prof"
            self.profiles.append(prof)
            cmd += ["--profile", str(prof)]
        for u in engine_urls:
            cmd += ["--upstream", u]
        env = dict(os.environ)
        paths = (str(self.root), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.proc, ready = spawn(
            cmd, self.log_dir / f"gateway-{self._runs}.log", "GATEWAY_READY ", 120, env
        )
        self.url = ready["url"]
        # warm, as a router is once its workers are healthy: the data plane opens its engine
        # session (and imports the async client) on its first request, not in a measured run
        path, body = (
            ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
            if self.dialect == "sglang"
            else ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
        )
        status, text = http("POST", self.url + path, body, timeout=60)
        if status != 200:
            self.stop()
            raise FrontUnavailable(f"gateway: warm-up request answered {status}: {text[:300]}")

    def stop(self) -> None:
        """SIGTERM (it writes its counters and profile), then what ``Front.stop`` does."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        super().stop()
        if self._stats_path is not None and self._stats_path.exists():
            with contextlib.suppress(ValueError, OSError):
                self.last_stats = json.loads(self._stats_path.read_text())


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
