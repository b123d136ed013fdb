"""Delta weight sync on the wire: what changed since a base version, as ordinary named tensors.

Owns the delta format (issue #28; ``docs/design.md``), both ends of it: :func:`encode_delta`
(the sender: base and new tensors in, a :class:`DeltaPayload` out) and :func:`apply_delta` (the
receiver: its current tensors and the received named tensors in, the new tensors of every
touched name out, checked). A delta is itself a list of named tensors, so every tensor
transport (``ipc``, ``nccl``) moves it through its usual bucketing, broadcast or IPC unchanged:

* :data:`DELTA_HEADER_KEY`: a ``uint8`` tensor holding the UTF-8 JSON of a :class:`DeltaHeader`
  (base version, resulting version, which names are sparse and which dense, and the result
  digest of every touched tensor);
* per sparse tensor ``name``: ``name + IDX_SUFFIX``, the flat indices of the elements whose raw
  bits changed (``int32``, ascending; ``int64`` only for a tensor of ``2**31`` elements or more),
  and ``name + VAL_SUFFIX``, the new values there (the weight's dtype);
* per dense tensor ``name``: the whole new tensor under its own name (the per-tensor fallback);
* unchanged tensors are not sent at all.

Comparison is exact on raw bits: every dtype is viewed as the unsigned/signed integer of its
width (bf16/fp16 as ``int16``, fp32 as ``int32``, ...), so ``-0.0`` vs ``0.0`` and NaN payloads
count as changes and nothing is lost to a tolerance. Everything runs on the tensors' own device
(CPU or CUDA), vectorised (no per-element Python); only counts and digests reach the host.

The dense fallback: a tensor goes whole when more than :data:`DENSE_FRACTION` of its elements
changed, or when its index+value pair would not be smaller than the tensor itself (bytes alone
break even at ``itemsize / (itemsize + 4)``: 33 % for bf16/fp16, 50 % for fp32, 20 % for 1-byte
dtypes). :data:`DENSE_FRACTION` is measured (``benchmarks/bench_delta_threshold.py``: a 4 MiB
bf16 tensor on this project's shared 2-core CPU host, best of 31): the sparse form's extra work
(sender: changed indices + gather; receiver: clone + scatter) costs 1.9 ms at 0.5 % changed,
4.0 ms at 5 %, 6.8 ms at 10 %, 10.6 ms at 25 %, against a 0.2 ms dense copy; with the bytes at
the link's rate, sparse stays faster end to end up to 20 % changed on a 0.125 GB/s (1 GbE)
link, 2 % at 1.25 GB/s and 1 % at the 2 GB/s of loopback gloo. A delta exists for
bandwidth-bound links and its first target is bytes (#28), so the default is the slow-link
crossover, 0.2 (tensors up to 20 % changed travel in at most 60 % of their bytes); a transport
on a fast link where time matters more passes a smaller ``dense_fraction``.

The receiver refuses, before returning anything, with a named :class:`DeltaError`: a base other
than the one it holds (:class:`DeltaBaseMismatch`), a malformed payload (:class:`DeltaFormatError`:
bad header, a name the header does not list or one it lists that is missing, an unknown weight,
wrong dtype/shape, an index out of range or not ascending), and a result whose digest (the
header's algorithm: :func:`lin64_digest` from this module's encoder) is not the sender's
(:class:`DeltaDigestMismatch`). It never mutates its inputs.

A receiver that knows no version label (vLLM's workers never see ``weight_version``) checks its
base by content instead: the sender, asked with ``encode_delta(..., base_digests=True)``, writes
the header's optional ``base_digests`` (each touched name's digest of the *base* tensor, in the
header's algorithm), and ``apply_delta(..., current_version=None)`` refuses with
:class:`DeltaBaseMismatch` naming the first touched tensor whose current digest differs (or a
header without them). Untouched tensors are not hashed: the receiver answers for them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rollsafe.errors import RollsafeError

__all__ = [
    "DELTA_FORMAT",
    "DELTA_HEADER_KEY",
    "DENSE_FRACTION",
    "DIGEST_ALGORITHM",
    "DIGEST_ALGORITHMS",
    "IDX_SUFFIX",
    "VAL_SUFFIX",
    "DeltaBaseMismatch",
    "DeltaDigestMismatch",
    "DeltaError",
    "DeltaFormatError",
    "DeltaHeader",
    "DeltaPayload",
    "apply_delta",
    "check_base_digests",
    "delta_base_name",
    "encode_delta",
    "is_delta",
    "is_delta_name",
    "lin64_digest",
    "read_header",
    "result_digest",
]

DELTA_HEADER_KEY = "__rollsafe_delta__"
IDX_SUFFIX = ".__delta_idx__"
VAL_SUFFIX = ".__delta_val__"
#: measured per-tensor threshold (see the module docstring): above it a tensor goes dense
DENSE_FRACTION: float = 0.2
#: the ``format`` field of every header this module writes and the only one it reads
DELTA_FORMAT = "rollsafe-delta/1"
#: the per-tensor result digest of a header (SGLang's GPU hash, the same on CPU and CUDA)
DIGEST_ALGORITHM = "rollsafe-lin64"
#: the result digests a header may name: ``rollsafe-lin64`` (:func:`lin64_digest`, what
#: :func:`encode_delta` writes for CUDA tensors: one pass over the bytes), SGLang's CPU hash
#: (SHA-256, what it writes for host tensors) or SGLang's GPU hash (accepted; on an H200 it took
#: 0.45 s per side for the 8 GB Qwen3-4B set, against about 0.1 s for lin64)
DIGEST_ALGORITHMS = ("rollsafe-lin64", "sglang-gpu", "sglang-cpu")
#: a tensor of at least this many elements gets int64 indices (int32 cannot address it)
_INT64_INDEX_NUMEL = 1 << 31

_NP_INDEX = {torch.int32: np.int32, torch.int64: np.int64}
_SAME_WIDTH_INT: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


# ---------------------------------------------------------------------------- errors
class DeltaError(RollsafeError, ValueError):
    """A delta was refused; nothing was changed. ``key`` names the tensor (or is None)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DeltaBaseMismatch(DeltaError):
    """The delta applies onto ``expected`` but the receiver holds ``actual`` (``message``, when
    given, says how the base was found different; ``key`` names the tensor when by content)."""

    def __init__(
        self, expected: str, actual: str, *, message: str | None = None, key: str | None = None
    ) -> None:
        super().__init__(
            message
            or f"delta base v{expected} but the receiver holds v{actual}; nothing was applied",
            key=key,
        )
        self.expected = expected
        self.actual = actual


