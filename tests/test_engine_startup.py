"""Process-level tests of the reference engine's start-up: ``--tokenizer-path``, the API key
required off loopback, and start-up errors.

One engine serves the module: one rank, fault injection on, bound to ``0.0.0.0`` with an API
key, and a word-level tokenizer from another directory (``w0`` .. ``w511`` map to ids 0..511),
so a text prompt that comes back as the same ids proves the tokenizer came from
``--tokenizer-path``. The last test hangs that engine on purpose, so it runs last.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import (
    EngineProcess,
    engine_command,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
)
from test_engine_sglang import GREEDY, PROMPT

VOCAB = 512
API_KEY = "s3cret"


def write_word_tokenizer(path: Path) -> Path:
    """A ``tokenizer.json`` mapping the words ``w0`` .. ``w511`` to ids 0 .. 511."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def word_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"))


@pytest.fixture(scope="module")
def tok_engine(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
    word_tokenizer_dir: Path,
) -> EngineProcess:
    return module_engine(
        request,
        tiny_model_dir,
        faults=True,
        api_key=API_KEY,
        extra_args=["--host", "0.0.0.0", "--tokenizer-path", str(word_tokenizer_dir)],
    )


def run_engine(model_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run the engine's command line to completion (for start-ups that must fail)."""
    return subprocess.run(
        engine_command(model_dir, extra_args=list(extra)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_tokenizer_path_is_used_for_text(
    tok_engine: EngineProcess, word_tokenizer_dir: Path
) -> None:
    assert tok_engine.ready["tokenizer_path"] == str(word_tokenizer_dir)
    info = tok_engine.get("/get_server_info").json()
    assert info["tokenizer_path"] == str(word_tokenizer_dir)
    by_ids = tok_engine.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    r = tok_engine.post("/generate", {"text": words(PROMPT), "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    by_text = r.json()
    assert by_text["meta_info"]["prompt_tokens"] == len(PROMPT)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == words(by_text["output_ids"])


def test_ready_line_reports_startup_phases(tok_engine: EngineProcess) -> None:
    phases: dict[str, Any] = tok_engine.ready["startup_s"]
    assert {"preloaded", "rank0_loaded", "serving"} <= set(phases)
    assert phases["preloaded"] <= phases["rank0_loaded"] <= phases["serving"]
    assert tok_engine.ready["rank_start_method"] is None  # one rank: nothing to start


def test_api_key_required_off_loopback(
    tok_engine: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    refused = run_engine(tiny_model_dir, "--host", "0.0.0.0")
    assert refused.returncode == 2 and "--api-key" in refused.stderr
    assert "ROLLSAFE_READY" not in refused.stdout
    assert httpx.get(f"{tok_engine.url}/health").status_code == 401
    bad = httpx.get(f"{tok_engine.url}/health", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    assert tok_engine.get("/health").status_code == 200  # the client sends the key
    r = tok_engine.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("make", "status", "needles"),
    [
        (lambda d: d / "missing", 2, ["--tokenizer-path", "missing", "is not a directory"]),
        (lambda d: d, 2, ["--tokenizer-path", "has no tokenizer.json"]),
        (lambda d: d / ("t" * 300), 2, ["--tokenizer-path", "File name too long"]),
    ],
    ids=["missing", "no-tokenizer-json", "name-too-long"],
)
def test_bad_tokenizer_path_fails_start_at_once(
    tmp_path: Path,
    tiny_model_dir: Path,  # noqa: F811
    make: Any,
    status: int,
    needles: list[str],
) -> None:
    r = run_engine(tiny_model_dir, "--tokenizer-path", str(make(tmp_path)))
    assert r.returncode == status, r.stderr
    assert all(n in r.stderr for n in needles), r.stderr
    assert "ROLLSAFE_READY" not in r.stdout


def test_corrupt_tokenizer_fails_start_with_its_path(
    tmp_path: Path,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    r = run_engine(tiny_model_dir, "--tokenizer-path", str(tmp_path), "--ranks", "2")
    assert r.returncode == 3, r.stderr
    assert "StartupError" in r.stderr and str(tmp_path / "tokenizer.json") in r.stderr
    assert "cannot be loaded as a tokenizer" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_without_cuda_fails_start(tiny_model_dir: Path) -> None:  # noqa: F811
    r = run_engine(tiny_model_dir, "--device", "cuda")
    assert r.returncode == 3, r.stderr
    assert "--device cuda but torch.cuda.is_available() is false" in r.stderr


def test_fault_hang_stops_answering(tok_engine: EngineProcess) -> None:
    """Runs last in this module: the engine never answers again."""
    with pytest.raises(httpx.TimeoutException):
        tok_engine.post("/fault/hang", {}, timeout=0.5)
    assert not tok_engine.healthy(timeout=1.0)
    assert tok_engine.proc.poll() is None  # alive, just not answering
