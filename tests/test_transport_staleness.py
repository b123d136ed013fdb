"""The staleness check of the by-reference transports, without an engine.

``register`` samples 16 elements spread over every tensor (one gather per storage) and
``update`` compares them with one host sync; a tensor that moved is named, in registration
order. Layouts covered: views of one flat buffer, a transposed view, an offset slice, a 0-dim
tensor, an empty one. The fake client stands in for an engine: nothing here needs one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollsafe.ports import EngineTarget
from rollsafe.transports import IPCTransport, StaleRegistration
from rollsafe.transports.base import FINGERPRINT_ELEMENTS, _sample_offsets


class FakeClient:
    def __init__(self) -> None:
        self.calls = 0

    def update_weights_from_tensor(self, payloads: Any, **kw: Any) -> str:
        self.calls += 1
        return "ok"


def _layouts() -> dict[str, torch.Tensor]:
    flat = torch.randn(4000)
    base = torch.randn(40, 30)
    return {
        "a": flat[:1000].view(10, 100),
        "b": flat[1000:3000].view(20, 100),
        "t": base.t(),  # not contiguous
        "s": base[3:9, 4:20],  # an offset, strided slice
        "scalar": torch.tensor(2.0),
        "empty": torch.zeros(0),
        "c": flat[3000:],
    }


@pytest.mark.parametrize("t", list(_layouts().values()), ids=list(_layouts()))
def test_sampled_offsets_follow_the_logical_order(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    storage = t.untyped_storage()
    whole = t.as_strided((storage.nbytes() // t.element_size(),), (1,), 0)
    got = [float(whole[o]) for o in _sample_offsets(t)]
    n = t.numel()
    m = min(n, FINGERPRINT_ELEMENTS)
    linear = [round(k * (n - 1) / (m - 1)) for k in range(m)] if m > 1 else [0]
    assert got == [float(t.reshape(-1)[i]) for i in linear]
    assert linear[0] == 0 and linear[-1] == n - 1


@pytest.mark.parametrize("name", ["a", "b", "t", "s", "scalar", "c"])
def test_a_write_to_a_sampled_element_is_named(name: str) -> None:
    w = _layouts()
    tr = IPCTransport(1, check_finite=False)
    tr.register(w, 1)
    client = FakeClient()
    target = EngineTarget("x", (0,), client, 1)
    assert tr.update([target]).ok and client.calls == 1
    t = w[name]
    flat_index = t.numel() - 1  # the last element is always sampled
    idx = torch.unravel_index(torch.tensor(flat_index), t.shape) if t.dim() else ()
    t.data[idx] = 123.0  # through .data: the version counter does not move
    with pytest.raises(StaleRegistration, match=f"{name!r} changed in place since v1"):
        tr.update([target])
    assert client.calls == 1  # nothing sent


def test_first_changed_in_registration_order_and_nan_bytes_equal_themselves() -> None:
    w = _layouts()
    w["a"].view(-1)[0] = float("nan")  # a sampled element, before register
    tr = IPCTransport(1, check_finite=False)
    tr.register(w, 1)
    target = EngineTarget("x", (0,), FakeClient(), 1)
    assert tr.update([target]).ok
    assert tr.update([target]).ok  # NaN compares equal to itself as bytes: not stale
    w["c"].data[0] = 7.0
    w["b"].data[0] = 7.0
    with pytest.raises(StaleRegistration, match="'b' changed"):
        tr.update([target])
