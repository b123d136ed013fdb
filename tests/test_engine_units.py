"""Unit tests: the flattened-bucket wire format, the weight checksum, and the reference engine's
path checks, tokenizer loading, rank start-up options and stop rules (no engine process)."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from rollsafe.checksum import tensor_digest, weights_checksum
from rollsafe.errors import BucketFormatError
from rollsafe.wire.bucket import (
    FlatBucket,
    TensorMeta,
    WireBucket,
    deserialize_payload,
    pack_buckets,
    serialize_bucket,
    serialize_named_tensors,
    unpack_bucket,
)


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(4, 8, generator=g)),
        ("b", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(3, 3, generator=g)),
        ("d", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("e", torch.randn(100, generator=g)),
    ]


def test_pack_unpack_roundtrip_respects_dtype_and_size() -> None:
    named = _named()
    buckets = list(pack_buckets(named, bucket_bytes=200))
    for b in buckets:
        b.validate()
        assert len({m.dtype for m in b.metas}) == 1
        assert b.nbytes <= 200 or len(b.metas) == 1
    got = {n: t for b in buckets for n, t in unpack_bucket(b).items()}
    assert list(got) != []
    for name, t in named:
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype


def test_serialize_roundtrip_shared_memory() -> None:
    named = _named()
    for b in pack_buckets(named, bucket_bytes=1 << 20):
        payload = deserialize_payload(serialize_bucket(b))
        assert isinstance(payload, WireBucket)  # SGLang's layout: uint8 buffer, byte offsets
        assert payload.flat.dtype == torch.uint8
        for (n1, t1), (n2, t2) in zip(payload.named_views(), b.named_views(), strict=True):
            assert n1 == n2 and torch.equal(t1, t2)
    plain = deserialize_payload(serialize_named_tensors(named[:2]))
    assert isinstance(plain, list) and [n for n, _ in plain] == ["a", "b"]


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned > /tmp/rollsafe-pwned",))


def test_restricted_unpickler_refuses_arbitrary_globals() -> None:
    evil = base64.b64encode(pickle.dumps({"flattened_tensor": _Evil(), "metadata": []})).decode()
    with pytest.raises(BucketFormatError, match="not allowed"):
        deserialize_payload(evil)
    with pytest.raises(BucketFormatError, match="base64"):
        deserialize_payload("not base64 !!!")


def test_bucket_metadata_mismatch_is_named() -> None:
    flat = torch.zeros(6)
    bad = FlatBucket(flat, (TensorMeta("w", "float32", (2, 2), 0, 4),))
    with pytest.raises(BucketFormatError, match="covers 4 elements"):
        bad.validate()
    bad2 = FlatBucket(flat, (TensorMeta("w", "bfloat16", (2, 3), 0, 6),))
    with pytest.raises(BucketFormatError, match="'w'"):
        bad2.validate()


def test_checksum_is_canonical() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())
    # as upstream's checkers: only the bytes count, not shape or dtype
    assert tensor_digest(t) == tensor_digest(t.view(4, 3))
    assert tensor_digest(t) != tensor_digest(t.to(torch.float64))  # other bytes
    a = weights_checksum({"x": t, "y": t + 1})
    b = weights_checksum([("y", t + 1), ("x", t)])
    assert a == b and set(a["tensors"]) == {"x", "y"}
    assert weights_checksum({"x": t, "y": t})["model"] != a["model"]
    with pytest.raises(ValueError, match="'x' appears twice"):
        weights_checksum([("x", t), ("x", t)])


# ---- start-up and path checks of the reference engine (no engine process) -------------------
def test_check_dir_turns_os_errors_into_named_400s(tmp_path: Path) -> None:
    from rollsafe.adapters.reference_engine.errors import WeightUpdateError
    from rollsafe.adapters.reference_engine.weights import check_model_path, read_checkpoint_dir

    assert check_model_path(str(tmp_path)) == tmp_path
    long_path = "/" + "a" * 5000
    with pytest.raises(WeightUpdateError, match="File name too long") as info:
        check_model_path(long_path)
    assert "'/aaaa" in str(info.value) and "(5001 characters)" in str(info.value)
    assert len(str(info.value)) < 400  # the path is named, not dumped
    with pytest.raises(WeightUpdateError, match="File name too long"):
        read_checkpoint_dir(str(tmp_path / ("c" * 300)), {})
    with pytest.raises(WeightUpdateError, match="is not a directory"):
        check_model_path(str(tmp_path / "nul\0byte"))
    with pytest.raises(WeightUpdateError, match="non-empty path"):
        check_model_path(123)
    assert WeightUpdateError.status == 400


def test_check_dir_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe.adapters.reference_engine.errors import WeightUpdateError
    from rollsafe.adapters.reference_engine.weights import check_model_path

    def denied(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_dir", denied)
    with pytest.raises(WeightUpdateError, match="Permission denied") as info:
        check_model_path(str(tmp_path))
    assert str(tmp_path) in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_check_dir_unreadable_directory(tmp_path: Path) -> None:
    from rollsafe.adapters.reference_engine.errors import WeightUpdateError
    from rollsafe.adapters.reference_engine.weights import check_model_path

    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    locked.chmod(0)
    try:
        with pytest.raises(WeightUpdateError, match="Permission denied"):
            check_model_path(str(locked / "inner"))
    finally:
        locked.chmod(0o700)


def test_text_codec_errors_name_the_path(tmp_path: Path) -> None:
    from rollsafe.adapters.reference_engine.codec import TextCodec
    from rollsafe.adapters.reference_engine.errors import BadRequest, StartupError

    assert TextCodec(tmp_path).tokenizer is None  # optional in the model directory
    with pytest.raises(BadRequest, match="--tokenizer-path"):
        TextCodec(tmp_path).encode("hello")
    with pytest.raises(StartupError, match=r"has no tokenizer\.json"):
        TextCodec(tmp_path, required=True)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(StartupError, match="cannot be loaded as a tokenizer") as info:
        TextCodec(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_rank_start_options() -> None:
    from rollsafe.adapters.reference_engine.bootstrap import (
        START_FAULT_ENV,
        RankOptions,
        fork_is_safe,
        start_fault,
    )

    assert RankOptions("m").planned_start_method() == "fork"
    assert RankOptions("m", device="cuda").planned_start_method() == "spawn"
    assert RankOptions("m", start_method="spawn").planned_start_method() == "spawn"
    assert not fork_is_safe(RankOptions("m", device="cuda"))  # CUDA state never crosses a fork
    assert RankOptions("m", world_size=2, threads=3).torch_threads() == 3
    assert RankOptions("m", world_size=64).torch_threads() == 1
    env = {"ROLLSAFE_FAULT_INJECTION": "1", START_FAULT_ENV: "1:2.5, 2:fail"}
    assert start_fault(1, env) == "2.5" and start_fault(2, env) == "fail"
    assert start_fault(0, env) is None
    assert start_fault(1, {START_FAULT_ENV: "1:fail"}) is None  # needs fault injection on


def test_rank_setup_refuses_nccl_on_a_shared_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe.adapters.reference_engine.bootstrap import RankOptions
    from rollsafe.adapters.reference_engine.errors import StartupError
    from rollsafe.adapters.reference_engine.ranks import check_rank_setup, rank_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    shared = RankOptions("m", device="cuda", world_size=2, rank_backend="nccl")
    assert rank_devices(shared) == ["cuda:0", "cuda:0"]
    with pytest.raises(StartupError, match="NCCL refuses two ranks on one device"):
        check_rank_setup(shared)
    check_rank_setup(RankOptions("m", device="cuda", world_size=2))  # gloo: fine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_rank_setup(shared)  # one GPU per rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StartupError, match=r"torch\.cuda\.is_available"):
        check_rank_setup(RankOptions("m", device="cuda"))


# ---- the engine's weight-receiving path: stage views, one copy into the live weights ----
@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rollsafe.adapters.reference_engine.model import ShardedCausalLM, load_config
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-units"), seed=0)
    return ShardedCausalLM(load_config(path), rank=1, world_size=2)


def _snapshot(model: Any) -> dict[str, tuple[int, torch.Tensor]]:
    local = model.local_tensors()
    return {n: (t.data_ptr(), t.clone()) for n, t in local.items()}


def _new_values(model: Any, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    specs = model.specs
    return [(n, torch.randn(s.shape, generator=g).to(s.dtype)) for n, s in specs.items()]


def test_stage_keeps_views_and_commit_copies_once_in_place(tiny_lm: Any) -> None:
    from rollsafe.adapters.reference_engine.model import LM_HEAD

    model = tiny_lm
    before = _snapshot(model)
    new = _new_values(model, seed=1)
    model.stage(new, where="t")
    staged = model._staged
    for name, t in new:  # no copy while staging: the staged tensor is the source (or its rows)
        assert staged[name].data_ptr() == (
            t[model.row_start :].data_ptr() if name == LM_HEAD else t.data_ptr()
        )
    assert model.commit() == sorted(n for n, _ in new)
    assert model.staged_names == []  # no reference to the source is kept past the commit
    after = model.local_tensors()
    for name, t in new:
        want = t[model.row_start : model.row_end] if name == LM_HEAD else t
        assert after[name].data_ptr() == before[name][0]  # copied into the live storage
        assert torch.equal(after[name], want)


def test_one_bad_entry_stages_nothing_and_keeps_every_live_weight(tiny_lm: Any) -> None:
    from rollsafe.adapters.reference_engine.errors import WeightUpdateError

    model = tiny_lm
    before = weights_checksum(model.local_tensors())
    new = _new_values(model, seed=2)
    mid = len(new) // 2
    for bad in (
        (new[mid][0], torch.zeros(3, 3)),  # wrong shape
        (new[mid][0], new[mid][1].to(torch.float64)),  # wrong dtype
        ("model.nope.weight", torch.zeros(3)),  # unknown name
    ):
        with pytest.raises(WeightUpdateError, match=repr(bad[0])):
            model.stage([*new[:mid], bad, *new[mid + 1 :]], where="t")
        assert model.staged_names == []
        assert model.commit() == []
        assert weights_checksum(model.local_tensors()) == before


class _FakeGroup:
    """A receiving weight-update group: fills every broadcast tensor with ``value``; raises
    after ``fail_after`` broadcasts when set."""

    def __init__(self, value: float, fail_after: int | None = None) -> None:
        self.value = value
        self.fail_after = fail_after
        self.calls = 0

    def broadcast(self, t: torch.Tensor, root: int) -> Any:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("peer gone mid-broadcast")
        self.calls += 1
        t.fill_(self.value)
        return self

    def wait(self) -> None:
        return None


def test_receive_broadcast_reuses_its_buffer_and_drops_it_on_failure(tiny_lm: Any) -> None:
    from rollsafe.adapters.reference_engine.weights import ReceiveBuffers, receive_broadcast

    model = tiny_lm
    meta = [(n, s.shape, s.dtype) for n, s in model.specs.items()][:5]
    bufs = ReceiveBuffers()
    cpu = torch.device("cpu")
    first = receive_broadcast(_FakeGroup(1.0), meta, flattened=False, device=cpu, buffers=bufs)
    ptr = first[0][1].data_ptr()
    second = receive_broadcast(_FakeGroup(2.0), meta, flattened=False, device=cpu, buffers=bufs)
    assert second[0][1].data_ptr() == ptr  # same memory: nothing allocated for the second call
    assert all(
        bool((t == 2.0).all()) and tuple(t.shape) == s
        for (_, t), (_, s, _) in zip(second, meta, strict=True)
    )
    # flattened calls receive SGLang's uint8 layout: one kept byte buffer, reused when smaller
    packed = receive_broadcast(_FakeGroup(3.0), meta, flattened=True, device=cpu, buffers=bufs)
    u8 = packed[0][1].data_ptr()
    assert u8 != ptr and [n for n, _ in packed] == [n for n, _, _ in meta]
    smaller = receive_broadcast(_FakeGroup(3.0), meta[:2], flattened=True, device=cpu, buffers=bufs)
    assert smaller[0][1].data_ptr() == u8 and bufs.nbytes > 0
    # a broadcast that fails half way: nothing staged, live weights untouched, buffer dropped
    before = weights_checksum(model.local_tensors())
    with pytest.raises(RuntimeError, match="mid-broadcast"):
        receive_broadcast(
            _FakeGroup(4.0, fail_after=2), meta, flattened=False, device=cpu, buffers=bufs
        )
    u8_bytes = sum(t.numel() * t.element_size() for _, t in packed)
    assert bufs.nbytes == u8_bytes and model.staged_names == []  # the float32 buffer is gone
    assert weights_checksum(model.local_tensors()) == before


class _FakeEvent:
    """Stands for the CUDA event a commit's copies end at: ``done`` says whether they ended."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_receive_buffers_keep_a_slot_reserved_until_its_copies_end() -> None:
    from rollsafe.adapters.reference_engine.weights import ReceiveBuffers

    cpu = torch.device("cpu")
    bufs = ReceiveBuffers(slots=2)
    a = bufs.get(100, torch.float32, cpu)
    copying_a = _FakeEvent()
    bufs.mark_read(copying_a)  # call 1 answered with its copies still queued
    b = bufs.get(100, torch.float32, cpu)
    assert b.data_ptr() != a.data_ptr() and bufs.buffers == 2  # call 2 takes the other slot
    copying_b = _FakeEvent()
    bufs.mark_read(copying_b)
    copying_a.done = True  # call 1's copies ended while call 2 was received
    c = bufs.get(100, torch.float32, cpu)
    assert c.data_ptr() == a.data_ptr() and copying_a.waited == 0 and bufs.buffers == 2
    copying_c = _FakeEvent()
    bufs.mark_read(copying_c)
    # both slots still read: call 4 waits for the oldest (call 2's), on the host without a stream
    d = bufs.get(100, torch.float32, cpu)
    assert d.data_ptr() == b.data_ptr() and copying_b.waited == 1 and copying_c.waited == 0
    bufs.mark_read(None)  # a synced commit: free at once
    e = bufs.get(50, torch.float32, cpu)
    assert e.data_ptr() == b.data_ptr() and bufs.buffers == 2
    bufs.mark_read(None)
    # a slot that is free but too small is grown only when no free slot fits
    copying_c.done = True
    big = bufs.get(200, torch.float32, cpu)
    assert big.numel() == 200 and bufs.buffers == 2
    bufs.drop(torch.float32, cpu)
    assert bufs.buffers == 0 and bufs.nbytes == 0
    one = ReceiveBuffers(slots=1)  # one slot: a busy buffer is waited for, never doubled
    x = one.get(10, torch.float32, cpu)
    busy = _FakeEvent()
    one.mark_read(busy)
    assert one.get(10, torch.float32, cpu).data_ptr() == x.data_ptr() and busy.waited == 1


