"""One rank's shard of the served model: a Hugging Face causal LM split vocab-parallel.

Owns the live weights of one engine rank. The transformer trunk (``model.*``) runs replicated on
every rank; ``lm_head`` is split by rows (vocabulary-parallel, like a column-parallel output
layer): rank ``r`` holds rows ``[r*S, min(V, (r+1)*S))`` with ``S = ceil(V / ranks)``, so every
decode step needs every rank's slice of the logits (an all-gather). The module also owns the
all-or-nothing update protocol on this rank: ``validate`` -> ``stage`` -> ``commit`` (in-place
copy into live parameters) or ``discard``.

``stage`` is phase 1 of a commit and checks everything a commit could trip over before it
records anything: the name, dtype and shape of every tensor of the call, then that each one is
a real, readable tensor (dense strided layout, a plain tensor, not on the ``meta`` device, its
storage large enough for its extent) and, unless the caller passes ``allow_non_finite``, that it
holds no NaN or inf (:func:`rollsafe.wire.finite.non_finite_index`: each byte read once, one
host sync per call). A tensor on this rank's device, or on the host (disk reads and gloo
receives are staged there and copied to the device by the commit), is recorded **as it is**
when contiguous (no copy): the sources of ``/update_weights_from_tensor`` (shared-memory / CUDA
IPC views of the sender's buffers), of a distributed update (views of this rank's reusable
receive buffer) and of a disk load (tensors read for this load) all stay valid and unchanged
until ``commit`` or ``discard`` runs in the same request, so each byte is copied once, straight
into the live parameters. Anything else (another accelerator, a non-contiguous view) gets a
contiguous copy on this rank's device while staging; ``copy=True`` copies every tensor, for
sources that may change before the commit (checkpoint-engine reuses its buffers between
buckets of one request).

``commit`` is phase 2: a pure copy between validated, materialized, same-shape, same-dtype
tensors, which cannot fail for data reasons. Live weights are touched only by ``commit``, after
every rank staged and validated the whole request. Residual risk: only a device fault (a CUDA
error, the process dying) mid-commit could leave this rank half updated; the engine then marks
itself failed (``ReferenceEngine._two_phase``) instead of serving mixed weights.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollsafe.adapters.reference_engine.errors import ServerUnavailable, WeightUpdateError
from rollsafe.adapters.reference_engine.paths import check_dir
from rollsafe.adapters.reference_engine.profiling import profile_line
from rollsafe.wire.copy import copy_pairs
from rollsafe.wire.dtypes import dtype_name
from rollsafe.wire.finite import describe_non_finite, non_finite_index

__all__ = [
    "LM_HEAD",
    "ParamSpec",
    "ShardedCausalLM",
    "check_materialized",
    "load_config",
    "model_class",
]

LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ParamSpec:
    """Full (unsharded) shape and dtype of one named parameter."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def load_config(model_path: str | Path) -> Any:
    """Read ``config.json`` from a local directory (never the hub)."""
    from transformers import AutoConfig

    path = check_dir(model_path, what="model_path", must_contain=("config.json",))
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise WeightUpdateError(
            f"{path / 'config.json'}: cannot be read as a config: {exc}"
        ) from exc


