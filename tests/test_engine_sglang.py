"""Process-level tests of the reference engine's SGLang dialect with one rank.

One engine serves the whole module (it is reset to model A before each test that changes
weights). The API-key tests live in ``test_engine_startup.py``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    join_weight_group,
    module_engine,
    sglang_digests,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)

from rollsafe.wire.bucket import pack_buckets, serialize_bucket, serialize_named_tensors

GREEDY = {"max_new_tokens": 12, "temperature": 0}
PROMPT = [1, 17, 42, 99, 7]


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict())


def hf_greedy(
    model_dir: Path,
    prompt: list[int],
    n: int,
    *,
    min_new_tokens: int = 0,
    eos_token_id: list[int] | None = None,
) -> list[int]:
    """``transformers`` greedy ids; with ``min_new_tokens`` the ``eos_token_id`` ids cannot be
    sampled before it (and end the output once sampled, kept as its last token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    extra: dict[str, Any] = {}
    if eos_token_id is not None:
        extra = {"min_new_tokens": min_new_tokens, "eos_token_id": eos_token_id}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **extra)
    return [int(t) for t in out[0, len(prompt) :]]


def tokenizer_of(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def spanning_stop(tok: Any, ids: list[int], added_chars: int = 1) -> tuple[str, int]:
    """A stop string across a token boundary of the text of ``ids``: the last character of
    one token's text and the whole next token's text (printable ASCII both, at least
    ``added_chars`` of the latter), first appearing there; and how many tokens the text has
    when it completes."""
    for k in range(2, len(ids) + 1):
        before, upto = tok.decode(ids[: k - 1]), tok.decode(ids[:k])
        added = upto[len(before) :]
        if not (before and len(added) >= added_chars and upto.startswith(before)):
            continue
        stop = before[-1] + added
        if stop.isascii() and stop.isprintable() and upto.find(stop) == len(before) - 1:
            return stop, k
    raise AssertionError(f"no stop string spans two tokens of {ids}")


def next_stop(tok: Any, ids: list[int], stop: str, after: int) -> int | None:
    """How many tokens of ``ids`` the text has when ``stop`` next completes in the text a
    token adds, after the first ``after`` tokens (None: never)."""
    for m in range(after + 1, len(ids) + 1):
        before, upto = tok.decode(ids[: m - 1]), tok.decode(ids[:m])
        if len(upto) > len(before) and upto.find(stop, len(before) - len(stop) + 1) != -1:
            return m
    return None


def fresh_token(tok: Any, ids: list[int], start: int = 1) -> int:
    """The first index from ``start`` whose token did not come before (a stop token id that
    ends the output exactly there), the text up to it and through it ending in a whole
    character (vLLM's detokenizer holds back an incomplete one, a full decode shows U+FFFD)."""
    return next(
        j
        for j in range(start, len(ids))
        if ids[j] not in ids[:j]
        and not tok.decode(ids[:j]).endswith("\ufffd")
        and not tok.decode(ids[: j + 1]).endswith("\ufffd")
    )


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, extra_args=["--max-body-bytes", "65536"])


