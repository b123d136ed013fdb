"""The delta wire format (``rollsafe.wire.delta``): exact round trips, the dense fallback and
every refusal named (base, format, digest), inputs never mutated; on CPU and, if present, CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

from rollsafe.checksum import tensor_digest
from rollsafe.wire.delta import (
    DELTA_HEADER_KEY,
    DENSE_FRACTION,
    IDX_SUFFIX,
    VAL_SUFFIX,
    DeltaBaseMismatch,
    DeltaDigestMismatch,
    DeltaError,
    DeltaFormatError,
    DeltaHeader,
    apply_delta,
    check_base_digests,
    encode_delta,
    is_delta,
    lin64_digest,
)

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(width)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _model(dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (64, 32), "b.weight": (128,), "c.bias": (7, 3, 5), "d.scalar": ()}
    return {n: torch.randn(s, generator=g).to(dtype).to(device) for n, s in shapes.items()}


def _step(model: dict[str, torch.Tensor], frac: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy of ``model`` with about ``frac`` of the elements of a.weight and c.bias changed."""
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in model.items()}
    for name in ("a.weight", "c.bias"):
        flat = out[name].view(-1)
        k = max(1, int(frac * flat.numel()))
        pick = torch.randperm(flat.numel(), generator=g)[:k].to(flat.device)
        flat[pick] = (flat[pick].float() + 0.5).to(flat.dtype)
    return out