def model_class(config: Any) -> type:
    """The transformers causal-LM class of ``config`` (imports its modeling module)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    mapping: Any = MODEL_FOR_CAUSAL_LM_MAPPING
    cls: type = mapping[type(config)]
    return cls


def _config_dtype(config: Any) -> torch.dtype:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, torch.dtype):
        return dt
    if isinstance(dt, str) and isinstance(getattr(torch, dt, None), torch.dtype):
        return getattr(torch, dt)  # type: ignore[no-any-return]
    return torch.float32


class ShardedCausalLM:
    """The model as held by one rank (trunk replicated, ``lm_head`` row-sharded)."""

    def __init__(
        self,
        config: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.dtype = dtype or _config_dtype(config)
        auto: Any = AutoModelForCausalLM
        if self.device.type == "cuda":
            # build (and randomly initialize) on the GPU in the serving dtype: on the host an
            # 8 GB model's fp32 init alone takes minutes; seeded per device, so every rank of
            # the engine (all on cuda) gets identical dummy weights
            with torch.random.fork_rng(devices=[self.device]), torch.device(self.device):
                torch.manual_seed(seed)
                full = auto.from_config(config, dtype=self.dtype)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # identical dummy weights on every rank
                full = auto.from_config(config)
        full = full.to(dtype=self.dtype, device=self.device).eval()
        full.requires_grad_(False)
        self.backbone: torch.nn.Module = full.model
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        head = full.lm_head.weight.detach()
        self.vocab_size = int(head.shape[0])
        self.hidden_size = int(head.shape[1])
        self.rows_per_rank = math.ceil(self.vocab_size / world_size)
        self.row_start = min(self.vocab_size, rank * self.rows_per_rank)
        self.row_end = min(self.vocab_size, self.row_start + self.rows_per_rank)
        self.lm_head_shard: torch.Tensor = head[self.row_start : self.row_end].clone()
        del full
        self._params: dict[str, torch.nn.Parameter] = {
            f"model.{n}": p for n, p in self.backbone.named_parameters()
        }
        self.specs: dict[str, ParamSpec] = {
            n: ParamSpec(tuple(p.shape), p.dtype) for n, p in self._params.items()
        }
        if not self.tied:
            self.specs[LM_HEAD] = ParamSpec((self.vocab_size, self.hidden_size), self.dtype)
        self._staged: dict[str, torch.Tensor] = {}
        self._sessions: dict[str, Any] = {}
        self.released = False
        self._backup: dict[str, torch.Tensor] | None = None
        # transformers >= 5.x names the KV cache ``cache``; older releases ``past_key_values``
        params = inspect.signature(self.backbone.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ---- weights ---------------------------------------------------------------------------
    def validate(
        self,
        metas: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
        *,
        require_all: bool = False,
        where: str = "",
    ) -> None:
        """Raise :class:`WeightUpdateError` naming the first unknown/mis-shaped/mis-typed key."""
        seen: set[str] = set()
        prefix = f"{where}: " if where else ""
        for name, shape, dtype in metas:
            spec = self.specs.get(name)
            if spec is None:
                raise WeightUpdateError(f"{prefix}unknown parameter {name!r}")
            if name in seen:
                raise WeightUpdateError(f"{prefix}parameter {name!r} given twice")
            seen.add(name)
            if tuple(shape) != spec.shape:
                raise WeightUpdateError(
                    f"{prefix}parameter {name!r}: shape {list(shape)} does not match the model's "
                    f"{list(spec.shape)}"
                )
            if dtype != spec.dtype:
                raise WeightUpdateError(
                    f"{prefix}parameter {name!r}: dtype {dtype_name(dtype)} does not match the "
                    f"model's {dtype_name(spec.dtype)}"
                )
        if require_all:
            missing = sorted(set(self.specs) - seen)
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise WeightUpdateError(f"{prefix}missing parameter {missing[0]!r}{more}")

    def stage(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        where: str = "",
        copy: bool = False,
        allow_non_finite: bool = False,
    ) -> None:
        """Phase 1 of a commit: validate a whole call's tensors, then record them for
        :meth:`commit` (live weights untouched). Raises :class:`WeightUpdateError` naming the
        first bad tensor; nothing of the call is recorded then.

        Without ``copy`` the tensors themselves (often views of a sender's or a receive buffer)
        are recorded when they already lie contiguously on this rank's device or on the host:
        the caller guarantees they stay valid and unchanged until ``commit`` or ``discard``.
        ``copy=True`` copies them into private buffers on this rank's device. Unless
        ``allow_non_finite``, a tensor holding NaN or inf is refused (checked on the staged
        data, i.e. on this rank's ``lm_head`` rows only).
        """
        if self.released:
            raise ServerUnavailable("weights are released; resume_memory_occupation first")
        prefix = f"{where}: " if where else ""
        items = list(named)
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise WeightUpdateError(
                    f"{prefix}parameter {name!r} is a {type(t).__name__}, not a tensor"
                )
        self.validate(((n, tuple(t.shape), t.dtype) for n, t in items), where=where)
        for name in (n for n, _ in items):
            if name in self._staged:
                raise WeightUpdateError(f"{prefix}parameter {name!r} staged twice in one update")
        staged: dict[str, torch.Tensor] = {}
        for name, t in items:
            check_materialized(name, t, prefix)
            if name == LM_HEAD:
                t = t[self.row_start : self.row_end]
            staged[name] = self._placed(name, t, copy, prefix)
        if not allow_non_finite:
            t0 = time.perf_counter()
            bad = non_finite_index(list(staged.values()))
            profile_line("stage.finite_check", 0, time.perf_counter() - t0)
            if bad is not None:
                name = list(staged)[bad]
                raise WeightUpdateError(
                    f"{prefix}parameter {name!r} {describe_non_finite(staged[name])}; nothing "
                    "was applied (set allow_non_finite to apply non-finite weights)"
                )
        self._staged.update(staged)

    def _placed(self, name: str, t: torch.Tensor, copy: bool, prefix: str) -> torch.Tensor:
        """``t`` as recorded for the commit: itself, or a contiguous copy on this device."""
        keep = (
            not copy and t.is_contiguous() and (t.device == self.device or t.device.type == "cpu")
        )
        if keep:
            return t
        try:
            return t.to(self.device, copy=True, memory_format=torch.contiguous_format)
        except Exception as exc:  # e.g. an accelerator this process cannot read from
            raise WeightUpdateError(
                f"{prefix}parameter {name!r} on {t.device} cannot be copied to {self.device}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def commit(self) -> list[str]:
        """Copy every staged tensor into the live weights (one copy per byte, straight from the
        staged source, across devices if need be); returns the updated names."""
        if self.released and self._staged:
            raise ServerUnavailable("weights are released; resume_memory_occupation first")
        names = sorted(self._staged)
        try:
            with torch.no_grad():
                pairs = [
                    (self.lm_head_shard if name == LM_HEAD else self._params[name].data, t)
                    for name, t in self._staged.items()
                ]
                copy_pairs(pairs)
                if self.tied and "model.embed_tokens.weight" in self._staged:
                    emb = self._params["model.embed_tokens.weight"]
                    self.lm_head_shard.copy_(emb[self.row_start : self.row_end])
        finally:
            self._staged.clear()  # never keep references to a sender's memory past the request
        return names

    def discard(self) -> None:
        self._staged.clear()

    @property
    def staged_names(self) -> list[str]:
        return sorted(self._staged)

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's live tensors by full name (``lm_head.weight`` is this rank's rows)."""
        out: dict[str, torch.Tensor] = {n: p.detach() for n, p in self._params.items()}
        if not self.tied:
            out[LM_HEAD] = self.lm_head_shard
        return out

    def release(self, *, backup: bool = False) -> None:
        """Free the weight storage (shapes are kept in ``specs``).

        ``backup=True`` keeps a host copy that :meth:`resume` restores (vLLM sleep level 1);
        otherwise the weights are gone and resume allocates zeros for the next update to fill.
        """
        if self.released:
            return
        self._backup = None
        if backup:
            self._backup = {n: p.detach().to("cpu", copy=True) for n, p in self._params.items()}
            self._backup[LM_HEAD] = self.lm_head_shard.to("cpu", copy=True)
        for p in self._params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.lm_head_shard = torch.empty(0, dtype=self.dtype, device=self.device)
        self._sessions.clear()
        self._staged.clear()
        self.released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, as SGLang does

    def resume(self) -> None:
        """Re-allocate weight storage: the host backup if one was kept, else zeros."""
        if not self.released:
            return
        backup = self._backup or {}
        for n, p in self._params.items():
            b = backup.get(n)
            p.data = (
                b.to(self.device)
                if b is not None
                else torch.zeros(self.specs[n].shape, dtype=p.dtype, device=self.device)
            )
        b = backup.get(LM_HEAD)
        self.lm_head_shard = (
            b.to(self.device)
            if b is not None
            else torch.zeros(
                (self.row_end - self.row_start, self.hidden_size),
                dtype=self.dtype,
                device=self.device,
            )
        )
        self._backup = None
        self.released = False

    # ---- compute ---------------------------------------------------------------------------
    def forward(self, sid: str, token_ids: list[int]) -> torch.Tensor:
        """Feed ``token_ids`` to session ``sid`` (new or cached); return this rank's logits."""
        if self.released:
            raise ServerUnavailable("weights are released (release_memory_occupation)")
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            kwargs = {self._cache_kw: self._sessions.get(sid)}
            out = self.backbone(input_ids=ids, use_cache=True, **kwargs)
            self._sessions[sid] = getattr(out, self._cache_kw)
            hidden = out.last_hidden_state[0, -1]
            return torch.nn.functional.linear(hidden, self.lm_head_shard).float()

    def end(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def drop_sessions(self) -> None:
        self._sessions.clear()


def full_named_tensors(
    local: Mapping[str, torch.Tensor], gathered_lm_head: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Rank 0's local tensors with ``lm_head.weight`` replaced by the gathered full matrix."""
    out = dict(local)
    if gathered_lm_head is not None:
        out[LM_HEAD] = gathered_lm_head
    return out


def check_materialized(name: str, t: torch.Tensor, prefix: str = "") -> None:
    """Raise :class:`WeightUpdateError` unless ``t`` is a plain, dense tensor whose data can be
    read: not on the ``meta`` device, strided, not quantized or nested, its storage holding
    every element its sizes and strides address."""
    what = f"{prefix}parameter {name!r}"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise WeightUpdateError(f"{what} is a {type(t).__name__}, not a plain tensor")
    if t.device.type == "meta":
        raise WeightUpdateError(f"{what} is on the meta device: it has no data (not materialized)")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise WeightUpdateError(f"{what} has layout {t.layout}; only dense tensors are accepted")
    if t.numel() == 0:
        return
    if any(s < 0 for s in t.stride()) or t.storage_offset() < 0:
        raise WeightUpdateError(f"{what} has negative strides or offset")
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    try:
        have = t.untyped_storage().nbytes()
    except Exception as exc:
        raise WeightUpdateError(f"{what} has no readable storage: {exc}") from exc
    need = (last + 1) * t.element_size()
    if have < need:
        raise WeightUpdateError(
            f"{what} addresses {need} bytes of a storage of {have}: it does not hold its data"
        )