def test_shared_mappings_keep_the_last_buckets_mapped() -> None:
    from rollsafe.adapters.reference_engine.weights import SharedMappings, decode_tensor_entry

    buckets = list(pack_buckets(_named()[:1] + _named()[2:3], bucket_bytes=1 << 20))
    assert len(buckets) == 1
    entry = serialize_bucket(buckets[0])
    maps = SharedMappings(keep=2)
    first = decode_tensor_entry(entry, rank=0, mappings=maps)
    ptr = first[0][1].untyped_storage().data_ptr()
    del first
    assert maps.nbytes == buckets[0].nbytes
    again = decode_tensor_entry(serialize_bucket(buckets[0]), rank=0, mappings=maps)
    assert again[0][1].untyped_storage().data_ptr() == ptr  # the mapping was reused
    others = list(pack_buckets(_named()[3:], bucket_bytes=1 << 20))
    assert len(others) == 2
    for b in others * 2:
        decode_tensor_entry(serialize_bucket(b), rank=0, mappings=maps)
    assert len(maps._storages) <= 2
    maps.clear()
    assert maps.nbytes == 0


# ---- stop rules: the cases a greedy tiny model does not reach (stops.py) ---------------------
@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rollsafe.adapters.reference_engine.codec import TextCodec
    from rollsafe.adapters.reference_engine.tiny_model import make_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer().save(str(path / "tokenizer.json"))  # type: ignore[attr-defined]
    return TextCodec(path)