def _snapshot(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in d.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_round_trip_is_bit_exact_and_omits_unchanged_tensors(
    dtype: torch.dtype, device: str
) -> None:
    base = _model(dtype, device)
    new = _step(base, 0.02)
    payload = encode_delta(base, new, base_version=3, version=4)
    names = [n for n, _ in payload.tensors]
    assert names[0] == DELTA_HEADER_KEY and is_delta(names)
    assert payload.header.base_version == "3" and payload.header.version == "4"
    assert set(payload.header.sparse) == {"a.weight", "c.bias"} and payload.header.dense == ()
    assert "b.weight" not in names and "d.scalar" not in names  # unchanged: not sent
    assert all(t.device.type == device for _, t in payload.tensors)
    assert payload.tensors[1][1].dtype == torch.int32
    assert payload.worthwhile and payload.nbytes < payload.full_nbytes
    assert payload.total_elements == sum(t.numel() for t in base.values())
    assert payload.changed_elements == sum(
        int((_bits(base[n]) != _bits(new[n])).sum()) for n in base
    )
    out = apply_delta(base, payload.tensors, current_version="3")
    assert set(out) == {"a.weight", "c.bias"}
    for name, t in out.items():
        assert _same_bits(t, new[name]) and t.device == new[name].device
        # the sender's device picks the digest: one-pass lin64 on CUDA, SHA-256 on the host
        if new[name].is_cuda:
            assert payload.header.algorithm == "rollsafe-lin64"
            assert payload.header.digests[name] == lin64_digest(new[name])
        else:
            assert payload.header.algorithm == "sglang-cpu"
            assert payload.header.digests[name] == tensor_digest(new[name], "sglang-cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_signed_zero_bit_patterns_are_changes(dtype: torch.dtype, device: str) -> None:
    width = {2: torch.int16, 4: torch.int32}[torch.empty((), dtype=dtype).element_size()]
    base = torch.zeros(16, dtype=dtype, device=device)
    base[3] = float("nan")
    new = base.clone()
    new[0] = -0.0  # == 0.0 as floats, a different bit pattern
    new.view(width)[3] ^= 1  # another NaN payload: NaN != NaN either way, bits differ here
    new.view(width)[5] = base.view(width)[3]  # a NaN where there was 0.0
    payload = encode_delta({"w": base}, {"w": new}, base_version=1, version=2)
    assert payload.changed_elements == 3
    idx = dict(payload.tensors)["w" + IDX_SUFFIX]
    assert idx.tolist() == [0, 3, 5]
    out = apply_delta({"w": base}, payload.tensors, current_version="1")
    assert _same_bits(out["w"], new)


@pytest.mark.parametrize("device", DEVICES)
def test_other_dtypes_compare_by_bits(device: str) -> None:
    base = {
        "i8": torch.arange(10, dtype=torch.int8, device=device),
        "b": torch.zeros(10, dtype=torch.bool, device=device),
        "f64": torch.zeros(10, dtype=torch.float64, device=device),
    }
    new = _snapshot(base)
    new["i8"][2] = -1
    new["b"][4] = True
    new["f64"][9] = -0.0
    payload = encode_delta(base, new, base_version=1, version=2)
    assert payload.changed_elements == 3
    out = apply_delta(base, payload.tensors, current_version="1")
    assert all(_same_bits(out[n], new[n]) for n in base)


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_changed_past_the_threshold_goes_dense(device: str) -> None:
    base = _model(torch.bfloat16, device)
    new = _snapshot(base)
    new["b.weight"] = new["b.weight"] + 1  # every element
    new["a.weight"].view(-1)[:5] += 1  # a few
    payload = encode_delta(base, new, base_version="7", version="8")
    assert payload.header.dense == ("b.weight",) and payload.header.sparse == ("a.weight",)
    wire = dict(payload.tensors)
    assert wire["b.weight"] is not None and _same_bits(wire["b.weight"], new["b.weight"])
    out = apply_delta(base, payload.tensors, current_version="7")
    assert _same_bits(out["b.weight"], new["b.weight"])
    assert _same_bits(out["a.weight"], new["a.weight"])
    # the dense result is a copy: it shares no memory with the received tensor
    assert out["b.weight"].data_ptr() != wire["b.weight"].data_ptr()


def test_dense_fraction_picks_the_form_and_worthwhile_compares_bytes() -> None:
    base = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][:100] = 1  # 10 %
    assert encode_delta(base, new, base_version=1, version=2, dense_fraction=0.05).header.dense
    sparse = encode_delta(base, new, base_version=1, version=2, dense_fraction=0.5)
    assert sparse.header.sparse == ("w",) and sparse.worthwhile
    # sparse pairs never cost more than the tensor itself: at 40 % bf16 goes dense anyway
    new["w"][:400] = 1
    assert encode_delta(base, new, base_version=1, version=2, dense_fraction=1.0).header.dense
    # everything changed: the delta (every tensor dense + header) is not smaller than full
    new["w"][:] = 2
    full = encode_delta(base, new, base_version=1, version=2)
    assert not full.worthwhile and full.nbytes > full.full_nbytes
    assert 0 < DENSE_FRACTION < 1 / 3  # below the bf16 byte break-even (2 / (2 + 4))


def test_nothing_changed_is_an_empty_delta_that_applies() -> None:
    base = _model(torch.float32, "cpu")
    payload = encode_delta(base, _snapshot(base), base_version=1, version=2)
    assert [n for n, _ in payload.tensors] == [DELTA_HEADER_KEY]
    assert payload.changed_elements == 0 and payload.worthwhile
    assert apply_delta(base, payload.tensors, current_version="1") == {}


def test_the_wrong_base_is_refused_naming_both_versions() -> None:
    base = _model(torch.bfloat16, "cpu")
    payload = encode_delta(base, _step(base, 0.05), base_version=3, version=4)
    with pytest.raises(DeltaBaseMismatch) as err:
        apply_delta(base, payload.tensors, current_version="2")
    assert err.value.expected == "3" and err.value.actual == "2" and err.value.key is None
    assert "v3" in str(err.value) and "v2" in str(err.value)
    assert isinstance(err.value, DeltaError) and isinstance(err.value, ValueError)


def test_a_tampered_value_fails_the_digest_naming_the_key() -> None:
    base = _model(torch.bfloat16, "cpu")
    payload = encode_delta(base, _step(base, 0.05), base_version=3, version=4)
    wire = [(n, t.clone()) for n, t in payload.tensors]
    val = dict(wire)["c.bias" + VAL_SUFFIX]
    val[0] = val[0] + 1
    with pytest.raises(DeltaDigestMismatch) as err:
        apply_delta(base, wire, current_version="3")
    assert err.value.key == "c.bias" and "'c.bias'" in str(err.value)


def test_a_delta_onto_other_weights_with_the_right_label_fails_the_digest() -> None:
    base = _model(torch.bfloat16, "cpu")
    payload = encode_delta(base, _step(base, 0.05), base_version=3, version=4)
    drifted = _snapshot(base)
    drifted["a.weight"].view(-1)[-1] += 1  # the receiver's v3 is not the sender's v3
    with pytest.raises(DeltaDigestMismatch) as err:
        apply_delta(drifted, payload.tensors, current_version="3")
    assert err.value.key == "a.weight"


def _payload() -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    base = _model(torch.bfloat16, "cpu")
    new = _step(base, 0.05)
    new["b.weight"] = new["b.weight"] + 1  # dense
    return base, [
        (n, t.clone()) for n, t in encode_delta(base, new, base_version=1, version=2).tensors
    ]


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        # an index out of range
        (
            lambda w: w.__setitem__(_at(w, "a.weight" + IDX_SUFFIX), _idx(w, "a.weight", 10**6)),
            "a.weight",
        ),
        # indices not ascending
        (lambda w: w.__setitem__(_at(w, "c.bias" + IDX_SUFFIX), _flip(w, "c.bias")), "c.bias"),
        # a negative index
        (
            lambda w: w.__setitem__(_at(w, "a.weight" + IDX_SUFFIX), _idx(w, "a.weight", -1, 0)),
            "a.weight",
        ),
        # half of a pair missing
        (lambda w: w.pop(_at(w, "c.bias" + VAL_SUFFIX)), "c.bias"),
        # a dense tensor missing
        (lambda w: w.pop(_at(w, "b.weight")), "b.weight"),
        # a name the header does not list
        (lambda w: w.append(("zzz", torch.zeros(3))), "zzz"),
        # a value tensor of the wrong dtype
        (
            lambda w: w.__setitem__(
                _at(w, "a.weight" + VAL_SUFFIX),
                ("a.weight" + VAL_SUFFIX, dict(w)["a.weight" + VAL_SUFFIX].float()),
            ),
            "a.weight",
        ),
        # values and indices of different lengths
        (
            lambda w: w.__setitem__(
                _at(w, "a.weight" + VAL_SUFFIX),
                ("a.weight" + VAL_SUFFIX, dict(w)["a.weight" + VAL_SUFFIX][1:]),
            ),
            "a.weight",
        ),
        # a dense tensor of the wrong shape
        (
            lambda w: w.__setitem__(_at(w, "b.weight"), ("b.weight", dict(w)["b.weight"][:-1])),
            "b.weight",
        ),
        # a name received twice
        (lambda w: w.append(w[_at(w, "b.weight")]), "b.weight"),
        # two headers
        (lambda w: w.append(w[0]), DELTA_HEADER_KEY),
        # no header at all
        (lambda w: w.pop(0), DELTA_HEADER_KEY),
    ],
)
def test_malformed_payloads_are_refused_naming_the_key(mutate: object, key: str) -> None:
    base, wire = _payload()
    before = _snapshot(base)
    mutate(wire)  # type: ignore[operator]
    with pytest.raises(DeltaFormatError) as err:
        apply_delta(base, wire, current_version="1")
    assert err.value.key == key and key in str(err.value)
    assert all(_same_bits(base[n], before[n]) for n in base)


