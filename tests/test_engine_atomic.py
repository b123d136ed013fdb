"""All-or-nothing weight updates and weight-update group setup off the generation path (#12).

Three levels:

* one rank's model (:class:`ShardedCausalLM`): ``stage`` refuses a tensor that is not
  materialized (``meta``, sparse, ...) or holds NaN / inf, names it, stages nothing;
* a two-rank engine in this process (rank 1 spawned), whose every rank can be asked for the
  digest of its own live tensors: a refusal found on rank 1 leaves *both* ranks at the old
  weights and version, the engine healthy and able to take the next update; a commit that fails
  anyway marks the engine failed instead of serving mixed weights; a group setup to a dead
  address answers within its deadline while generation keeps running, and a rendezvous that
  completes late is closed;
* a two-rank engine process over HTTP: the same refusals as named 400s.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    free_port,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
    wait_for,
)
from test_engine_sglang import GREEDY, PROMPT, hf_state

from rollsafe.adapters.reference_engine.bootstrap import RankOptions
from rollsafe.adapters.reference_engine.engine import ReferenceEngine, SamplingParams
from rollsafe.adapters.reference_engine.errors import RankFailure, WeightUpdateError
from rollsafe.adapters.reference_engine.model import (
    LM_HEAD,
    ShardedCausalLM,
    load_config,
)
from rollsafe.adapters.reference_engine.ranks import RankSet
from rollsafe.checksum import weights_checksum
from rollsafe.wire.bucket import pack_buckets, serialize_bucket, serialize_named_tensors
from rollsafe.wire.finite import non_finite_index

SETUP_DEADLINE_S = 2.0
#: how late past its deadline a setup may answer (one poll interval plus the cleanup round trip)
ANSWER_MARGIN_S = 1.5


# ---- one rank's model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> ShardedCausalLM:  # noqa: F811
    return ShardedCausalLM(load_config(tiny_model_dir), rank=1, world_size=2)


def _values(model: ShardedCausalLM, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s.shape, generator=g).to(s.dtype)) for n, s in model.specs.items()]


def _digest(model: ShardedCausalLM) -> str:
    return weights_checksum(model.local_tensors())["model"]


def _with(named: list[tuple[str, torch.Tensor]], i: int, t: torch.Tensor) -> list[Any]:
    return [*named[:i], (named[i][0], t), *named[i + 1 :]]


def _poisoned(t: torch.Tensor, value: float, at: int = 5) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[at] = value
    return out


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), "meta device"),
        (lambda t: t.to_sparse(), "only dense tensors"),
        (lambda t: _poisoned(t, float("nan")), "1 NaN, 0 inf"),
        (lambda t: _poisoned(t, float("inf")), "0 NaN, 1 inf"),
        (lambda t: _poisoned(t, float("-inf")), "0 NaN, 1 inf"),
    ],
    ids=["meta", "sparse", "nan", "inf", "-inf"],
)
def test_stage_refuses_a_tensor_that_could_not_be_committed_and_stages_nothing(
    lm: ShardedCausalLM, make: Any, needle: str
) -> None:
    before = _digest(lm)
    named = _values(lm, seed=1)
    mid = len(named) // 2  # the tensors before it are valid: none of them may be staged
    with pytest.raises(WeightUpdateError, match=repr(named[mid][0])) as info:
        lm.stage(_with(named, mid, make(named[mid][1])), where="t")
    assert needle in str(info.value) and info.value.status == 400
    assert lm.staged_names == [] and lm.commit() == []
    assert _digest(lm) == before


def test_non_finite_checks_this_ranks_rows_and_can_be_allowed(lm: ShardedCausalLM) -> None:
    named = dict(_values(lm, seed=2))
    head = named[LM_HEAD]
    # a NaN in rank 0's rows of lm_head is rank 0's to refuse: this rank (1) stages its rows
    lm.stage([(LM_HEAD, _poisoned(head, float("nan"), at=0))], where="t")
    lm.discard()
    poisoned = _poisoned(head, float("nan"), at=lm.row_start * head.shape[1])
    with pytest.raises(WeightUpdateError, match="non-finite"):
        lm.stage([(LM_HEAD, poisoned)], where="t")
    before = _digest(lm)
    lm.stage([(LM_HEAD, poisoned)], where="t", allow_non_finite=True)  # the caller opted in
    assert lm.commit() == [LM_HEAD]
    assert torch.isnan(lm.lm_head_shard).sum() == 1 and _digest(lm) != before


def test_stage_copies_a_non_contiguous_view_and_keeps_contiguous_ones(lm: ShardedCausalLM) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"  # square: its transpose has its shape
    src = torch.randn(lm.specs[name].shape)
    view = src.t()
    good = torch.randn(lm.specs["model.norm.weight"].shape)
    lm.stage([(name, view), ("model.norm.weight", good)], where="t")
    staged = lm._staged
    assert staged[name].is_contiguous() and staged[name].data_ptr() != src.data_ptr()
    assert staged["model.norm.weight"].data_ptr() == good.data_ptr()  # no copy needed
    lm.commit()
    assert torch.equal(lm.local_tensors()[name], view)


def test_non_finite_index_one_reduction_per_dtype_first_bad_wins() -> None:
    tensors = [
        torch.arange(4),  # integers are always finite
        torch.ones(3, dtype=torch.float16),
        torch.zeros(0),  # empty
        torch.tensor([1.0, float("inf")], dtype=torch.bfloat16),
        torch.tensor([float("nan")], dtype=torch.float64),
        torch.tensor([2.0, float("nan")]),
    ]
    assert non_finite_index(tensors) == 3
    assert non_finite_index(tensors[:3]) is None
    assert non_finite_index([tensors[5], tensors[4]]) == 0
    f8 = torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2)  # no norm kernel: the fallback
    assert non_finite_index([torch.ones(2).to(torch.float8_e5m2), f8]) == 1


def test_non_finite_index_checks_back_to_back_views_as_one_span() -> None:
    from rollsafe.wire.finite import _spans

    flat = torch.ones(40)
    views = [flat[0:10], flat[10:20], flat[20:30], flat[30:40]]
    shuffled = [views[2], views[0], views[3], views[1]]  # out of address order
    spans = _spans(shuffled, [0, 1, 2, 3])
    assert len(spans) == 1 and spans[0][0].numel() == 40
    assert sorted(spans[0][1]) == [0, 1, 2, 3]
    assert non_finite_index(shuffled) is None
    flat[25] = float("nan")  # inside views[2], i.e. shuffled[0]
    flat[12] = float("inf")  # inside views[1], i.e. shuffled[3]
    assert non_finite_index(shuffled) == 0
    assert non_finite_index([views[3], views[1]]) == 1  # a gap: two spans, the second is bad
    assert len(_spans([views[3], views[1]], [0, 1])) == 2
    # a gap, another storage, a non-contiguous tensor: each stays on its own
    other = torch.ones(10)
    strided = torch.ones(4, 4).t()
    parts = _spans([views[0], other, strided, views[2]], [0, 1, 2, 3])
    assert sorted(len(m) for _, m in parts) == [1, 1, 1, 1]
    assert non_finite_index([views[0], other, strided]) is None


# ---- a two-rank engine in this process --------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[ReferenceEngine]:  # noqa: F811
    opts = RankOptions(str(tiny_model_dir), world_size=2, threads=1, weight_group_timeout_s=30)
    eng = ReferenceEngine(RankSet(opts), weight_version="v0")
    yield eng
    eng.close()


def _rank_digests(eng: ReferenceEngine) -> list[str]:
    return list(eng.submit(lambda: eng.ranks.call_all("local_checksum")).result(60))


def _group_state(eng: ReferenceEngine) -> list[dict[str, Any]]:
    return list(eng.submit(lambda: eng.ranks.call_all("group_state")).result(60))


def _generate(eng: ReferenceEngine, n: int = 4) -> Future[Any]:
    return eng.submit_generate(PROMPT, SamplingParams(max_new_tokens=n, temperature=0.0))


def _assert_unchanged(eng: ReferenceEngine, digests: list[str], version: str) -> None:
    assert _rank_digests(eng) == digests  # every rank, trunk and lm_head rows
    assert eng.weight_version == version
    assert eng.health() is None
    assert _generate(eng).result(60).weight_version == version


def test_a_non_finite_tensor_on_rank_1_changes_no_rank(
    engine: ReferenceEngine,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    before, version = _rank_digests(engine), engine.weight_version
    named = list(hf_state(tiny_model_dir_b).items())
    mid = len(named) // 2
    good = serialize_named_tensors(named)
    for value in (float("nan"), float("inf")):
        bad = serialize_named_tensors(_with(named, mid, _poisoned(named[mid][1], value)))
        fut = engine.update_from_tensor([good, bad], "bad")  # rank 0's entry is valid
        with pytest.raises(WeightUpdateError, match=repr(named[mid][0])) as info:
            fut.result(60)
        assert "serialized_named_tensors[1]" in str(info.value)
        _assert_unchanged(engine, before, version)
    # the group is not failed: the next valid update applies on every rank
    assert engine.update_from_tensor([good, good], "B").result(60)
    after = _rank_digests(engine)
    assert engine.weight_version == "B" and after[0] != before[0] and after[1] != before[1]


def test_allow_non_finite_applies_on_every_rank(engine: ReferenceEngine) -> None:
    state = {n: t.detach().clone() for n, t in engine.ranks.local.local_tensors().items()}
    head = engine.submit(lambda: engine.full_named_tensors()[LM_HEAD]).result(60)
    state[LM_HEAD] = _poisoned(head, float("nan"), at=head.numel() - 1)  # rank 1's last row
    entry = serialize_named_tensors(list(state.items()))
    with pytest.raises(WeightUpdateError, match=repr(LM_HEAD)):
        engine.update_from_tensor([entry, entry], "nan").result(60)
    engine.update_from_tensor([entry, entry], "nan", allow_non_finite=True).result(60)
    assert engine.weight_version == "nan"
    head = engine.submit(lambda: engine.full_named_tensors()[LM_HEAD]).result(60)
    assert int(torch.isnan(head).sum()) == 1
    # the engine-wide opt-in (``--allow-non-finite``): no request field, as upstream has none
    engine.allow_non_finite = True
    try:
        engine.update_from_tensor([entry, entry], "nan-2").result(60)
    finally:
        engine.allow_non_finite = False
    assert engine.weight_version == "nan-2"


def test_a_disk_update_with_nan_is_refused_on_every_rank(
    engine: ReferenceEngine,
    tmp_path: Path,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (shard,) = (tmp_path / "m").glob("*.safetensors")
    state = load_file(str(shard))
    name = sorted(state)[1]
    state[name] = _poisoned(state[name], float("nan"))
    save_file(state, str(shard), metadata={"format": "pt"})
    before, version = _rank_digests(engine), engine.weight_version
    with pytest.raises(WeightUpdateError, match=repr(name)):
        engine.update_from_disk(str(tmp_path / "m"), "disk-nan").result(60)
    _assert_unchanged(engine, before, version)


def _silent_listener() -> socket.socket:
    """A TCP port that accepts connections (the kernel's backlog) and never answers: the store
    connect to it hangs far past its own timeout."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def test_group_setup_to_a_dead_address_answers_in_time_and_generation_runs(
    engine: ReferenceEngine,
) -> None:
    before, version = _rank_digests(engine), engine.weight_version
    silent = _silent_listener()
    try:
        t0 = time.monotonic()
        init = engine.init_group(
            master_address="127.0.0.1",
            master_port=silent.getsockname()[1],
            rank_offset=1,
            world_size=3,
            group_name="dead",
            backend="gloo",
            timeout_s=SETUP_DEADLINE_S,
        )
        gen = _generate(engine, n=8)  # queued after the setup: must not wait for it
        assert gen.result(SETUP_DEADLINE_S).output_ids and not init.done()
        with pytest.raises(WeightUpdateError, match="did not complete within") as info:
            init.result(SETUP_DEADLINE_S + ANSWER_MARGIN_S)
        assert info.value.status == 400
        assert time.monotonic() - t0 < SETUP_DEADLINE_S + ANSWER_MARGIN_S
        states = _group_state(engine)
        assert all(s["groups"] == [] and s["joining"] == [] for s in states), states
        _assert_unchanged(engine, before, version)
    finally:
        silent.close()  # the abandoned store connects fail now: their threads end
    assert wait_for(lambda: all(s["abandoned"] == 0 for s in _group_state(engine)), 30)
    assert not any(t.name == "join-dead" and t.is_alive() for t in threading.enumerate())


