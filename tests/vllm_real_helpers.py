"""Helpers for tests that start the real vLLM (``real_vllm``): the server's environment with
rollsafe's plugin, greedy outputs to compare servers by, and what a server's processes hold.

A vLLM on CPU started by the launcher uses rollsafe's ``rollsafe_gloo`` weight-transfer backend,
which vLLM finds through the ``vllm.general_plugins`` entry point of the rollsafe installed in
its virtualenv (``make real-engine`` installs it). :func:`server_env` fails with what to do when
that entry point is missing, and puts this checkout first on the server's ``PYTHONPATH`` so the
plugin code under test is what the server runs, whichever checkout the venv was made from.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
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
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    """Token ids and their logprobs of greedy completions of :data:`PROMPTS` (temperature 0)."""
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
    r = httpx.get(url + "/weight_info", timeout=30)
    r.raise_for_status()
    version = r.json()["weight_version"]
    return None if version is None else str(version)