def _at(wire: list[tuple[str, torch.Tensor]], name: str) -> int:
    return next(i for i, (n, _) in enumerate(wire) if n == name)


def _idx(
    wire: list[tuple[str, torch.Tensor]], name: str, value: int, pos: int = -1
) -> tuple[str, torch.Tensor]:
    idx = dict(wire)[name + IDX_SUFFIX].clone()
    idx[pos] = value
    return name + IDX_SUFFIX, idx


def _flip(wire: list[tuple[str, torch.Tensor]], name: str) -> tuple[str, torch.Tensor]:
    return name + IDX_SUFFIX, dict(wire)[name + IDX_SUFFIX].flip(0).contiguous()


def test_a_weight_the_receiver_does_not_have_is_refused_naming_it() -> None:
    base, wire = _payload()
    smaller = {n: t for n, t in base.items() if n != "c.bias"}
    with pytest.raises(DeltaFormatError) as err:
        apply_delta(smaller, wire, current_version="1")
    assert err.value.key == "c.bias"


def test_a_sparse_pair_onto_a_weight_of_another_dtype_is_refused() -> None:
    base, wire = _payload()
    other = {**base, "a.weight": base["a.weight"].float()}
    with pytest.raises(DeltaFormatError) as err:
        apply_delta(other, wire, current_version="1")
    assert err.value.key == "a.weight"