def test_a_late_setup_leaves_no_group_and_frees_its_name(engine: ReferenceEngine) -> None:
    from rollsafe.wire.group import open_weight_update_group

    body = dict(
        master_address="127.0.0.1",
        master_port=free_port(),  # nobody listens yet: the trainer is late
        rank_offset=1,
        world_size=3,
        backend="gloo",
    )
    late = engine.init_group(group_name="late", timeout_s=SETUP_DEADLINE_S, **body)
    with pytest.raises(WeightUpdateError, match="is already being set up"):
        engine.init_group(group_name="late", timeout_s=SETUP_DEADLINE_S, **body)
    with pytest.raises(WeightUpdateError, match="did not complete"):
        late.result(SETUP_DEADLINE_S + ANSWER_MARGIN_S)
    assert wait_for(
        lambda: all(
            s["groups"] == [] and s["joining"] == [] and s["abandoned"] == 0
            for s in _group_state(engine)
        ),
        30,
    )
    # the name is free again, and a timely trainer gets its group on every rank
    body["master_port"] = free_port()
    ok = engine.init_group(group_name="late", timeout_s=30, **body)
    group = open_weight_update_group(rank=0, group_name="late", timeout_s=30, **_trainer(body))
    ok.result(30)
    assert all(s["groups"] == ["late"] for s in _group_state(engine))
    engine.destroy_group("late").result(30)
    group.close()
    assert all(s["groups"] == [] for s in _group_state(engine))


