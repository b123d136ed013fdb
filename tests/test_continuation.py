"""No rollout work lost (#17): streaming, continuation after a crash or across a sync, provenance,
request failures feeding health -- with real reference-engine processes.

Greedy decoding on the same weights: a request continued on another group (re-prefilling its
prompt + tokens so far) must produce exactly the uninterrupted run's tokens. On the reference
engine (CPU, float32) prefill and cached decode agree to the token here; a kernel where they did
not would show up as a mismatch in these tests, not be hidden.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import engine_factory, stall_groups, tiny_model_dir  # noqa: F401

from rollsafe.adapters.engines import EngineSpec, SGLangClient
from rollsafe.adapters.engines.streaming import SGLangDeltas, StreamProtocolError
from rollsafe.fleet import (
    ContinuationFailed,
    FleetConfig,
    GroupSpec,
    RolloutFleet,
    Segment,
    off_policy,
)
from rollsafe.fleet.continuation import advance_seed, continued_params

GREEDY = {"max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}
PROMPT = [1, 2, 3, 4]
KILL_AT = 30


def _fleet(model: Path, tmp: Path, dialect: str = "sglang", groups: int = 2, **kw: Any) -> Any:
    return RolloutFleet(
        FleetConfig(
            model_path=model,
            export_root=tmp / "exports",
            groups=[GroupSpec(1) for _ in range(groups)],
            engine=EngineSpec(
                model_path=str(model),
                dialect=dialect,
                **{"fault_injection": True, **kw.pop("engine", {})},
            ),
            transport="nccl" if dialect == "vllm" else "ipc",
            **kw,
        )
    )


def _events(raw: str) -> list[Any]:
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _covers(segments: tuple[Segment, ...], n: int) -> None:
    """Segments are contiguous, in order, and cover exactly [0, n)."""
    assert segments[0].start == 0 and segments[-1].end == n
    for a, b in itertools.pairwise(segments):
        assert a.end == b.start, segments


# ---- the reference engine's streams follow the upstream formats ---------------------------
def test_sglang_stream_is_cumulative_with_versions_and_done(
    engine_factory: Any,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    eng = engine_factory(tiny_model_dir, extra_args=["--dialect", "sglang"])
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    plain = eng.post("/generate", body).json()
    r = eng.post("/generate", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 5  # one per token, the last carrying the finish
    for i, c in enumerate(chunks):  # cumulative output_ids and text (upstream's default)
        assert c["output_ids"] == plain["output_ids"][: i + 1]
        assert c["meta_info"]["weight_version"] == "default"
        assert c["meta_info"]["completion_tokens"] == i + 1
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 4
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert chunks[-1]["meta_info"]["weight_versions"] == [
        {"version": "default", "start": 0, "end": 5}
    ]
    assert "weight_versions" not in chunks[0]["meta_info"]  # only on the finished event
    assert chunks[-1]["text"] == plain["text"]
    # refused before the stream opens: a named JSON 400, as upstream validates first
    bad = eng.post("/generate", {**body, "stream": True, "input_ids": [PROMPT, PROMPT]})
    assert bad.status_code == 400 and "one prompt" in bad.json()["message"]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_vllm_stream_is_delta_with_token_ids_and_final_spans(
    engine_factory: Any,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
    version: str,
) -> None:
    eng = engine_factory(
        tiny_model_dir, extra_args=["--dialect", "vllm", "--vllm-version", version]
    )
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    plain = eng.post("/v1/completions", body).json()["choices"][0]
    spans = {"return_weight_versions": True} if version == "0.33.0" else {}  # 0.32.0: a 400
    r = eng.post("/v1/completions", {**body, "stream": True, **spans})
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1]]
    assert len(choices) == 4
    assert [t for c in choices for t in c["token_ids"]] == plain["token_ids"]
    assert all(len(c["token_ids"]) == 1 for c in choices)  # deltas
    assert choices[0]["prompt_token_ids"] == PROMPT
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
    if version == "0.33.0":  # spans on the final event only, with return_weight_versions
        assert all(c["weight_versions"] is None for c in choices[:-1])
        assert choices[-1]["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    else:  # 0.32.0 has no such field (the version comes from GET /weight_info)
        assert not any("weight_versions" in c for c in choices)
    assert "".join(c["text"] for c in choices) == plain["text"]
    # without return_token_ids no token ids are streamed (vLLM's default)
    r2 = eng.post("/v1/completions", {**body, "stream": True, "return_token_ids": False})
    assert all(e["choices"][0]["token_ids"] is None for e in _events(r2.text)[:-1])


def test_client_stream_yields_each_token_once(
    engine_factory: Any,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    eng = engine_factory(tiny_model_dir, extra_args=["--dialect", "sglang"])
    with SGLangClient(eng.url) as client:
        want = client.generate(PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0})
        deltas = list(
            client.generate_stream(PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0})
        )
    assert [t for d in deltas for t in d.token_ids] == want.output_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])


# ---- pure pieces ---------------------------------------------------------------------------
def test_continued_params_reduce_budgets_and_advance_the_seed() -> None:
    sp = {"max_new_tokens": 100, "min_new_tokens": 10, "sampling_seed": 7, "top_k": 5}
    assert continued_params(sp, 0) == sp
    out = continued_params(sp, 30)
    assert out["max_new_tokens"] == 70 and out["min_new_tokens"] == 0 and out["top_k"] == 5
    assert out["sampling_seed"] == advance_seed(7, 30) != 7
    assert continued_params(sp, 30) == out  # deterministic
    assert 0 <= advance_seed(2**63 - 1, 5) < 2**63


def test_off_policy_is_newest_minus_oldest_version() -> None:
    segs = (Segment("g0", "3", (0, 5)), Segment("g1", "5", (5, 9)), Segment("g1", "9", (9, 9)))
    assert off_policy(segs) == 2  # the empty segment produced nothing
    assert off_policy((Segment("g0", "default", (0, 4)),)) == 0
    assert off_policy((Segment("g0", "default", (0, 4)), Segment("g1", "2", (4, 6)))) is None


def test_a_cumulative_event_that_does_not_extend_the_tokens_is_refused() -> None:
    reader = SGLangDeltas("http://e", "/generate")
    assert reader({"output_ids": [1, 2], "meta_info": {}}).token_ids == (1, 2)
    assert reader({"output_ids": [1, 2, 3], "meta_info": {}}).token_ids == (3,)
    with pytest.raises(StreamProtocolError, match="do not extend"):
        reader({"output_ids": [1, 9, 3, 4], "meta_info": {}})


def test_a_stream_cut_before_done_is_engine_unavailable() -> None:
    from rollsafe.adapters.engines.errors import EngineUnavailable

    def handler(request: httpx.Request) -> httpx.Response:
        event = {"output_ids": [5], "meta_info": {"finish_reason": None}}
        return httpx.Response(200, text=f"data: {json.dumps(event)}\n\n")

    with SGLangClient("http://e", transport=httpx.MockTransport(handler)) as client:
        got: list[int] = []
        with pytest.raises(EngineUnavailable, match=r"before data: \[DONE\]"):
            for d in client.generate_stream([1]):
                got.extend(d.token_ids)
    assert got == [5]  # the tokens seen before the cut were yielded


# ---- continuation with real engine processes ----------------------------------------------
def _kill_group(fleet: RolloutFleet, gid: str) -> None:
    for pid in fleet.launcher(gid).rank_pids:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_sigkill_mid_generation_continues_on_another_group(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    dialect: str,
) -> None:
    with _fleet(tiny_model_dir, tmp_path, dialect) as fleet:
        ref = fleet.generate(PROMPT, sampling_params=GREEDY)  # uninterrupted, same weights
        assert len(ref.output_ids) == GREEDY["max_new_tokens"] and len(ref.segments) == 1
        killed: dict[str, int] = {}

        def progress(gid: str, n: int) -> None:
            if n >= KILL_AT and not killed:
                killed[gid] = n
                stall_groups(fleet, None)  # the continuation runs free
                _kill_group(fleet, gid)

        stall_groups(fleet, KILL_AT + 1)  # still generating when the reader sees KILL_AT
        fleet.router.on_progress = progress
        out = fleet.generate(PROMPT, sampling_params=GREEDY)
        fleet.router.on_progress = None
    assert killed, "the generation finished before the kill"
    (victim,) = killed
    assert out.output_ids == ref.output_ids  # complete, no duplicate, no gap
    assert out.continued and len({s.group_id for s in out.segments}) == 2
    assert out.segments[0].group_id == victim and out.segments[0].ended == "failed"
    assert out.segments[-1].group_id != victim and out.segments[-1].ended == "finished"
    assert out.segments[0].end >= KILL_AT  # every streamed token was kept
    _covers(out.segments, len(out.output_ids))
    assert out.result.meta_info["segments"][0]["group"] == victim
    stats = fleet.router.stats()["continuation"]
    assert stats["after_failure"] == 1 and stats["tokens_kept"] == out.segments[0].end
    assert stats["tokens_regenerated"] == 0


def test_bounded_tries_end_in_a_named_error_listing_segments(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    with _fleet(tiny_model_dir, tmp_path, recovery=_no_restarts()) as fleet:
        seen: list[str] = []

        def progress(gid: str, n: int) -> None:
            if gid not in seen and n >= KILL_AT * (len(seen) + 1):
                seen.append(gid)
                _kill_group(fleet, gid)

        # each segment is held KILL_AT + 1 tokens into its own output (the continuation's
        # output counts from its start), so every kill finds its generation running
        stall_groups(fleet, KILL_AT + 1)
        fleet.router.on_progress = progress
        with pytest.raises(ContinuationFailed) as info:
            fleet.generate(PROMPT, sampling_params=GREEDY)
    err = info.value
    assert [s.group_id for s in err.segments] == seen and len(seen) == 2
    assert all(s.ended == "failed" for s in err.segments)
    assert len(err.output_ids) == err.segments[-1].end >= 2 * KILL_AT
    assert f"{seen[0]}@" in str(err) and f"{seen[1]}@" in str(err)  # the message lists them


def _no_restarts() -> Any:
    from rollsafe.fleet import RecoverySettings

    return RecoverySettings(restart_budget=0)


@pytest.mark.parametrize(
    ("dialect", "mode"), [("sglang", "retract"), ("sglang", "abort"), ("vllm", "abort")]
)
def test_sync_with_pause_continues_requests_on_the_new_weights(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    dialect: str,
    mode: str,
) -> None:
    """A sync in ``retract`` / ``abort`` mode pauses the in-flight request, pushes the new
    version (``ipc`` to SGLang, ``nccl`` to vLLM: its ``retract`` waits for requests instead)
    and continues it on the new weights from its tokens so far."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    weights = {n: p.detach() for n, p in model.named_parameters()}  # same values, version 1
    with _fleet(tiny_model_dir, tmp_path, dialect, groups=1) as fleet:
        ref = fleet.generate(PROMPT, sampling_params=GREEDY)
        reached = threading.Event()
        fleet.router.on_progress = lambda gid, n: reached.set() if n >= KILL_AT else None
        box: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: box.setdefault("out", fleet.generate(PROMPT, sampling_params=GREEDY))
        )
        stall_groups(fleet, KILL_AT + 1)  # the pause finds the generation running
        try:
            worker.start()
            assert reached.wait(60)
        finally:
            stall_groups(fleet, None)  # the continuation runs free
        report = fleet.sync_weights(weights, 1, pause_mode=mode)  # type: ignore[arg-type]
        worker.join(60)
        assert report.ok and report.updated == ["g0"]
    out = box["out"]
    assert out.output_ids == ref.output_ids
    assert out.weights_versions == ("0", "1") and out.off_policy == 1
    first, last = out.segments[0], out.segments[-1]
    assert first.weights_version == "0" and first.end >= KILL_AT
    assert last.weights_version == "1" and last.ended == "finished"
    assert first.ended == ("version_change" if mode == "retract" else "aborted")
    _covers(out.segments, len(out.output_ids))