def test_encode_refuses_mismatched_inputs_naming_the_key() -> None:
    base = _model(torch.bfloat16, "cpu")
    new = _snapshot(base)
    new["a.weight"] = new["a.weight"].float()
    with pytest.raises(DeltaFormatError) as err:
        encode_delta(base, new, base_version=1, version=2)
    assert err.value.key == "a.weight"
    del new["a.weight"]
    with pytest.raises(DeltaFormatError) as err:
        encode_delta(base, new, base_version=1, version=2)
    assert err.value.key == "a.weight"
    with pytest.raises(DeltaFormatError) as err:
        encode_delta(base, {**base, DELTA_HEADER_KEY: torch.zeros(1)}, base_version=1, version=2)
    assert err.value.key == DELTA_HEADER_KEY


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_are_never_mutated(device: str) -> None:
    base = _model(torch.bfloat16, device)
    new = _step(base, 0.05)
    new["b.weight"] = new["b.weight"] + 1
    base_before, new_before = _snapshot(base), _snapshot(new)
    payload = encode_delta(base, new, base_version=1, version=2)
    wire_before = [(n, t.clone()) for n, t in payload.tensors]
    out = apply_delta(base, payload.tensors, current_version="1")
    for name in base:
        assert _same_bits(base[name], base_before[name])
        assert _same_bits(new[name], new_before[name])
    for (n, t), (_, t0) in zip(payload.tensors, wire_before, strict=True):
        assert _same_bits(t, t0), n
    base_ptrs = {t.untyped_storage().data_ptr() for t in base.values()}
    wire_ptrs = {t.untyped_storage().data_ptr() for _, t in payload.tensors}
    assert not {t.untyped_storage().data_ptr() for t in out.values()} & (base_ptrs | wire_ptrs)


def test_the_header_round_trips_and_bad_headers_are_named() -> None:
    header = DeltaHeader(
        base_version="12",
        version="13",
        digests={"a": "00ff", "b": "0a0b"},
        sparse=("a",),
        dense=("b",),
    )
    t = header.to_tensor()
    assert t.dtype == torch.uint8 and t.dim() == 1
    assert DeltaHeader.from_tensor(t) == header
    doc = json.loads(bytes(t.tolist()))

    def enc(d: object) -> torch.Tensor:
        return torch.tensor(list(json.dumps(d).encode()), dtype=torch.uint8)

    bad = [
        torch.zeros(3, dtype=torch.int32),  # not uint8
        torch.tensor(list(b"\xff\xfe"), dtype=torch.uint8),  # not UTF-8
        torch.tensor(list(b"[1, 2]"), dtype=torch.uint8),  # not an object
        enc({**doc, "format": "other/9"}),
        enc({**doc, "digest": "vllm"}),
        enc({**doc, "base_version": 12}),
        enc({**doc, "sparse": ["a", "a"]}),
        enc({**doc, "dense": ["a"]}),  # both sparse and dense; b has a digest but is not touched
        enc({**doc, "digests": {"a": "00ff"}}),  # b is touched but has no digest
        enc({**doc, "sparse": ["a" + IDX_SUFFIX], "digests": {"a" + IDX_SUFFIX: "1", "b": "2"}}),
    ]
    for t in bad:
        with pytest.raises(DeltaFormatError) as err:
            DeltaHeader.from_tensor(t)
        assert err.value.key == DELTA_HEADER_KEY