EOS = 2
PROMPT_IDS = [1, 17, 42]


def _run(rules: Any, ids: list[int], **sampling: Any) -> tuple[Any, list[int], Any]:
    """Feed ``ids`` to a generation under ``rules`` until it ends: (finish, output, text)."""
    from rollsafe.adapters.reference_engine.engine import SamplingParams

    params = SamplingParams(max_new_tokens=sampling.pop("max_new_tokens", 64), **sampling)
    scan = rules.scan(PROMPT_IDS, params, (EOS,))
    out: list[int] = []
    for token in ids:
        assert token not in scan.banned(len(out))
        out.append(token)
        finish = scan.after(out)
        if finish is not None:
            return finish, out, scan.text(out, finish)
    raise AssertionError("the generation did not end")


def _ids(codec: Any, *pieces: str) -> list[int]:
    return [codec.tokenizer.token_to_id(p) for p in pieces]


def test_eos_is_reported_as_each_release_reports_it(codec: Any) -> None:
    """SGLang: ``matched`` is the EOS id; vLLM: ``stop_reason`` null (EOS is no stop token id);
    with ``ignore_eos`` both go on past it, and SGLang also past a stop token id."""
    from rollsafe.adapters.reference_engine.stops import SGLangStops, VLLMStops

    ids = [*_ids(codec, "w", "o"), EOS, *_ids(codec, "r", "l")]
    sglang = SGLangStops(decode=codec.decode)
    vllm = VLLMStops(stream=codec.decode_stream)
    assert _run(sglang, ids) == ({"type": "stop", "matched": EOS}, ids[:3], "wo")
    assert _run(vllm, ids) == ({"type": "stop", "matched": None}, ids[:3], "wo")
    stop_id = ids[3]
    finish, out, _ = _run(sglang, ids, ignore_eos=True, stop_token_ids=(stop_id,), max_new_tokens=5)
    assert (finish, out) == ({"type": "length", "length": 5}, ids)
    finish, out, text = _run(vllm, ids, ignore_eos=True, stop_token_ids=(stop_id,))
    assert (finish, out, text) == ({"type": "stop", "matched": stop_id}, ids[:4], "wo")
    # the minimum of new tokens bans EOS and the stop token ids, ignore_eos or not
    from rollsafe.adapters.reference_engine.engine import SamplingParams

    params = SamplingParams(min_new_tokens=2, stop_token_ids=(stop_id,), ignore_eos=True)
    for rules in (sglang, vllm):
        scan = rules.scan(PROMPT_IDS, params, (EOS,))
        assert list(scan.banned(1)) == sorted({EOS, stop_id}) and not scan.banned(2)


