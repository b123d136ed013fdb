"""Start, probe and stop real reference-engine processes in tests (reusable by other suites).

``start_engine(model_dir, ranks=2, faults=True)`` spawns ``python -m
rollsafe.adapters.reference_engine`` in its own process group, waits for the ``ROLLSAFE_READY``
line and returns an :class:`EngineProcess`; ``stop()`` SIGKILLs the whole group (every rank).
Fixtures: ``tiny_model_dir`` / ``tiny_model_dir_b`` (two tiny Llamas, seeds 0 and 1, built once
per session) and ``engine_factory`` (starts engines and always cleans them up).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollsafe.digest_check import DigestCheck
from rollsafe.wire.lines import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[1]

#: this test process's engines' stderr files (removed when it exits: a test that needs one
#: reads it, or puts it in its failure, before then)
_STDERR_DIR = tempfile.mkdtemp(prefix="rollsafe-test-engine-stderr-")
atexit.register(shutil.rmtree, _STDERR_DIR, True)


class EngineStartError(RuntimeError):
    """The engine exited or did not print its ready line in time (message holds stderr)."""


@dataclass
class EngineProcess:
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    stderr_path: Path
    api_key: str | None = None
    _client: httpx.Client | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return str(self.ready["url"])

    @property
    def pid(self) -> int:
        return int(self.ready["pid"])

    @property
    def rank_pids(self) -> list[int]:
        return [int(p) for p in self.ready["rank_pids"]]

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.Client(base_url=self.url, timeout=60.0, headers=headers)
        return self._client

    def post(self, path: str, json_body: Any = None, **kw: Any) -> httpx.Response:
        return self.client.post(path, json=json_body, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(path, **kw)

    def post_once(self, path: str, json_body: Any = None, **kw: Any) -> httpx.Response:
        """POST on a connection of its own, closed afterwards: for a request that may be
        answered with a 5xx by a vLLM-dialect engine, which then drops the connection (a pooled
        one would fail the next request)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        kw.setdefault("timeout", 60.0)
        with httpx.Client(base_url=self.url, headers=headers) as client:
            return client.post(path, json=json_body, **kw)

    def checksum(self) -> dict[str, Any]:
        """``{"model", "tensors", "ranks", "algorithm", "weight_version"}`` from the engine's own
        checker.

        SGLang ``POST /weights_checker``: ``ranks``, each TP rank's ``checksums`` (SGLang's own
        fused names, that rank's shards); ``tensors``: rank 0's; ``model``: the engine's digest
        as the client reports it (:func:`rollsafe.checksum.sglang_engine_digest`). vLLM ``POST
        /weight_checker``: ``ranks``, each TP rank's ``{name: digest}``, prefixes stripped;
        ``tensors``: rank 0's; ``model``: :func:`rollsafe.checksum.model_digest`. Neither
        reports a version, so ``weight_version`` comes from ``/get_server_info``. Compare SGLang
        with :func:`sglang_digests` (never with HF-named digests), vLLM with
        :func:`assert_vllm_digests`.
        """
        from rollsafe.checksum import algorithm_for, model_digest, sglang_engine_digest

        info = self.get("/get_server_info")
        info.raise_for_status()
        server = info.json()
        ranks: list[dict[str, str]] = []
        if server["dialect"] == "vllm":
            r = self.post("/weight_checker", {"action": "checksum"})
            r.raise_for_status()
            for key, value in r.json()["checksums"].items():
                tp = int(key.split(":")[3].removeprefix("tp"))
                ranks.extend({} for _ in range(tp + 1 - len(ranks)))
                ranks[tp][key.split(":", 4)[4]] = value
            tensors = ranks[0]
            model = model_digest(tensors)
        else:
            r = self.post("/weights_checker", {"action": "checksum"})
            r.raise_for_status()
            infos = r.json()["ranks"]
            ranks = [dict(i["checksums"]) for i in infos]
            tensors = ranks[0]
            model = sglang_engine_digest([i["per_gpu_checksum"] for i in infos])
        return {
            "model": model,
            "tensors": tensors,
            "ranks": ranks,
            "algorithm": algorithm_for(server["dialect"], server["device"]),
            "weight_version": server["weight_version"],
        }

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return self.client.get("/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def stop(self) -> None:
        """SIGKILL the engine's process group (all ranks) and reap rank 0."""
        if self._client is not None:
            self._client.close()
            self._client = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def assert_vllm_digests(got: dict[str, Any], state: Mapping[str, Any]) -> DigestCheck:
    """A vLLM-dialect engine's checker (``EngineProcess.checksum()``) against the HF tensors
    ``state`` in vLLM's layout (fused, one shard per rank): no tensor differs, none is missing
    or unexpected, and, as on a real CPU vLLM, every linear weight is ``no_data`` and every
    other tensor ``equal`` (so the overall verdict is ``unverified``)."""
    from rollsafe.digest_check import compare_ranks
    from rollsafe.engine_layout import EngineLayout, vllm_cpu_emptied, vllm_rank_digests

    ranks = got["ranks"]
    config = {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2}
    layout = EngineLayout.from_config(config, tp_size=len(ranks))
    want = vllm_rank_digests(state, layout)
    check = compare_ranks(ranks, want)
    prefix = "tp{}:" if len(ranks) > 1 else ""
    names = [prefix.format(r) + n for r, digests in enumerate(want) for n in digests]
    assert check.names("no_data") == sorted(n for n in names if vllm_cpu_emptied(n)), check
    assert check.names("equal") == sorted(n for n in names if not vllm_cpu_emptied(n)), check
    assert check.verdict == "unverified", check.summary()
    return check


#: What :mod:`rollsafe.engine_layout` needs of the tests' tiny Llamas (``make_tiny_model``'s
#: defaults: 4 heads, 2 KV heads, untied embeddings).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def sglang_digests(
    state: Mapping[str, Any],
    ranks: int = 1,
    algorithm: str = "sglang-cpu",
    config: Any = None,
) -> dict[str, Any]:
    """What an SGLang-dialect engine of ``ranks`` TP ranks holding the HF tensors ``state``
    reports, in :meth:`EngineProcess.checksum`'s shape (``model``, ``tensors``: rank 0's,
    ``ranks``): SGLang's fused parameters per rank
    (:func:`rollsafe.fleet.weights_check.sglang_rank_digests`; ``config``: the model's HF config,
    a dict or a ``PretrainedConfig``, by default the tiny Llama's)."""
    from rollsafe.checksum import overall_checksum, sglang_engine_digest
    from rollsafe.fleet.weights_check import sglang_rank_digests

    per_rank = sglang_rank_digests(state, config or TINY_CONFIG, tp_size=ranks, algorithm=algorithm)
    return {
        "model": sglang_engine_digest([overall_checksum(r) for r in per_rank]),
        "tensors": per_rank[0],
        "ranks": per_rank,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; return the last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether every process in ``pids`` is gone (or a zombie) within ``timeout`` seconds."""
    return wait_for(lambda: not any(pid_alive(p) for p in pids), timeout)


def join_weight_group(
    engine: EngineProcess, *, world_size: int, group_name: str, timeout: float = 60
) -> Any:
    """Join a gloo weight-update group as rank 0 while the engine's ranks join it.

    The engine is asked (``/init_weights_update_group``, ``rank_offset`` 1) on a thread, since
    the call blocks until the test process joins too; returns the test's side of the group.
    """
    from rollsafe.wire.group import open_weight_update_group

    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world_size,
        "group_name": group_name,
        "backend": "gloo",
    }
    answer: dict[str, httpx.Response] = {}

    def init() -> None:
        answer["init"] = engine.post("/init_weights_update_group", body, timeout=timeout)

    thread = threading.Thread(target=init)
    thread.start()
    group = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=world_size,
        group_name=group_name,
        timeout_s=timeout,
    )
    thread.join(timeout)
    assert answer["init"].status_code == 200, answer["init"].text
    return group


def engine_command(
    model_dir: str | Path, *, ranks: int = 1, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollsafe.adapters.reference_engine",
        "--model-path",
        str(model_dir),
        "--ranks",
        str(ranks),
        *extra_args,
    ]


def repo_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with the repository first on ``PYTHONPATH``; what
    the path already held (e.g. wheels carried to a GPU host) stays after it."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def start_engine(
    model_dir: str | Path,
    *,
    ranks: int = 1,
    faults: bool = False,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> EngineProcess:
    """Spawn an engine and wait for its ready line; raise :class:`EngineStartError` otherwise."""
    full_env = repo_env({**os.environ, **(env or {})})
    full_env.pop("ROLLSAFE_FAULT_INJECTION", None)
    if faults:
        full_env["ROLLSAFE_FAULT_INJECTION"] = "1"
    args = list(extra_args) + (["--api-key", api_key] if api_key else [])
    err = Path(tempfile.mkstemp(prefix="engine-", suffix=".stderr", dir=_STDERR_DIR)[1])
    with err.open("w") as err_f:
        proc = subprocess.Popen(
            engine_command(model_dir, ranks=ranks, extra_args=args),
            stdout=subprocess.PIPE,
            stderr=err_f,
            text=True,
            env=full_env,
            start_new_session=True,
            cwd=str(REPO_ROOT),
        )
    assert proc.stdout is not None
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(READY_PREFIX):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    ready_lines = [ln for ln in lines if ln.startswith(READY_PREFIX)]
    if not ready_lines:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        raise EngineStartError(
            f"engine did not become ready (exit code {proc.returncode}):\n{err.read_text()}"
        )
    ready = json.loads(ready_lines[0][len(READY_PREFIX) :])
    return EngineProcess(proc, ready, err, api_key)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-b"), seed=1)


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., EngineProcess]]:
    """``engine_factory(model_dir, **start_engine kwargs)``; every engine is killed afterwards."""
    started: list[EngineProcess] = []

    def factory(model_dir: str | Path, **kw: Any) -> EngineProcess:
        eng = start_engine(model_dir, **kw)
        started.append(eng)
        return eng

    yield factory
    for eng in started:
        eng.stop()


def module_engine(request: pytest.FixtureRequest, model_dir: Path, **kw: Any) -> EngineProcess:
    """Start an engine that lives until the requesting (module-scoped) fixture is torn down."""
    eng = start_engine(model_dir, **kw)
    request.addfinalizer(eng.stop)
    return eng


def stall_groups(fleet: Any, after_tokens: int | None, groups: Sequence[str] | None = None) -> None:
    """Arm (``None``: disarm) the reference engines' one-shot stall (``POST /fault/stall``) on
    ``groups`` (default: every group of ``fleet``): the next generation to reach
    ``after_tokens`` output tokens makes no more until it is aborted or its engine dies.

    The tiny engine makes a whole answer in a fraction of a second and a loaded test process
    reads the stream in bursts far behind it, so a kill (or a pause) started when the reader
    saw ``n`` tokens can find the generation already over. Held at ``n + 1`` (its newest token
    goes out with the next event, so the reader sees ``n``), the generation is still running
    when the reader acts. Disarm before the kill so a continuation runs free."""
    ids = list(groups) if groups is not None else [g.group_id for g in fleet.registry.groups()]
    for gid in ids:
        r = httpx.post(
            f"{fleet.launcher(gid).url}/fault/stall",
            json={"after_tokens": after_tokens},
            timeout=30,
        )
        assert r.status_code == 200, r.text