def test_indices_are_int64_from_2_31_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe.wire import delta

    assert delta._INT64_INDEX_NUMEL == 2**31
    base = _model(torch.bfloat16, "cpu")
    new = _step(base, 0.05)
    monkeypatch.setattr(delta, "_INT64_INDEX_NUMEL", 1000)  # a.weight (2048) is "large"
    payload = encode_delta(base, new, base_version=1, version=2)
    wire = dict(payload.tensors)
    assert wire["a.weight" + IDX_SUFFIX].dtype == torch.int64
    assert wire["c.bias" + IDX_SUFFIX].dtype == torch.int32  # 105 elements: still int32
    out = apply_delta(base, payload.tensors, current_version="1")
    assert _same_bits(out["a.weight"], new["a.weight"])


@settings(max_examples=examples(60), deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    n=st.integers(1, 300),
    changes=st.lists(st.tuples(st.integers(0, 299), st.integers(0, 2**16 - 1)), max_size=120),
    dense_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_any_change_round_trips_exactly(
    dtype: torch.dtype,
    n: int,
    changes: list[tuple[int, int]],
    dense_fraction: float,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(n, generator=g).to(dtype), "u": torch.randn(3).to(dtype)}
    new = _snapshot(base)
    bits = _bits(new["w"])
    signed16 = bits.dtype == torch.int16
    for pos, raw in changes:
        if pos < n:  # any 16-bit pattern (NaNs, infinities, -0.0 included)
            bits[pos] = raw - 2**16 if signed16 and raw >= 2**15 else raw
    payload = encode_delta(base, new, base_version=5, version=6, dense_fraction=dense_fraction)
    differs = int((_bits(base["w"]) != _bits(new["w"])).sum())
    assert payload.changed_elements == differs
    assert ("w" in payload.header.touched) == (differs > 0)
    assert "u" not in payload.header.touched
    out = apply_delta(base, payload.tensors, current_version="5")
    result = {**base, **out}
    assert all(_same_bits(result[k], new[k]) for k in base)


@pytest.mark.parametrize("device", DEVICES)
def test_lin64_sees_any_changed_or_moved_word_and_is_the_same_on_every_device(
    device: str,
) -> None:
    gen = torch.Generator().manual_seed(9)
    t = torch.randn(3 * 1024 + 5, generator=gen).to(torch.bfloat16)
    want = lin64_digest(t)
    assert want == lin64_digest(t.clone()) and len(want) == 16
    on = t.to(device)
    assert lin64_digest(on) == want  # integer ops only: the same value on CPU and CUDA
    seen = {want}
    for pos in (0, 1, 1023, 1024, 2048 + 7, t.numel() - 1):  # one element, any row
        bumped = on.clone()
        bumped.view(torch.int16)[pos] ^= 1
        seen.add(lin64_digest(bumped))
    swapped = on.clone()
    swapped[[3, 1500]] = on[[1500, 3]]  # two elements trade places (other rows)
    seen.add(lin64_digest(swapped))
    within = on.clone()
    within[[10, 11]] = on[[11, 10]]  # and within one row
    seen.add(lin64_digest(within))
    assert len(seen) == 9, seen
    # the byte count is part of it: a trailing zero element is not nothing
    assert lin64_digest(torch.zeros(4, dtype=torch.bfloat16, device=device)) != lin64_digest(
        torch.zeros(6, dtype=torch.bfloat16, device=device)
    )


def test_a_header_naming_sglang_digests_is_still_checked() -> None:
    base = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][5] = 1.0
    payload = encode_delta(base, new, base_version=1, version=2)
    header = payload.header
    sglang = DeltaHeader(
        base_version=header.base_version,
        version=header.version,
        digests={"w": tensor_digest(new["w"], "sglang-cpu")},
        sparse=header.sparse,
        dense=header.dense,
        algorithm="sglang-cpu",
    )
    received = [(DELTA_HEADER_KEY, sglang.to_tensor()), *payload.tensors[1:]]
    out = apply_delta(base, received, current_version="1")
    assert torch.equal(out["w"], new["w"])
    wrong = DeltaHeader(**{**sglang.__dict__, "digests": {"w": "0" * 16}})
    with pytest.raises(DeltaDigestMismatch) as err:
        apply_delta(
            base, [(DELTA_HEADER_KEY, wrong.to_tensor()), *payload.tensors[1:]], current_version="1"
        )
    assert err.value.key == "w"