def test_sglang_looks_for_a_stop_string_in_a_tail_of_tokens_only(codec: Any) -> None:
    """``" wor"`` is one token of the vocabulary, so SGLang decodes the last two tokens to look
    for it: spelt in two tokens it ends the generation, spelt in three it is never seen. vLLM
    looks in the text and finds it either way."""
    from rollsafe.adapters.reference_engine.stops import SGLangStops, VLLMStops

    assert codec.token_count(" wor") == 1
    sglang = SGLangStops(strings=(" wor",), longest=1, decode=codec.decode)
    vllm = VLLMStops(strings=(" wor",), stream=codec.decode_stream)
    two = [*_ids(codec, "x", "\u0120w", "or", "l"), EOS]
    three = [*_ids(codec, "x", "\u0120w", "o", "r", "l"), EOS]
    assert _run(sglang, two) == ({"type": "stop", "matched": " wor"}, two[:3], "x")
    assert _run(sglang, three)[0] == {"type": "stop", "matched": EOS}
    for ids in (two, three):
        assert _run(vllm, ids) == ({"type": "stop", "matched": " wor"}, ids[: len(ids) - 2], "x")


def test_sglang_takes_an_empty_stop_string_and_holds_a_forming_one(codec: Any) -> None:
    """An empty stop string is in every text: SGLang ends after the first token (vLLM refuses
    it, tests/test_engine_vllm.py). A stream event waits while the tail ends with the start of
    a stop string."""
    from rollsafe.adapters.reference_engine.stops import SGLangStops

    ids = _ids(codec, "w", "o", "r")
    assert _run(SGLangStops(strings=("",), decode=codec.decode), ids) == (
        {"type": "stop", "matched": ""},
        ids[:1],
        "",
    )
    rules = SGLangStops(strings=("ork",), longest=2, decode=codec.decode)
    assert [rules.holds(ids[:n]) for n in (1, 2, 3)] == [False, True, True]


