"""``rollsafe.wire.finite``: the one-pass finite check both ends of a weight transfer use.

The small-tensor path (one fused inf-norm) is covered in ``test_engine_atomic``; here the
large-span path (a ``vector_norm`` of its own per span) is forced by lowering the size threshold, so
each kind of bad value, dtype and position is seen by the same code that runs on an 8 GB flat
buffer.
"""

from __future__ import annotations

import pytest
import torch

from rollsafe.wire import finite
from rollsafe.wire.finite import describe_non_finite, non_finite_index


@pytest.fixture
def big_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finite, "BIG_SPAN_ELEMENTS", 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [0, 17, 63])
def test_large_span_finds_every_bad_value(
    big_path: None, dtype: torch.dtype, bad: float, at: int
) -> None:
    flat = torch.randn(64).to(dtype)
    views = [flat[0:16], flat[16:48], flat[48:64]]  # one span of 64 >= 8 elements
    assert non_finite_index(views) is None
    flat[at] = bad
    want = 0 if at < 16 else 1 if at < 48 else 2
    assert non_finite_index(views) == want
    alone = [torch.ones(3, dtype=dtype), flat]  # a small tensor beside the big one
    assert non_finite_index(alone) == 1


def test_large_span_mixes_with_small_ones_and_first_bad_wins(big_path: None) -> None:
    big = torch.ones(100)
    small = torch.ones(4)
    other = torch.ones(50)
    assert non_finite_index([small, big, other]) is None
    other[49] = float("inf")
    big[0] = float("nan")
    assert non_finite_index([small, big, other]) == 1
    assert non_finite_index([other, small]) == 0


def test_large_span_of_float8_and_complex(big_path: None) -> None:
    f8 = torch.ones(32).to(torch.float8_e5m2)
    assert non_finite_index([f8]) is None
    bad = torch.ones(32)
    bad[5] = float("inf")
    assert non_finite_index([f8, bad.to(torch.float8_e5m2)]) == 1
    c = torch.ones(32, dtype=torch.complex64)
    assert non_finite_index([c]) is None
    c[3] = complex(0.0, float("nan"))
    assert non_finite_index([c]) == 0


def test_integers_and_empty_tensors_are_finite(big_path: None) -> None:
    assert (
        non_finite_index([torch.arange(100), torch.zeros(0), torch.ones(9, dtype=torch.bool)])
        is None
    )
    assert non_finite_index([]) is None


def test_describe_counts_each_kind() -> None:
    t = torch.tensor([1.0, float("nan"), float("inf"), float("-inf")], dtype=torch.bfloat16)
    assert describe_non_finite(t) == "holds non-finite values (1 NaN, 2 inf of 4)"


@pytest.mark.gpu
def test_cuda_flat_buffer_of_views_is_one_pass_and_names_the_view() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = finite.BIG_SPAN_ELEMENTS // 2  # three views: one span past the real threshold
    flat = torch.randn(3 * n, device="cuda", dtype=torch.bfloat16)
    views = [flat[:n], flat[n : 2 * n], flat[2 * n :]]
    assert len(finite._spans(views, [0, 1, 2])) == 1
    assert non_finite_index(views) is None
    flat[-1] = float("-inf")
    assert non_finite_index(views) == 2
    flat[n + 7] = float("nan")
    assert non_finite_index(views) == 1
    assert describe_non_finite(views[1]) == f"holds non-finite values (1 NaN, 0 inf of {n})"