# ---------------------------------------------------------------------- base checked by content
@pytest.mark.parametrize("device", DEVICES)
def test_a_receiver_without_a_version_checks_the_base_by_content(device: str) -> None:
    """``base_digests=True`` writes each touched name's base digest; ``current_version=None``
    checks them instead of the label and applies exactly."""
    base = _model(torch.bfloat16, device)
    new = _step(base, 0.05)
    payload = encode_delta(base, new, base_version=3, version=4, base_digests=True)
    header = payload.header
    assert header.base_digests is not None
    assert set(header.base_digests) == set(header.touched) == {"a.weight", "c.bias"}
    for name in header.touched:
        assert header.base_digests[name] != header.digests[name]
    assert DeltaHeader.from_tensor(header.to_tensor()) == header
    out = apply_delta(base, payload.tensors, current_version=None)
    assert set(out) == {"a.weight", "c.bias"}
    for name, t in out.items():
        assert _same_bits(t, new[name])
    # the label is not consulted without a version; with one, only the label is
    assert apply_delta(base, payload.tensors, current_version="3").keys() == out.keys()


def test_other_content_is_refused_naming_the_first_tensor_that_differs() -> None:
    base = _model(torch.float32, "cpu")
    payload = encode_delta(base, _step(base, 0.05), base_version=3, version=4, base_digests=True)
    drifted = _snapshot(base)
    drifted["c.bias"].view(-1)[0] += 1.0  # a touched tensor: refused by its base digest
    kept = _snapshot(drifted)
    with pytest.raises(DeltaBaseMismatch) as err:
        apply_delta(drifted, payload.tensors, current_version=None)
    assert err.value.key == "c.bias" and "'c.bias'" in str(err.value)
    assert err.value.expected == "3"
    with pytest.raises(DeltaBaseMismatch):
        check_base_digests(drifted, payload.header)
    for name, t in drifted.items():
        assert _same_bits(t, kept[name])  # nothing changed
    # an untouched tensor that differs is the receiver's business: not hashed, not refused
    other = _snapshot(base)
    other["b.weight"].view(-1)[0] += 1.0
    check_base_digests(other, payload.header)


def test_without_base_digests_a_receiver_without_a_version_refuses() -> None:
    base = _model(torch.bfloat16, "cpu")
    payload = encode_delta(base, _step(base, 0.05), base_version=3, version=4)
    assert payload.header.base_digests is None
    doc = json.loads(bytes(payload.header.to_tensor().numpy()).decode())
    assert "base_digests" not in doc  # the header is what it was before the field existed
    with pytest.raises(DeltaBaseMismatch, match="no base_digests") as err:
        apply_delta(base, payload.tensors, current_version=None)
    assert err.value.expected == "3"


def test_a_header_with_bad_base_digests_is_refused_naming_the_field() -> None:
    base = _model(torch.bfloat16, "cpu")
    header = encode_delta(
        base, _step(base, 0.05), base_version=3, version=4, base_digests=True
    ).header
    doc = json.loads(bytes(header.to_tensor().numpy()).decode())
    for bad in ({"a.weight": "x"}, {**doc["base_digests"], "b.weight": "y"}, ["a.weight"]):
        raw = json.dumps({**doc, "base_digests": bad}).encode()
        with pytest.raises(DeltaFormatError, match="base_digests") as err:
            DeltaHeader.from_tensor(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        assert err.value.key == DELTA_HEADER_KEY