@pytest.fixture
def fresh(engine: EngineProcess, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    r = engine.post(
        "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "A"}
    )
    assert r.status_code == 200, r.text
    return engine


def generate(engine: EngineProcess, **body: Any) -> Any:
    r = engine.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_ready_line(engine: EngineProcess) -> None:
    assert engine.url.startswith("http://127.0.0.1:")
    assert engine.ready["ranks"] == 1 and engine.rank_pids == [engine.pid]
    assert engine.ready["dialect"] == "sglang" and engine.ready["device"] == "cpu"
    assert engine.get("/health").status_code == 200
    assert engine.get("/health_generate").status_code == 200


def test_greedy_is_deterministic_and_matches_transformers(
    fresh: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    a = generate(fresh, input_ids=PROMPT, sampling_params=GREEDY)
    b = generate(fresh, input_ids=PROMPT, sampling_params=GREEDY)
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] == hf_greedy(tiny_model_dir, PROMPT, 12)
    meta = a["meta_info"]
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(a["output_ids"])
    assert meta["weight_version"] == "A"
    assert meta["finish_reason"]["type"] in ("length", "stop")


def test_batch_text_and_logprobs(fresh: EngineProcess) -> None:
    out = generate(
        fresh,
        text=["Hello world", "The rollout engine"],
        sampling_params=GREEDY,
        return_logprob=True,
    )
    assert isinstance(out, list) and len(out) == 2
    for item in out:
        assert isinstance(item["text"], str)
        lps = item["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == item["output_ids"]
        assert all(lp <= 0 for lp, _, _ in lps)
    single = generate(fresh, input_ids=[PROMPT, PROMPT[:3]], sampling_params=GREEDY)
    assert (
        single[0]["output_ids"]
        == generate(fresh, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    )


def test_checksum_matches_loaded_state_dict(
    fresh: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    got = fresh.checksum()
    want = sglang_digests(hf_state(tiny_model_dir))  # SGLang's fused parameters, one rank
    assert (
        got["weight_version"] == "A"
        and "model.layers.0.self_attn.qkv_proj.weight" in got["tensors"]
    )
    assert got["tensors"] == want["tensors"] and got["model"] == want["model"]


def test_update_from_disk_changes_weights_and_generation(
    fresh: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    before = generate(fresh, input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    r = fresh.post(
        "/update_weights_from_disk",
        {"model_path": str(tiny_model_dir_b), "weight_version": "B", "abort_all_requests": True},
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    assert fresh.checksum()["model"] == sglang_digests(hf_state(tiny_model_dir_b))["model"]
    after = generate(fresh, input_ids=PROMPT, sampling_params=GREEDY)
    assert after["meta_info"]["weight_version"] == "B"
    assert after["output_ids"] == hf_greedy(tiny_model_dir_b, PROMPT, 12)
    assert after["output_ids"] != before


def test_update_from_tensor_shared_memory_buckets(
    fresh: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    state = hf_state(tiny_model_dir_b)
    buckets = list(pack_buckets(state.items(), bucket_bytes=64 << 10))
    assert len(buckets) > 1
    for i, b in enumerate(buckets):
        r = fresh.post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [serialize_bucket(b)],
                "load_format": "flattened_bucket",
                "flush_cache": i == len(buckets) - 1,
                "weight_version": "T",
            },
        )
        assert r.status_code == 200, r.text
    got = fresh.checksum()
    assert got["model"] == sglang_digests(state)["model"] and got["weight_version"] == "T"


def test_update_from_distributed_gloo(
    fresh: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    state = hf_state(tiny_model_dir_b)
    results: dict[str, Any] = {}

    def call(key: str, path: str, body: dict[str, Any]) -> None:
        results[key] = fresh.post(path, body, timeout=60)

    pg = join_weight_group(fresh, world_size=2, group_name="g1")
    names = list(state)
    half = len(names) // 2
    # first half: one broadcast per tensor; second half: one flattened bucket
    for part, flat in ((names[:half], False), (names[half:], True)):
        body = {
            "names": part,
            "dtypes": ["float32"] * len(part),
            "shapes": [list(state[n].shape) for n in part],
            "group_name": "g1",
            "load_format": "flattened_bucket" if flat else None,
            "weight_version": "D",
        }
        t = threading.Thread(target=call, args=("upd", "/update_weights_from_distributed", body))
        t.start()
        if flat:
            pg.broadcast(torch.cat([state[n].reshape(-1) for n in part]), 0).wait()
        else:
            for n in part:
                pg.broadcast(state[n].contiguous(), 0).wait()
        t.join(60)
        assert results["upd"].status_code == 200, results["upd"].text
    got = fresh.checksum()
    assert got["model"] == sglang_digests(state)["model"] and got["weight_version"] == "D"
    r = fresh.post("/destroy_weights_update_group", {"group_name": "g1"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/generate", b"{not json", 400, "malformed JSON"),
        # declared by SGLang, not implemented here, not its default: refused, named
        ("/generate", {"input_ids": [1, 2], "return_hidden_states": True}, 400, "'return_hid"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"temprature": 0}},
            400,
            "'temprature'",
        ),
        (
            "/update_weights_from_disk",
            {"model_path": "/nonexistent/rollsafe"},
            400,
            "not a directory",
        ),
        (
            "/update_weights_from_disk",
            {"model_path": "/tmp", "weight_version": "X"},
            400,
            "neither model.safetensors",
        ),
        (
            "/update_weights_from_disk",
            {"model_path": ".", "abort_all_requests": "yes", "unknown_key": 1},
            400,
            "'abort_all_requests'",
        ),
        (
            "/update_weights_from_disk",
            {"model_path": "/" + "a" * 5000, "weight_version": "X"},
            400,
            "model_path '/aaaa",
        ),
        (
            "/update_weights_from_disk",
            {"model_path": "/tmp/" + "b" * 300},
            400,
            "File name too long",
        ),
        ("/update_weights_from_disk", {"model_path": ""}, 400, "non-empty path"),
        (
            "/update_weights_from_distributed",
            {
                "names": ["model.norm.weight"],
                "dtypes": ["float32"],
                "shapes": [[65]],
                "group_name": "nope",
            },
            400,
            "'model.norm.weight': shape [65]",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]]},
            400,
            "'model.norm.weight': dtype bfloat16",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["model.nope.weight"], "dtypes": ["float32"], "shapes": [[64]]},
            400,
            "'model.nope.weight'",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["AAAA", "BBBB"]},
            400,
            "one entry per rank",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}, 400, "base64"),
        ("/update_weights_from_ipc", {"zmq_handles": {}}, 400, "needs CUDA"),
        ("/generate", {"input_ids": [1] * 40000}, 413, "too large"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(
    fresh: EngineProcess, path: str, body: Any, status: int, needle: str
) -> None:
    before = fresh.checksum()
    if isinstance(body, bytes):
        r = fresh.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = fresh.post(path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["message"]
    assert fresh.checksum() == before
    assert fresh.get("/health").status_code == 200


def test_wrong_shape_in_tensor_bucket_refused(
    fresh: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    before = fresh.checksum()
    state = hf_state(tiny_model_dir_b)
    named = [
        ("model.norm.weight", state["model.norm.weight"]),
        ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3)),
    ]
    (bucket,) = pack_buckets(named)
    r = fresh.post(
        "/update_weights_from_tensor",
        {
            "serialized_named_tensors": [serialize_bucket(bucket)],
            "load_format": "flattened_bucket",
            "weight_version": "bad",
        },
    )
    assert r.status_code == 400 and "'model.layers.0.mlp.up_proj.weight'" in r.json()["message"]
    assert fresh.checksum() == before  # the valid norm weight was not applied either


def test_fault_endpoints_are_404_without_env(fresh: EngineProcess) -> None:
    for path, body in [
        ("/fault/crash", {}),
        ("/fault/hang", {}),
        ("/fault/slow", {"seconds": 5}),
        ("/fault/fail_next", {"endpoint": "/health"}),
        ("/fault/stall", {"after_tokens": 1}),
    ]:
        r = fresh.post(path, body)
        assert r.status_code == 404, (path, r.text)
    assert fresh.get("/health").status_code == 200
    assert fresh.get("/health").status_code == 200  # fail_next did not arm


def test_release_resume_pause_and_weights_by_name(fresh: EngineProcess) -> None:
    w = fresh.post("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2}).json()
    assert len(w) == 2 and len(w[0]) == 64
    assert fresh.post("/release_memory_occupation", {"tags": ["weights"]}).status_code == 200
    r = fresh.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 503 and "resume_memory_occupation" in r.json()["message"]
    assert fresh.post("/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert fresh.post("/pause_generation", {"mode": "abort"}).status_code == 200
    done: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: done.setdefault(
            "r", fresh.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
        )
    )
    t.start()
    t.join(0.5)
    assert "r" not in done  # queued while paused
    assert fresh.post("/continue_generation", {}).status_code == 200
    t.join(30)
    assert done["r"].status_code == 200
    assert fresh.post("/flush_cache").status_code == 200


def test_bad_model_path_fails_start(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollsafe.adapters.reference_engine",
            "--model-path",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "not a directory" in r.stderr


def _push(engine: EngineProcess, entry: str, version: str | None, **extra: Any) -> Any:
    body: dict[str, Any] = {"serialized_named_tensors": [entry], **extra}
    if version is not None:
        body["weight_version"] = version
    return engine.post("/update_weights_from_tensor", body)


def test_weight_version_changes_only_with_the_call_that_carries_it_and_commits(
    fresh: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    state = hf_state(tiny_model_dir_b)
    buckets = list(pack_buckets(state.items(), bucket_bytes=64 << 10))
    assert len(buckets) > 2
    # a failing call that carries a version changes neither the weights nor the version
    (bad,) = pack_buckets([("model.norm.weight", torch.zeros(65))])
    before = fresh.checksum()
    r = _push(fresh, serialize_bucket(bad), "X", load_format="flattened_bucket")
    assert r.status_code == 400, r.text
    assert fresh.checksum() == before and before["weight_version"] == "A"
    # the buckets before the last carry no version: a half-updated engine keeps the old one
    for b in buckets[:-1]:
        r = _push(fresh, serialize_bucket(b), None, load_format="flattened_bucket")
        assert r.status_code == 200, r.text
        got = fresh.checksum()
        assert got["weight_version"] == "A" and got["model"] != before["model"]
    r = _push(fresh, serialize_bucket(buckets[-1]), "V", load_format="flattened_bucket")
    assert r.status_code == 200 and "weight_version=V" in r.json()["message"], r.text
    got = fresh.checksum()
    assert got["weight_version"] == "V" and got["model"] == sglang_digests(state)["model"]
    out = generate(fresh, input_ids=PROMPT, sampling_params=GREEDY)
    assert out["meta_info"]["weight_version"] == "V"
    # the last call failing (after the others committed) keeps the old version too
    r = _push(fresh, serialize_bucket(bad), "W", load_format="flattened_bucket")
    assert r.status_code == 400 and fresh.checksum() == got


@pytest.mark.parametrize("fmt", ["plain", "flattened_bucket"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_bad_entry_in_a_multi_tensor_request_leaves_every_weight_untouched(
    fresh: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
    fmt: str,
    where: str,
) -> None:
    before = fresh.checksum()
    named = list(hf_state(tiny_model_dir_b).items())  # every tensor of model B ...
    i = {"first": 0, "middle": len(named) // 2, "last": len(named) - 1}[where]
    name, t = named[i]
    named[i] = (name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))  # ... one mis-shaped
    if fmt == "plain":
        entry = serialize_named_tensors(named)
        extra: dict[str, Any] = {}
    else:
        (bucket,) = pack_buckets(named, bucket_bytes=1 << 30)
        entry, extra = serialize_bucket(bucket), {"load_format": "flattened_bucket"}
    r = _push(fresh, entry, "bad", **extra)
    assert r.status_code == 400 and repr(name) in r.json()["message"], r.text
    assert fresh.checksum() == before  # no weight of the request was applied, version kept
    out = generate(fresh, input_ids=PROMPT, sampling_params=GREEDY)
    assert out["meta_info"]["weight_version"] == "A"


# ---- stop strings and stop tokens (SGLang 0.5.23's rules: rollsafe/.../stops.py) -----------
def _events(r: Any) -> list[dict[str, Any]]:
    import json

    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_a_stop_string_across_two_tokens_ends_the_generation(
    fresh: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """SGLang keeps every generated token in ``output_ids`` (the stop string's included), cuts
    the text before the matched string (after it with ``no_stop_trim``) and reports it as
    ``matched``; a list of stop strings and ``min_new_tokens`` change nothing (strings count
    from the first token in SGLang)."""
    tok = tokenizer_of(tiny_model_dir)
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    stop, k = spanning_stop(tok, greedy)
    text = tok.decode(greedy[:k])
    at = text.find(stop)
    for extra, kept in (({}, False), ({"no_stop_trim": True}, True)):
        sp = {**GREEDY, "stop": stop, **extra}
        out = generate(fresh, input_ids=PROMPT, sampling_params=sp)
        assert out["output_ids"] == greedy[:k]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["meta_info"]["completion_tokens"] == k
        assert out["text"] == (text[: at + len(stop)] if kept else text[:at])
    sp = {**GREEDY, "stop": ["never there", stop], "min_new_tokens": k + 3}
    out = generate(fresh, input_ids=PROMPT, sampling_params=sp)
    assert out["output_ids"] == greedy[:k] and out["text"] == text[:at]
    # the same as text prompts in a batch, one stop per prompt
    batch = generate(
        fresh, input_ids=[PROMPT, PROMPT], sampling_params=[{**GREEDY, "stop": stop}, GREEDY]
    )
    assert batch[0]["output_ids"] == greedy[:k] and batch[1]["output_ids"] == greedy


def test_a_streamed_stop_string_is_held_back_until_it_ends_the_generation(
    fresh: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """No event is sent while the text ends with the start of a stop string (SGLang's
    scheduler holds the output); the last event carries every token and the trimmed text."""
    tok = tokenizer_of(tiny_model_dir)
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    stop, k = spanning_stop(tok, greedy)
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "stop": stop}, "stream": True}
    events = _events(fresh.post("/generate", body))
    last = events[-1]
    want = generate(fresh, input_ids=PROMPT, sampling_params={**GREEDY, "stop": stop})
    assert last["output_ids"] == greedy[:k] and last["text"] == want["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(events) < k  # the event after the stop string's first token was held
    for event in events[:-1]:
        assert event["meta_info"]["finish_reason"] is None
        assert not any(event["text"].endswith(stop[:i]) for i in range(1, len(stop) + 1))
        assert event["output_ids"] == greedy[: len(event["output_ids"])]


def test_a_stop_token_id_ends_the_generation_and_ignore_eos_ignores_it(
    fresh: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """The stop token stays in ``output_ids`` and is ``matched`` by its id; its text is left
    out of the text unless ``no_stop_trim``. With ``ignore_eos`` SGLang ends on no token at
    all, stop token ids included (``_check_token_based_finish`` returns at once)."""
    tok = tokenizer_of(tiny_model_dir)
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    j = fresh_token(tokenizer_of(tiny_model_dir), greedy)
    sp = {**GREEDY, "stop_token_ids": [greedy[j]]}
    out = generate(fresh, input_ids=PROMPT, sampling_params=sp)
    assert out["output_ids"] == greedy[: j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": greedy[j]}
    assert out["text"] == tok.decode(greedy[:j])
    kept = generate(fresh, input_ids=PROMPT, sampling_params={**sp, "no_stop_trim": True})
    assert kept["output_ids"] == greedy[: j + 1] and kept["text"] == tok.decode(greedy[: j + 1])
    body = {"input_ids": PROMPT, "sampling_params": sp, "stream": True}
    events = _events(fresh.post("/generate", body))
    assert events[-1]["output_ids"] == greedy[: j + 1] and events[-1]["text"] == out["text"]
    ignored = generate(fresh, input_ids=PROMPT, sampling_params={**sp, "ignore_eos": True})
    assert ignored["output_ids"] == greedy
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_min_new_tokens_keeps_stop_tokens_from_being_sampled(
    fresh: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """Before ``min_new_tokens`` SGLang masks EOS and the stop token ids out of the logits (its
    min-new-tokens penalizer): greedy then takes the next best token, as ``transformers`` does
    with the same minimum over the same ids."""
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    j = fresh_token(tokenizer_of(tiny_model_dir), greedy)
    stop_id, minimum = greedy[j], j + 3
    sp = {**GREEDY, "stop_token_ids": [stop_id], "min_new_tokens": minimum}
    out = generate(fresh, input_ids=PROMPT, sampling_params=sp)
    want = hf_greedy(tiny_model_dir, PROMPT, 12, min_new_tokens=minimum, eos_token_id=[stop_id, 2])
    assert out["output_ids"] == want and want[:j] == greedy[:j] and want[j] != stop_id
    assert stop_id not in out["output_ids"][:minimum]
    if out["output_ids"][-1] in (stop_id, 2):
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": want[-1]}
    else:
        assert out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        ({"stop": [f"s{i}" for i in range(33)]}, "at most 32 stop strings are allowed, got 33"),
        ({"stop": 7}, "'stop'"),
        ({"stop": ["ok", 3]}, "'stop"),
        ({"no_stop_trim": "yes"}, "'no_stop_trim'"),
        ({"stop_token_ids": "5"}, "'stop_token_ids'"),
        ({"min_new_tokens": 20}, "min_new_tokens must be in [0, max_new_tokens(12)], got 20."),
    ],
)
def test_stop_parameters_sglang_refuses_are_refused(
    fresh: EngineProcess, sampling: dict[str, Any], needle: str
) -> None:
    r = fresh.post("/generate", {"input_ids": PROMPT, "sampling_params": {**GREEDY, **sampling}})
    assert r.status_code == 400 and needle in r.json()["message"], r.text
    ok = fresh.post("/generate", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "stop": []}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 12