def test_group_failing_requests_but_passing_probes_is_taken_out(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    with _fleet(
        tiny_model_dir,
        tmp_path,
        engine={"fault_injection": True},
        recovery=_no_restarts(),
    ) as fleet:
        launcher = fleet.launcher("g1")
        for _ in range(10):  # every /generate on g1 answers 500; /health still passes
            r = httpx.post(f"{launcher.url}/fault/fail_next", json={"endpoint": "/generate"})
            assert r.status_code == 200
        sp = {"max_new_tokens": 4, "temperature": 0.0}
        for _ in range(8):
            out = fleet.generate(PROMPT, sampling_params=sp)
            assert len(out.output_ids) == 4  # every request still completes (on g0)
            if fleet.registry.get("g1").state != "active":
                break
        assert fleet.registry.get("g1").state != "active"
        assert fleet.health is not None and fleet.request_health is not None
        assert fleet.health.stats()["groups_failed"] == 0  # no probe failed it
        rh = fleet.request_health.stats()
        assert [g["group"] for g in rh["groups_failed"]] == ["g1"]
        assert rh["failed_requests"]["g1"] >= fleet.config.health.failure_threshold
        assert "g1" not in fleet.health.stats()["failure_counts"]  # not a probe failure
        assert fleet.snapshot()["request_health"]["groups_failed"][0]["group"] == "g1"
        # the timeline's fail row says why (the same words request health reports)
        fails = [r for r in fleet.timeline() if r["subject"] == "g1" and r["event"] == "fail"]
        assert fails and fails[0]["inputs"]["decided_by"] == "judge_request_failures"
        assert fails[0]["inputs"]["reason"] == rh["groups_failed"][0]["reason"]
        assert "consecutive failed request(s)" in fails[0]["inputs"]["reason"]


def test_vllm_abort_pause_continues_the_request_after_resume(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """vLLM's ``/pause?mode=abort`` ends the stream with ``finish_reason: abort``; the router
    holds the request until the bracket resumes the engine, then continues it from its tokens
    (the same bracket ``sync_weights(pause_mode="abort")`` puts around a push)."""
    from rollsafe.fleet.partial_rollouts import paused_generation

    with _fleet(tiny_model_dir, tmp_path, "vllm", groups=1) as fleet:
        ref = fleet.generate(PROMPT, sampling_params=GREEDY)
        reached = threading.Event()
        fleet.router.on_progress = lambda gid, n: reached.set() if n >= KILL_AT else None
        box: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: box.setdefault("out", fleet.generate(PROMPT, sampling_params=GREEDY))
        )
        worker.start()
        assert reached.wait(60)
        with paused_generation(fleet.registry, fleet.router, "abort") as paused:
            assert paused == ["g0"]
        worker.join(60)
    out = box["out"]
    assert out.output_ids == ref.output_ids
    assert [s.ended for s in out.segments] == ["aborted", "finished"]
    assert out.segments[0].end >= KILL_AT and out.off_policy == 0
    _covers(out.segments, len(out.output_ids))