class DeltaFormatError(DeltaError):
    """The payload is malformed (the message and ``key`` name the tensor or header field)."""


class DeltaDigestMismatch(DeltaError):
    """A tensor's result after the apply does not hash to the digest the sender computed."""


# ---------------------------------------------------------------------------- header
@dataclass(frozen=True)
class DeltaHeader:
    """What a delta says about itself (travels as :data:`DELTA_HEADER_KEY`)."""

    base_version: str
    version: str
    digests: Mapping[str, str]
    sparse: tuple[str, ...]
    dense: tuple[str, ...]
    algorithm: str = DIGEST_ALGORITHM
    #: per touched name, the digest of the *base* tensor (``algorithm``); None: not written
    #: (only a receiver that checks its base by content needs them)
    base_digests: Mapping[str, str] | None = None

    def to_tensor(self, *, device: torch.device | str | None = None) -> torch.Tensor:
        """The header as a 1-D ``uint8`` tensor of its UTF-8 JSON (on ``device``, default CPU)."""
        doc = {
            "format": DELTA_FORMAT,
            "digest": self.algorithm,
            "base_version": self.base_version,
            "version": self.version,
            "digests": dict(self.digests),
            "sparse": list(self.sparse),
            "dense": list(self.dense),
        }
        if self.base_digests is not None:
            doc["base_digests"] = dict(self.base_digests)
        raw = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return t if device is None else t.to(device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> DeltaHeader:
        """Parse a header tensor; :class:`DeltaFormatError` (key :data:`DELTA_HEADER_KEY`)
        naming the field on anything malformed."""

        def bad(why: str) -> DeltaFormatError:
            return DeltaFormatError(f"{DELTA_HEADER_KEY}: {why}", key=DELTA_HEADER_KEY)

        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            what = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
            raise bad(f"must be a 1-D uint8 tensor, got {what}")
        try:
            doc = json.loads(bytes(t.detach().cpu().numpy().tobytes()).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise bad(f"not UTF-8 JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise bad("not a JSON object")
        if doc.get("format") != DELTA_FORMAT:
            raise bad(f"format {doc.get('format')!r} is not {DELTA_FORMAT!r}")
        if doc.get("digest") not in DIGEST_ALGORITHMS:
            raise bad(f"digest algorithm {doc.get('digest')!r} is not one of {DIGEST_ALGORITHMS}")
        for key in ("base_version", "version"):
            if not isinstance(doc.get(key), str) or not doc[key]:
                raise bad(f"{key!r} must be a non-empty string, got {doc.get(key)!r}")
        digests = doc.get("digests")
        if not isinstance(digests, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in digests.items()
        ):
            raise bad("'digests' must map names to digest strings")
        lists: dict[str, tuple[str, ...]] = {}
        for key in ("sparse", "dense"):
            value = doc.get(key)
            if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
                raise bad(f"{key!r} must be a list of names")
            if len(set(value)) != len(value):
                raise bad(f"{key!r} lists a name twice")
            lists[key] = tuple(value)
        both = set(lists["sparse"]) & set(lists["dense"])
        if both:
            raise bad(f"{sorted(both)[0]!r} is listed both sparse and dense")
        touched = set(lists["sparse"]) | set(lists["dense"])
        if set(digests) != touched:
            odd = sorted(set(digests) ^ touched)[0]
            raise bad(f"'digests' must cover exactly the touched names (differs at {odd!r})")
        for name in touched:
            if is_delta_name(name):
                raise bad(f"touched name {name!r} uses a reserved delta suffix")
        base_digests = doc.get("base_digests")
        if base_digests is not None:
            if not isinstance(base_digests, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in base_digests.items()
            ):
                raise bad("'base_digests' must map names to digest strings")
            if set(base_digests) != touched:
                odd = sorted(set(base_digests) ^ touched)[0]
                raise bad(
                    f"'base_digests' must cover exactly the touched names (differs at {odd!r})"
                )
        return cls(
            base_version=doc["base_version"],
            version=doc["version"],
            digests=dict(digests),
            sparse=lists["sparse"],
            dense=lists["dense"],
            algorithm=doc["digest"],
            base_digests=None if base_digests is None else dict(base_digests),
        )

    @property
    def touched(self) -> tuple[str, ...]:
        return self.sparse + self.dense

    def wire_names(self) -> set[str]:
        """Every name a complete delta with this header carries besides the header."""
        out = set(self.dense)
        for name in self.sparse:
            out.update((name + IDX_SUFFIX, name + VAL_SUFFIX))
        return out


# ---------------------------------------------------------------------------- payload
@dataclass(frozen=True)
class DeltaPayload:
    """An encoded delta: the named tensors to send and what they cost."""

    header: DeltaHeader
    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int
    full_nbytes: int
    changed_elements: int
    total_elements: int
    encode_s: float
    #: per touched name: "sparse" or "dense" (also in the header; here for reports)
    kinds: Mapping[str, str] = field(default_factory=dict)

    @property
    def worthwhile(self) -> bool:
        """The delta moves fewer bytes than a full sync of the new version (else send full)."""
        return self.nbytes < self.full_nbytes

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


def is_delta(names: Iterable[str]) -> bool:
    """Whether a set of received names is (part of) a delta that carries its header."""
    return DELTA_HEADER_KEY in set(names)


def is_delta_name(name: str) -> bool:
    """Whether ``name`` is one only a delta uses (its header, an index or a value tensor)."""
    return name == DELTA_HEADER_KEY or name.endswith((IDX_SUFFIX, VAL_SUFFIX))


def delta_base_name(name: str) -> str:
    """The weight an index/value tensor belongs to (``name`` itself for any other name)."""
    for suffix in (IDX_SUFFIX, VAL_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened (contiguous) and viewed as the integer dtype of its element width."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    int_dtype = _SAME_WIDTH_INT.get(flat.element_size())
    if int_dtype is None:
        raise DeltaFormatError(f"dtype {t.dtype} has no integer view", key=None)
    return flat if flat.dtype == int_dtype else flat.view(int_dtype)


def _items(
    tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]], what: str
) -> list[tuple[str, torch.Tensor]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    seen: set[str] = set()
    for name, t in items:
        if not isinstance(name, str) or not name:
            raise DeltaFormatError(f"{what}: names must be non-empty strings, got {name!r}")
        if name in seen:
            raise DeltaFormatError(f"{what}: {name!r} given twice", key=name)
        if is_delta_name(name):
            raise DeltaFormatError(f"{what}: {name!r} uses a reserved delta name", key=name)
        if not isinstance(t, torch.Tensor):
            raise DeltaFormatError(f"{what}: {name!r} is a {type(t).__name__}", key=name)
        seen.add(name)
    return items


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


#: words per row of :func:`lin64_digest` (each word position in a row has its own odd factor)
LIN64_ROW_WORDS = 1024
_LIN64_CHUNK_WORDS = 1 << 24  # rows hashed per step: bounds the int64 temporaries (128 MiB)
_M64 = (1 << 64) - 1
_lin64_factors: dict[torch.device, torch.Tensor] = {}


def _to_i64(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2**64)."""
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _factors(device: torch.device) -> torch.Tensor:
    """The odd 64-bit factor of each word position in a row (fixed, from splitmix64)."""
    got = _lin64_factors.get(device)
    if got is None:
        vals = [_to_i64(_mix64(j + 1) | 1) for j in range(LIN64_ROW_WORDS)]
        got = _lin64_factors[device] = torch.tensor(vals, dtype=torch.int64, device=device)
    return got


def lin64_digest(t: torch.Tensor) -> str:
    """``rollsafe-lin64``: a 64-bit digest of ``t``'s raw bytes built for one pass on any device.

    The bytes, zero-padded to whole 32-bit words, form rows of :data:`LIN64_ROW_WORDS` words;
    each row's sum of ``word * factor[position]`` (mod 2**64, every factor odd) is mixed with
    its row index, the rows are summed, and the total is finished with the byte count by
    splitmix64. Any change of one word changes its row sum (an odd factor is invertible mod
    2**64); a word moved to another position or row changes it too. Not cryptographic: it
    checks an apply, not an adversary. Integer ops only, so CPU and CUDA give the same value;
    on CUDA only the total reaches the host.
    """
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    pad = (-raw.numel()) & 3
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    try:
        words = raw.view(torch.int32)
    except RuntimeError:  # a byte offset that is not 4-aligned
        words = raw.clone().view(torch.int32)
    n = words.numel()
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    factors = _factors(words.device)
    row_mix = _to_i64(0x9E3779B97F4A7C15)
    with torch.no_grad():
        for start in range(0, n, _LIN64_CHUNK_WORDS):
            w = words[start : start + _LIN64_CHUNK_WORDS]
            rows = -(-w.numel() // LIN64_ROW_WORDS)
            if rows * LIN64_ROW_WORDS != w.numel():
                w = torch.nn.functional.pad(w, (0, rows * LIN64_ROW_WORDS - w.numel()))
            sums = (w.view(rows, LIN64_ROW_WORDS).to(torch.int64) * factors).sum(dim=1)
            first = start // LIN64_ROW_WORDS
            index = torch.arange(first, first + rows, dtype=torch.int64, device=w.device)
            x = sums ^ (index * row_mix)
            x = x * _to_i64(0xD6E8FEB86659FD93)
            total += (x ^ (x >> 32)).sum()
    return f"{_mix64(int(total) ^ _mix64(raw.numel() - pad)):016x}"


def result_digest(t: torch.Tensor, algorithm: str = DIGEST_ALGORITHM) -> str:
    """A touched tensor's digest in a header, by ``algorithm`` (one of
    :data:`DIGEST_ALGORITHMS`; each gives the same value on any device): :func:`lin64_digest`,
    or ``rollsafe.checksum.tensor_digest`` for SGLang's hashes. ``rollsafe.checksum`` sits
    beside ``rollsafe.wire`` in layer 2, so it is imported here, in the function: an allowed
    exception of ``docs/architecture.md``."""
    if algorithm == "rollsafe-lin64":
        return lin64_digest(t)
    from rollsafe.checksum import tensor_digest

    return tensor_digest(t, algorithm)


def changed_counts(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """How many elements differ in each ``(new_bits, base_bits)`` pair (same device each).

    CPU: numpy on zero-copy views (its compare and count run several times faster than
    torch's on this project's CPU host, ``benchmarks/bench_delta_threshold.py``); CUDA: one
    ``count_nonzero`` per pair, read back in one transfer per device.
    """
    out: list[int | None] = [None] * len(pairs)
    on_device: dict[torch.device, list[int]] = {}
    for i, (nb, bb) in enumerate(pairs):
        if nb.device.type == "cpu":
            out[i] = int(np.count_nonzero(nb.numpy() != bb.numpy()))
        else:
            on_device.setdefault(nb.device, []).append(i)
    for members in on_device.values():
        counts = torch.stack([torch.count_nonzero(pairs[i][0] != pairs[i][1]) for i in members])
        for i, c in zip(members, counts.tolist(), strict=True):
            out[i] = int(c)
    return [int(c or 0) for c in out]


def changed_indices(
    nb: torch.Tensor, bb: torch.Tensor, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """The ascending flat indices (``dtype``) where two same-width integer views differ, on
    their device (CPU: numpy's ``flatnonzero`` on zero-copy views, the fastest here)."""
    if nb.device.type == "cpu":
        found = np.flatnonzero(nb.numpy() != bb.numpy())
        return torch.from_numpy(found.astype(_NP_INDEX[dtype], copy=False))
    return torch.nonzero(nb != bb).reshape(-1).to(dtype)


def gather_bits(bits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``bits[idx]`` (1-D integer view, indices on its device)."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.take(bits.numpy(), idx.numpy()))
    return bits[idx.long()]


def scatter_bits(out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> None:
    """``out[idx] = val`` in place on 1-D integer views (int32/int64 ``idx`` on ``out``'s
    device)."""
    if out.device.type == "cpu":
        out.numpy()[idx.numpy()] = val.numpy()
    else:
        out.index_copy_(0, idx.long(), val)


def encode_delta(
    base: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
    new: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
    *,
    base_version: int | str,
    version: int | str,
    dense_fraction: float = DENSE_FRACTION,
    base_digests: bool = False,
) -> DeltaPayload:
    """The delta that turns ``base`` into ``new`` (exact raw bits, no tolerance).

    ``base_digests``: also write each touched name's base digest into the header (one more
    digest pass over the touched base tensors), for a receiver that checks its base by content
    (``apply_delta(..., current_version=None)``).

    ``base`` and ``new`` must hold the same names with the same shapes and dtypes
    (:class:`DeltaFormatError` naming the key otherwise); ``base`` may live on another device
    (it is compared on ``new``'s). The payload's tensors are on ``new``'s device: the header,
    then per touched tensor (``new`` order) the dense tensor or its index and value tensors.
    Dense tensors are ``new``'s own tensors (no copy); index/value tensors are fresh.
    """
    t0 = time.perf_counter()
    if not 0.0 <= dense_fraction <= 1.0:
        raise DeltaFormatError(f"dense_fraction must be in [0, 1], got {dense_fraction}")
    base_items = dict(_items(base, "base"))
    new_items = _items(new, "new")
    missing = [n for n, _ in new_items if n not in base_items]
    extra = sorted(set(base_items) - {n for n, _ in new_items})
    if missing or extra:
        key = missing[0] if missing else extra[0]
        where = "in new but not in base" if missing else "in base but not in new"
        raise DeltaFormatError(f"{key!r} is {where}", key=key)
    devices = {t.device for _, t in new_items}
    if len(devices) > 1:
        raise DeltaFormatError(f"new tensors are on several devices: {sorted(map(str, devices))}")
    device = next(iter(devices)) if devices else torch.device("cpu")
    # lin64 is one pass on a GPU; on a CPU core SHA-256 is faster (0.5 GB/s against lin64's
    # int64 temporaries at about 0.35 GB/s on the 2-core host)
    algorithm = DIGEST_ALGORITHM if device.type == "cuda" else "sglang-cpu"
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name, n in new_items:
        b = base_items[name]
        if b.shape != n.shape or b.dtype != n.dtype:
            raise DeltaFormatError(
                f"{name!r}: base is {b.dtype} {list(b.shape)}, new is {n.dtype} {list(n.shape)}",
                key=name,
            )
        nb = _bits(n)
        bb = _bits(b)
        if bb.device != nb.device:
            bb = bb.to(nb.device)
        pairs.append((name, nb, bb))
    counts = changed_counts([(nb, bb) for _, nb, bb in pairs])
    tensors: list[tuple[str, torch.Tensor]] = []
    sparse: list[str] = []
    dense: list[str] = []
    digests: dict[str, str] = {}
    bases: dict[str, str] = {}
    kinds: dict[str, str] = {}
    changed = total = full = 0
    new_map = dict(new_items)
    for (name, nb, bb), count in zip(pairs, counts, strict=True):
        t = new_map[name]
        numel = nb.numel()
        total += numel
        full += _nbytes(t)
        if count == 0:
            continue
        changed += count
        idx_dtype = torch.int64 if numel >= _INT64_INDEX_NUMEL else torch.int32
        idx_size = 8 if idx_dtype == torch.int64 else 4
        sparse_bytes = count * (idx_size + nb.element_size())
        if count > dense_fraction * numel or sparse_bytes >= _nbytes(t):
            dense.append(name)
            kinds[name] = "dense"
            tensors.append((name, t.detach()))
        else:
            idx = changed_indices(nb, bb, idx_dtype)
            val = gather_bits(nb, idx).view(t.dtype)
            sparse.append(name)
            kinds[name] = "sparse"
            tensors.append((name + IDX_SUFFIX, idx))
            tensors.append((name + VAL_SUFFIX, val))
        digests[name] = result_digest(t.detach(), algorithm)
        if base_digests:
            bases[name] = result_digest(base_items[name].detach(), algorithm)
    header = DeltaHeader(
        base_version=str(base_version),
        version=str(version),
        digests=digests,
        sparse=tuple(sparse),
        dense=tuple(dense),
        algorithm=algorithm,
        base_digests=bases if base_digests else None,
    )
    tensors.insert(0, (DELTA_HEADER_KEY, header.to_tensor(device=device)))
    return DeltaPayload(
        header=header,
        tensors=tensors,
        nbytes=sum(_nbytes(t) for _, t in tensors),
        full_nbytes=full,
        changed_elements=changed,
        total_elements=total,
        encode_s=time.perf_counter() - t0,
        kinds=kinds,
    )


# ---------------------------------------------------------------------------- apply
def _header_of(received: Sequence[tuple[str, torch.Tensor]]) -> DeltaHeader:
    headers = [t for n, t in received if n == DELTA_HEADER_KEY]
    if len(headers) != 1:
        raise DeltaFormatError(
            f"{DELTA_HEADER_KEY}: a delta carries exactly one header, got {len(headers)}",
            key=DELTA_HEADER_KEY,
        )
    return DeltaHeader.from_tensor(headers[0])


def read_header(received: Sequence[tuple[str, torch.Tensor]]) -> DeltaHeader:
    """The one header of ``received`` (:class:`DeltaFormatError` if none, several or bad)."""
    return _header_of(received)


def apply_delta(
    current: Mapping[str, torch.Tensor],
    received: Sequence[tuple[str, torch.Tensor]],
    *,
    current_version: str | None,
) -> dict[str, torch.Tensor]:
    """The new tensor of every name the delta touches, built from ``current`` (never mutated).

    Raises, before returning anything: :class:`DeltaBaseMismatch` when the header's base is
    not ``current_version`` or, with ``current_version=None`` (a receiver that knows no
    version), when the header carries no ``base_digests`` or a touched tensor of ``current``
    does not hash to its base digest (:func:`check_base_digests`); :class:`DeltaFormatError`
    naming the key for an unlisted, missing, duplicate or unknown name, a wrong dtype or shape,
    an index out of range or not strictly ascending; :class:`DeltaDigestMismatch` naming the
    key when a result's digest is not the header's. Results live on each current tensor's
    device and share no memory with the inputs.
    """
    header = _header_of(received)
    if current_version is not None and header.base_version != str(current_version):
        raise DeltaBaseMismatch(header.base_version, str(current_version))
    got: dict[str, torch.Tensor] = {}
    for name, t in received:
        if name == DELTA_HEADER_KEY:
            continue
        if name in got:
            raise DeltaFormatError(f"{name!r} received twice", key=name)
        if not isinstance(t, torch.Tensor):
            raise DeltaFormatError(f"{name!r} is a {type(t).__name__}, not a tensor", key=name)
        got[name] = t
    wanted = header.wire_names()
    unlisted = sorted(set(got) - wanted)
    if unlisted:
        raise DeltaFormatError(
            f"{unlisted[0]!r} is not listed by the delta header (sparse "
            f"{len(header.sparse)}, dense {len(header.dense)} tensors)",
            key=unlisted[0],
        )
    absent = sorted(wanted - set(got))
    if absent:
        owner = delta_base_name(absent[0])
        raise DeltaFormatError(
            f"{absent[0]!r} is missing: the header lists {owner!r} but the delta does not carry it",
            key=owner,
        )
    for name in header.touched:
        if name not in current:
            raise DeltaFormatError(f"{name!r}: no such weight here", key=name)
    if current_version is None:
        check_base_digests(current, header)
    out: dict[str, torch.Tensor] = {}
    for name in header.dense:
        cur, t = current[name], got[name]
        if t.dtype != cur.dtype or t.shape != cur.shape:
            raise DeltaFormatError(
                f"{name!r}: dense tensor is {t.dtype} {list(t.shape)}, the weight is "
                f"{cur.dtype} {list(cur.shape)}",
                key=name,
            )
        out[name] = t.detach().to(cur.device, copy=True, memory_format=torch.contiguous_format)
    checks: list[tuple[str, torch.Tensor]] = []  # (name, device bool: indices valid)
    scatters: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name in header.sparse:
        cur = current[name]
        idx, val = got[name + IDX_SUFFIX], got[name + VAL_SUFFIX]
        if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
            raise DeltaFormatError(
                f"{name + IDX_SUFFIX!r}: indices must be 1-D int32/int64, got {idx.dtype} "
                f"{list(idx.shape)}",
                key=name,
            )
        if val.dtype != cur.dtype or val.dim() != 1 or val.numel() != idx.numel():
            raise DeltaFormatError(
                f"{name + VAL_SUFFIX!r}: values must be 1-D {cur.dtype} of {idx.numel()} "
                f"elements (one per index), got {val.dtype} {list(val.shape)}",
                key=name,
            )
        numel = cur.numel()
        if idx.numel() > numel:
            raise DeltaFormatError(
                f"{name!r}: {idx.numel()} indices for a weight of {numel} elements", key=name
            )
        idx = idx.detach().to(cur.device)
        if idx.numel():
            ok = (idx[0] >= 0) & (idx[-1] < numel)
            if idx.numel() > 1:
                ok = ok & torch.all(idx[1:] > idx[:-1])
            checks.append((name, ok))
        scatters.append((name, idx, val.detach().to(cur.device)))
    _raise_bad_indices(checks, current)
    for name, idx, val in scatters:
        cur = current[name]
        result = cur.detach().clone(memory_format=torch.contiguous_format)
        if idx.numel():
            scatter_bits(_bits(result), idx, _bits(val))
        out[name] = result
    for name in header.touched:
        digest = result_digest(out[name], header.algorithm)
        if digest != header.digests[name]:
            raise DeltaDigestMismatch(
                f"{name!r}: the result's digest is {digest}, the delta says "
                f"{header.digests[name]} (base v{header.base_version} -> v{header.version}); "
                "nothing was applied",
                key=name,
            )
    return {name: out[name] for name in header.touched}


def check_base_digests(current: Mapping[str, torch.Tensor], header: DeltaHeader) -> None:
    """Check by content that ``current`` holds the delta's base: every touched tensor hashes
    (the header's algorithm) to the header's ``base_digests``. :class:`DeltaBaseMismatch` for
    a header without them (the sender was not asked for them) or naming the first touched
    tensor that differs; :class:`DeltaFormatError` for a touched name ``current`` lacks."""
    if header.base_digests is None:
        raise DeltaBaseMismatch(
            header.base_version,
            "unknown",
            message=(
                f"delta base v{header.base_version} carries no base_digests and this receiver "
                "knows no version to check it by; nothing was applied"
            ),
        )
    for name in header.touched:
        if name not in current:
            raise DeltaFormatError(f"{name!r}: no such weight here", key=name)
        digest = result_digest(current[name], header.algorithm)
        if digest != header.base_digests[name]:
            raise DeltaBaseMismatch(
                header.base_version,
                "other weights",
                message=(
                    f"delta base v{header.base_version}: {name!r} here hashes to {digest}, the "
                    f"base's to {header.base_digests[name]}: the receiver holds other weights; "
                    "nothing was applied"
                ),
                key=name,
            )


def _raise_bad_indices(
    checks: list[tuple[str, torch.Tensor]], current: Mapping[str, torch.Tensor]
) -> None:
    """Read every index check back (one transfer per device) and name the first failure."""
    by_device: dict[Any, list[int]] = {}
    for i, (_, ok) in enumerate(checks):
        by_device.setdefault(ok.device, []).append(i)
    bad: list[int] = []
    for members in by_device.values():
        flags = torch.stack([checks[i][1] for i in members]).tolist()
        bad.extend(i for i, flag in zip(members, flags, strict=True) if not flag)
    if bad:
        name = checks[min(bad)][0]
        raise DeltaFormatError(
            f"{name + IDX_SUFFIX!r}: indices out of range [0, {current[name].numel()}) or not "
            "strictly ascending",
            key=name,
        )
