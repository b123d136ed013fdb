"""Weight digests as the real engines compute them, shared by trainers and engines.

Neither SGLang nor vLLM serves a rollsafe-defined checksum; each has a weight checker of its own
(SGLang ``/weights_checker``, vLLM ``/weight_checker``). This module reimplements their per-tensor
digests (from reading SGLang 0.5.23 and vLLM 0.33.0; no upstream code is copied) so a trainer can
compute, from its own tensors, exactly what an engine reports:

``"sglang-cpu"``
    SGLang's ``tensor_hash`` host path: the first 8 bytes of SHA-256 over the tensor's raw
    contiguous bytes, read as a big-endian integer and written as 16 hex digits (that is, the
    first 16 hex digits of the SHA-256 hex digest).
``"sglang-gpu"``
    SGLang's ``gpu_tensor_hash`` (a Triton kernel upstream), reimplemented in plain torch
    integer ops that give the same value on CPU and on CUDA (see :func:`sglang_gpu_hash`); on a
    CUDA tensor it runs on that GPU and copies nothing but two scalars to the host.
``"sglang"``
    SGLang's own choice: ``"sglang-gpu"`` for a CUDA tensor, ``"sglang-cpu"`` otherwise
    (``tensor_hash`` tests ``tensor.is_cuda``). **This is the default.**
``"vllm"``
    vLLM's ``compute_tensor_digests``: the full SHA-256 hex digest of the raw contiguous bytes of
    a host copy (vLLM always copies to the host first).

The model digest (:func:`model_digest`, alias :func:`overall_checksum`) is SGLang's
``overall_checksum``: SHA-256 over ``name`` then ``digest`` (UTF-8, no separators) for every
tensor in sorted name order; it is SGLang's ``per_gpu_checksum`` of a one-rank engine. vLLM
reports no model digest; rollsafe uses the same formula over vLLM's per-tensor digests.

Digests depend only on the bytes (not dtype or shape), exactly as upstream. Which algorithm an
engine used follows from its dialect and device (:func:`algorithm_for`); the engine clients
report it in ``WeightsChecksum.algorithm``, and a trainer comparing with an engine must pass the
same ``algorithm`` here. Both engines hash their own parameters, not a trainer's HF-named
tensors (fused ``qkv_proj`` / ``gate_up_proj``, one shard per TP rank): lay the trainer's
tensors out first (:mod:`rollsafe.engine_layout`; ``rollsafe.fleet.weights_check`` does both).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

from rollsafe.errors import InvalidArgument

if TYPE_CHECKING:  # torch is imported where tensors are hashed: engine clients stay torch-free
    import torch

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "SGLANG_SKIP_PATTERNS",
    "Algorithm",
    "WeightsChecksum",
    "algorithm_for",
    "dtype_name",
    "model_digest",
    "overall_checksum",
    "per_engine_checksum",
    "resolve_algorithm",
    "sglang_cpu_hash",
    "sglang_engine_digest",
    "sglang_gpu_hash",
    "sglang_skips",
    "tensor_digest",
    "vllm_digest",
    "weights_checksum",
]

Algorithm = Literal["sglang", "sglang-cpu", "sglang-gpu", "vllm"]
ALGORITHMS: tuple[str, ...] = ("sglang", "sglang-cpu", "sglang-gpu", "vllm")
#: ``"sglang"``: SGLang's per-device choice (GPU hash on CUDA tensors, SHA-256 prefix otherwise).
DEFAULT_ALGORITHM: Algorithm = "sglang"

#: Name substrings SGLang's weight checker never hashes (non-persistent buffers).
SGLANG_SKIP_PATTERNS: tuple[str, ...] = (
    "cos_sin_cache",
    "cos_cache",
    "sin_cache",
    "inv_freq",
    "freqs_cis",
    "expert_mask_gpu",
)


class WeightsChecksum(TypedDict):
    """``{"model": hex, "tensors": {name: hex}, "algorithm": name}`` (:func:`weights_checksum`)."""

    model: str
    tensors: dict[str, str]
    algorithm: str


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling used on the wire)."""
    return str(dtype).removeprefix("torch.")