def test_a_join_given_up_closes_the_group_its_rendezvous_makes_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollsafe.adapters.reference_engine import ranks

    release = threading.Event()
    made: list[Any] = []

    class Group:
        closed = False

        def close(self) -> None:
            self.closed = True

    def slow_open(**kw: Any) -> Any:
        release.wait(10)
        made.append(Group())
        return made[-1]

    monkeypatch.setattr(ranks, "open_weight_update_group", slow_open)
    join = ranks.GroupJoin("t", {"group_name": "g"}, device=torch.device("cpu"))
    join.start()
    assert join.cancel() is False  # still in the rendezvous: it is left to close its group
    release.set()
    assert join.done.wait(10)
    assert made[0].closed and join.group is None
    assert not join.thread.is_alive() or wait_for(lambda: not join.thread.is_alive(), 5)
    # a join that completed before it was given up: cancel closes the group
    done = ranks.GroupJoin("u", {"group_name": "g"}, device=torch.device("cpu"))
    done.start()
    assert done.done.wait(10) and done.group is made[1] and not made[1].closed
    assert done.cancel() is True and made[1].closed


def _trainer(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in ("master_address", "master_port", "world_size")}


def test_a_commit_that_fails_anyway_fails_the_engine(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device fault mid-commit (after validation) cannot be rolled back: the engine reports
    itself failed rather than answering 500 and serving half-updated weights."""
    eng = ReferenceEngine(RankSet(RankOptions(str(tiny_model_dir), threads=1)))
    try:
        model = eng.ranks.local.model

        def broken_commit() -> list[str]:
            model._staged.clear()
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(model, "commit", broken_commit)
        with pytest.raises(RankFailure, match="may mix two versions"):
            eng.update_from_disk(str(tiny_model_dir_b), "B").result(60)
        assert eng.health() is not None and eng.weight_version == "default"
    finally:
        eng.close()


# ---- a two-rank engine process over HTTP ------------------------------------------------------
@pytest.fixture(scope="module")
def engine2(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(
        request,
        tiny_model_dir,
        ranks=2,
        extra_args=["--weight-group-timeout", str(SETUP_DEADLINE_S)],
    )


def test_http_non_finite_on_rank_1_is_a_named_400(
    engine2: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    before = engine2.checksum()
    named = list(hf_state(tiny_model_dir_b).items())
    (good,) = pack_buckets(named, bucket_bytes=1 << 30)
    mid = len(named) // 2
    bad = serialize_named_tensors(_with(named, mid, _poisoned(named[mid][1], float("nan"))))
    r = engine2.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize_bucket(good), bad], "weight_version": "bad"},
    )
    assert r.status_code == 400 and repr(named[mid][0]) in r.json()["message"], r.text
    assert "non-finite" in r.json()["message"]
    assert engine2.checksum() == before and engine2.get("/health").status_code == 200
    r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["weight_version"] == before["weight_version"]


def test_http_group_setup_to_a_dead_address_does_not_stall_generation(
    engine2: EngineProcess,
) -> None:
    silent = _silent_listener()
    answer: dict[str, Any] = {}
    body = {
        "master_address": "127.0.0.1",
        "master_port": silent.getsockname()[1],
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "dead",
        "backend": "gloo",
    }

    def init() -> None:
        t0 = time.monotonic()
        answer["r"] = engine2.post("/init_weights_update_group", body, timeout=60)
        answer["s"] = time.monotonic() - t0

    try:
        before = engine2.checksum()
        thread = threading.Thread(target=init)
        thread.start()
        time.sleep(0.2)
        r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=10)
        assert r.status_code == 200 and "r" not in answer, r.text  # done while init pends
        thread.join(30)
        assert answer["r"].status_code == 400, answer["r"].text
        assert "did not complete within" in answer["r"].json()["message"]
        assert answer["s"] < SETUP_DEADLINE_S + ANSWER_MARGIN_S
        assert engine2.get("/health").status_code == 200 and engine2.checksum() == before
    finally:
        silent.close()