def test_vllm_holds_back_an_incomplete_character_and_the_stop_string_length(codec: Any) -> None:
    """The text grows token by token after the prompt: the first byte of a two-byte character
    adds nothing until the second arrives; a stream shows all but the longest stop string's
    length minus one until the end."""
    from rollsafe.adapters.reference_engine.stops import VLLMStops, VLLMText

    first, second = codec.tokenizer.encode("\u00e9").ids
    text = VLLMText(VLLMStops(strings=("xyz", "q"), stream=codec.decode_stream), PROMPT_IDS, 0)
    text.add(first)
    assert (text.text, text.shown()) == ("", "")
    text.add(second)
    assert (text.text, text.shown()) == ("\u00e9", "")
    for token in _ids(codec, "w", "o"):
        text.add(token)
    assert (text.text, text.shown()) == ("\u00e9wo", "\u00e9")


def _sglang_req(req_cls: Any, codec: Any, sp: Any) -> Any:
    """A ``Req`` of SGLang's own stop methods (tests/sglang_decoder.py) set up as the scheduler
    sets one up for a decode without speculation, grammar or regex."""
    from types import SimpleNamespace

    req = req_cls()
    req.sampling_params = sp
    req.tokenizer = SimpleNamespace(
        decode=lambda ids: codec.decode(list(ids), False),  # HF decode's default
        eos_token_id=EOS,
        additional_stop_token_ids=None,
    )
    req.eos_token_ids = {EOS}
    req.vocab_size = codec.tokenizer.get_vocab_size()
    req.output_ids, req.decoded_text, req.rid, req.grammar = [], "", "r", None
    req.finished_reason = req.finished_len = req.to_finish = None
    return req