def algorithm_for(dialect: str, device: str | torch.device | None) -> Algorithm:
    """The algorithm an engine of ``dialect`` whose weights live on ``device`` reports with.

    vLLM hashes host copies whatever the device (``"vllm"``); SGLang picks by device
    (``"sglang-gpu"`` on CUDA, ``"sglang-cpu"`` elsewhere). ``device=None`` for SGLang means
    CUDA, the only device real SGLang servers run on for rollsafe.
    """
    if dialect == "vllm":
        return "vllm"
    if dialect != "sglang":
        raise InvalidArgument("dialect", f"dialect must be 'sglang' or 'vllm', got {dialect!r}")
    if device is None:
        return "sglang-gpu"
    return "sglang-gpu" if str(device).split(":")[0] == "cuda" else "sglang-cpu"


def resolve_algorithm(algorithm: str, tensor: torch.Tensor) -> Algorithm:
    """``"sglang"`` resolved for ``tensor``'s device (as SGLang's ``tensor_hash``); others as-is."""
    if algorithm not in ALGORITHMS:
        raise InvalidArgument(
            "algorithm", f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}"
        )
    if algorithm == "sglang":
        return "sglang-gpu" if tensor.is_cuda else "sglang-cpu"
    return cast(Algorithm, algorithm)


# ---------------------------------------------------------------------------- host digests
def _host_bytes(tensor: torch.Tensor) -> Any:
    """The raw bytes of a contiguous host copy of ``tensor`` (native little-endian order)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return cast(Any, t.reshape(-1).view(torch.uint8).numpy()).data


def sglang_cpu_hash(tensor: torch.Tensor) -> int:
    """SGLang's host ``tensor_hash``: SHA-256 of the bytes, first 8 bytes big-endian."""
    return int.from_bytes(hashlib.sha256(_host_bytes(tensor)).digest()[:8], "big")


def vllm_digest(tensor: torch.Tensor) -> str:
    """vLLM's per-parameter digest: SHA-256 hex of the raw bytes of a host copy."""
    return hashlib.sha256(_host_bytes(tensor)).hexdigest()


# ---------------------------------------------------------------------------- SGLang GPU hash
# SGLang's gpu_tensor_hash, restated (the Triton kernel works on uint32 lanes; this works on
# int32 lanes, whose two's-complement wrap-around gives the same 32 bits for +, *, ^, <<; the
# only difference, the arithmetic right shift, is masked back to a logical one):
#
#   words w[i]  = the tensor's bytes zero-padded to a multiple of 4, read as little-endian u32
#   n           = number of words;  NB = (4 * n) mod 2**32  (the *padded* byte count)
#   s1 = seed mod 2**32, s2 = ((seed * 0x9E3779B1) ^ 0xDEADBEEF) mod 2**32, seed = 0x243F6A88
#   p1(i) = (i * 0x27D4EB2D + s1) ^ rotl32(i, 15)      p2(i) = (i * 0x165667B1 + s2) ^ rotl32(i, 13)
#   fmix(x) = murmur3 fmix32 with 0x85EBCA6B, 0xC2B2AE35 (x ^= x>>16; x *= C1; x ^= x>>13; ...)
#   per tile t of 8192 consecutive words (the last one shorter):
#       h1 = fmix((sum_{i in t} fmix(w[i] ^ p1(i)) mod 2**32) ^ NB), h2 likewise with p2
#       partial[t] = h1 << 32 | h2
#   result = splitmix64_finalizer(sum_t partial[t] mod 2**64);  n == 0 -> 0
#
# The 256-word blocks inside a tile and the 1024-wide tree reduction upstream only change the
# order of wrap-around additions, which does not change the sums. Upstream indexes words with
# int32, so tensors of 2**31 words (8 GiB) or more are refused, not silently hashed.
SGLANG_GPU_SEED = 0x243F6A88
SGLANG_TILE_WORDS = 8192
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35
_POS_A = 0x27D4EB2D
_POS_B = 0x165667B1
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
#: Words hashed per vectorised step (a multiple of the tile): bounds the temporaries to a few
#: 64 MiB int32 buffers whatever the tensor's size.
_CHUNK_WORDS = SGLANG_TILE_WORDS * 2048


def _i32(c: int) -> int:
    """A 32-bit constant as the signed int32 with the same bits."""
    c &= _M32
    return c - (1 << 32) if c >= 1 << 31 else c


def _shr_(x: torch.Tensor, r: int) -> torch.Tensor:
    """Logical right shift of int32 lanes (a new tensor)."""
    import torch

    return torch.bitwise_right_shift(x, r).bitwise_and_((1 << (32 - r)) - 1)


def _fmix32_(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 in place on int32 lanes."""
    x.bitwise_xor_(_shr_(x, 16))
    x.mul_(_i32(_FMIX_C1))
    x.bitwise_xor_(_shr_(x, 13))
    x.mul_(_i32(_FMIX_C2))
    x.bitwise_xor_(_shr_(x, 16))
    return x


def _position_mix(idx: torch.Tensor, mul: int, seed: int, rot: int) -> torch.Tensor:
    """``(i * mul + seed) ^ rotl32(i, rot)`` on int32 lanes."""
    import torch

    out = idx * _i32(mul)
    out.add_(_i32(seed))
    rotl = torch.bitwise_left_shift(idx, rot).bitwise_or_(_shr_(idx, 32 - rot))
    return out.bitwise_xor_(rotl)


def _fmix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _FMIX_C1) & _M32
    x ^= x >> 13
    x = (x * _FMIX_C2) & _M32
    x ^= x >> 16
    return x


def _splitmix64_final(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return x


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, zero-padded to a multiple of 4, as int32 lanes (on its device)."""
    import torch

    b = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) & 3
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    try:
        return b.view(torch.int32)
    except RuntimeError:  # a view whose byte offset is not 4-aligned
        return b.clone().view(torch.int32)


def _tile_sums(w: torch.Tensor, start: int, seed1: int, seed2: int) -> torch.Tensor:
    """For words ``w`` (global indices ``start...``; ``start`` a tile boundary): per tile the
    two word-hash sums mod 2**32, as an int64 tensor of shape ``(tiles, 2)``."""
    import torch

    n = w.numel()
    idx = torch.arange(start, start + n, dtype=torch.int32, device=w.device)
    tiles = -(-n // SGLANG_TILE_WORDS)
    pad = tiles * SGLANG_TILE_WORDS - n
    out = []
    for mul, seed, rot in ((_POS_A, seed1, 15), (_POS_B, seed2, 13)):
        k = _fmix32_(_position_mix(idx, mul, seed, rot).bitwise_xor_(w))
        if pad:  # lanes past the end are masked to 0 upstream
            k = torch.nn.functional.pad(k, (0, pad))
        out.append(k.view(tiles, SGLANG_TILE_WORDS).sum(dim=1, dtype=torch.int64) & _M32)
        del k
    return torch.stack(out, dim=1)


def _fmix32_lanes64(x: torch.Tensor) -> torch.Tensor:
    """fmix32 on int64 lanes holding values in [0, 2**32) (products split to avoid overflow)."""

    def mul(x: torch.Tensor, c: int) -> torch.Tensor:
        lo = (x * (c & 0xFFFF)) & _M32
        hi = ((x * (c >> 16)) & 0xFFFF) << 16
        return (lo + hi) & _M32

    x = x ^ (x >> 16)
    x = mul(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = mul(x, _FMIX_C2)
    return x ^ (x >> 16)


def sglang_gpu_hash(tensor: torch.Tensor, *, seed: int = SGLANG_GPU_SEED) -> int:
    """SGLang 0.5.23's ``gpu_tensor_hash`` of ``tensor``, computed on ``tensor``'s device.

    Vectorised torch integer ops (no per-block Python loop; one loop step per 16 Mi words), the
    same result on CPU and CUDA. On CUDA nothing but two scalars is copied to the host.
    """
    totals = _sglang_gpu_totals(tensor, seed)
    return 0 if totals is None else _sglang_gpu_finish(totals.tolist())


def _sglang_gpu_totals(tensor: torch.Tensor, seed: int = SGLANG_GPU_SEED) -> torch.Tensor | None:
    """The two exact int64 lane sums of :func:`sglang_gpu_hash`, left on the tensor's device
    (None for an empty tensor), so a whole model needs one host transfer, not one per tensor."""
    import torch

    words = _words(tensor)
    n = words.numel()
    if n == 0:
        return None
    if n >= 1 << 31:
        raise InvalidArgument(
            "tensor",
            f"sglang gpu hash: {n} 32-bit words; SGLang's kernel indexes words with int32 and "
            "cannot hash a tensor of 8 GiB or more",
        )
    seed1 = seed & _M32
    seed2 = ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (4 * n) & _M32
    totals = torch.zeros(2, dtype=torch.int64, device=words.device)
    with torch.no_grad():
        for start in range(0, n, _CHUNK_WORDS):
            sums = _tile_sums(words[start : start + _CHUNK_WORDS], start, seed1, seed2)
            # exact int64 sums: at most 2**18 tiles of values < 2**32
            totals += _fmix32_lanes64(sums ^ nbytes).sum(dim=0)
    return totals


def _sglang_gpu_finish(totals: Sequence[int]) -> int:
    hi, lo = int(totals[0]), int(totals[1])
    return _splitmix64_final((hi << 32) + lo)


# ---------------------------------------------------------------------------- public API
def tensor_digest(tensor: torch.Tensor, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The engine-side digest of one tensor under ``algorithm`` (see the module docstring).

    SGLang digests are 16 hex digits (``f"{hash:016x}"``), vLLM digests 64.
    """
    algo = resolve_algorithm(algorithm, tensor)
    if algo == "vllm":
        return vllm_digest(tensor)
    if algo == "sglang-gpu":
        return f"{sglang_gpu_hash(tensor):016x}"
    return f"{sglang_cpu_hash(tensor):016x}"


def overall_checksum(tensor_digests: Mapping[str, str]) -> str:
    """SGLang's ``overall_checksum``: SHA-256 over ``name + digest`` in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensor_digests):
        h.update(name.encode())
        h.update(tensor_digests[name].encode())
    return h.hexdigest()


#: The model digest is SGLang's ``overall_checksum`` (``per_gpu_checksum`` of one rank).
model_digest = overall_checksum


def per_engine_checksum(per_gpu_checksums: Iterable[str]) -> str:
    """SGLang's ``per_engine_checksum``: SHA-256 over the ranks' ``per_gpu_checksum`` in order."""
    h = hashlib.sha256()
    for digest in per_gpu_checksums:
        h.update(digest.encode())
    return h.hexdigest()


def sglang_engine_digest(per_gpu_checksums: Sequence[str]) -> str:
    """The model digest of an SGLang answer (``WeightsChecksum.model``): the ranks'
    ``per_gpu_checksum`` when every rank reports the same one (one rank, or replicated
    weights), else the engine's :func:`per_engine_checksum` (TP shards)."""
    if not per_gpu_checksums:
        raise InvalidArgument("per_gpu_checksums", "no rank reported a checksum")
    first = per_gpu_checksums[0]
    if all(p == first for p in per_gpu_checksums):
        return first
    return per_engine_checksum(per_gpu_checksums)


def sglang_skips(name: str) -> bool:
    """True for the non-persistent buffers SGLang's checker never hashes (``inv_freq``, ...)."""
    return any(pat in name for pat in SGLANG_SKIP_PATTERNS)


def weights_checksum(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    algorithm: str = DEFAULT_ALGORITHM,
) -> WeightsChecksum:
    """``{"model", "tensors", "algorithm"}`` for a full set of named tensors.

    Accepts a mapping (e.g. a ``state_dict``) or ``(name, tensor)`` pairs (e.g.
    ``model.named_parameters()``). SGLang algorithms leave out the names SGLang's checker skips
    (:data:`SGLANG_SKIP_PATTERNS`). ``algorithm="sglang"`` resolves per tensor by its device, as
    SGLang does; ``"algorithm"`` in the result is then ``"sglang"`` unless every tensor resolved
    the same way. A duplicated name raises ``ValueError``.
    """
    if algorithm not in ALGORITHMS:
        raise InvalidArgument(
            "algorithm", f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}"
        )
    import torch

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    digests: dict[str, str] = {}
    used: set[str] = set()
    # sglang-gpu digests of device tensors: lane sums stay on the device until one transfer
    pending: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in items:
        if name in digests:
            raise InvalidArgument(name, f"weights_checksum: tensor name {name!r} appears twice")
        if algorithm.startswith("sglang") and sglang_skips(name):
            continue
        algo = resolve_algorithm(algorithm, tensor)
        used.add(algo)
        totals = _sglang_gpu_totals(tensor) if algo == "sglang-gpu" else None
        if totals is not None:
            digests[name] = ""  # placed now so that the order and the duplicate check hold
            pending.setdefault(totals.device, []).append((name, totals))
        else:
            digests[name] = tensor_digest(tensor, algorithm)
    for rows in pending.values():
        host = torch.stack([t for _, t in rows]).cpu().tolist()
        for (name, _), pair in zip(rows, host, strict=True):
            digests[name] = f"{_sglang_gpu_finish(pair):016x}"
    resolved = used.pop() if len(used) == 1 else algorithm
    return {"model": model_digest(digests), "tensors": digests, "algorithm": resolved}