def test_sglang_stop_rules_agree_with_sglangs_own_code(codec: Any) -> None:
    """Random outputs under random stop strings, stop token ids, ``ignore_eos`` and
    ``no_stop_trim``: the reference engine's SGLang rules end each where SGLang 0.5.23's own
    ``Req.update_finish_state`` does, with the same finish reason, the same output ids, the
    text its detokenizer's ``trim_matched_stop`` gives, and the same stream holds
    (``check_match_stop_str_prefix``)."""
    import random
    from types import SimpleNamespace

    from sglang_decoder import load_stop_checks

    from rollsafe.adapters.reference_engine.engine import SamplingParams
    from rollsafe.adapters.reference_engine.stops import SGLangStops

    req_cls, trim = load_stop_checks()
    detok = SimpleNamespace(is_tool_call_parser_gpt_oss=False, tool_close_token_ids=set())
    rng = random.Random(7)
    vocab = codec.tokenizer.get_vocab_size()
    ended_by = {"str": 0, "int": 0, "length": 0}
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        full = codec.decode(ids, False)
        strings = []
        for _ in range(rng.randint(0, 3)):
            if full and rng.random() < 0.8:
                at = rng.randrange(len(full))
                strings.append(full[at : at + rng.randint(1, 5)])
            else:
                strings.append(rng.choice(["the", "</s>", "e", "zz"]))
        stop_ids = tuple(rng.sample(ids, k=min(len(ids), rng.randint(0, 2))))
        ignore_eos, keep = rng.random() < 0.3, rng.random() < 0.5
        max_new = rng.randint(1, len(ids))
        longest = max((codec.token_count(x) for x in strings), default=0)
        sp = SimpleNamespace(
            stop_strs=list(strings),
            stop_str_max_len=longest,
            stop_regex_strs=[],
            stop_regex_max_len=0,
            ignore_eos=ignore_eos,
            stop_token_ids=set(stop_ids) or None,
            max_new_tokens=max_new,
        )
        req, holds = _sglang_req(req_cls, codec, sp), []
        for token in ids:
            req.output_ids.append(token)
            req.update_finish_state()
            if req.finished():
                break
            holds.append(req.check_match_stop_str_prefix())
        finish = req.finished_reason.to_json()
        out_ids = list(req.output_ids_through_stop)
        text = trim(detok, codec.decode(trim(detok, out_ids, finish, keep), True), finish, keep)

        rules = SGLangStops(
            strings=tuple(strings), no_stop_trim=keep, longest=longest, decode=codec.decode
        )
        params = SamplingParams(
            max_new_tokens=max_new, stop_token_ids=stop_ids, ignore_eos=ignore_eos, stops=rules
        )
        scan, out = rules.scan([1], params, (EOS,)), []
        for token in ids:
            out.append(token)
            mine = scan.after(out)
            if mine is not None:
                break
            assert rules.holds(out) == holds[len(out) - 1], (strings, out)
        case = (strings, stop_ids, ignore_eos, keep, ids[: len(out)])
        assert (mine, out, scan.text(out, mine)) == (finish, out_ids, text), case
        kind = type(finish.get("matched")).__name__ if finish["type"] == "stop" else "length"
        ended_by[kind] += 1
    assert min(ended_by.values()) >= 40, ended_by  # every way of ending was exercised
