"""``ipc`` weight transport: colocated trainer and engine share memory (CUDA IPC / shared memory).

``register(weights, version)`` records the source tensors (no copy: the update reads them as they
are when it runs; if they changed in place since, e.g. an optimizer step, ``update`` refuses
with :class:`~rollsafe.transports.base.StaleRegistration` -- register the new version), the
bucket plan and the version. ``update(targets)`` packs dtype-homogeneous
flattened buckets (:mod:`rollsafe.transports.pipeline`: two reusable buffers, bucket ``i + 1``
packed while the engine loads bucket ``i``, each bucket packed once for all targets) and POSTs
``/update_weights_from_tensor`` with ``load_format="flattened_bucket"`` and one serialized entry
per engine rank (``tp_size`` entries, each pickled separately so the shared-memory reference
counts stay balanced). A buffer is reused only after every engine that was sent it answered.

On CPU the buffers live in shared memory (torch ``file_system`` strategy: the payload names the
shared file); on CUDA the payload carries CUDA IPC handles. Extra accelerator memory while
pushing is two buffers of the largest bucket that must be packed (``bucket_bytes``, or a single
tensor bigger than that which is not contiguous on the device); memory that can be handed over
as is goes without a copy: a contiguous tensor alone in its bucket, and tensors that lie back to
back in one storage (a trainer's flat parameter buffer, as Megatron keeps it or as
:func:`~rollsafe.transports.contiguous.flatten_parameters` makes it), which form *direct*
buckets of up to ``direct_bucket_bytes`` (default: a whole run per call) at no extra memory.
CUDA buffers are dropped after each update (the trainer gets the memory back between syncs);
CPU shared-memory buffers are kept.

**The finite check** (``check_finite``, default on): a version holding NaN or inf is refused
with :class:`~rollsafe.transports.base.NonFiniteWeights` naming the first such weight, and
nothing of it is registered or pushed. The transport checks the registered tensors itself, one
pass over each byte (:func:`rollsafe.wire.finite.non_finite_index`), and tells each engine so
(``finite_checked``), so the engines skip their own pass: once per version instead of once per
engine and bucket. What the verdict is bound to: the version id and the registration's own
tensor references (detached at ``register``: their storage, offset, shape, stride and dtype
cannot change afterwards; only the bytes can). The rule: every ``register`` checks (registering
the same version id again checks again: never a cache hit across registers); the **first**
``update`` of a registration uses that verdict, since ``update`` has just refused any change
its staleness check sees (version counter, fingerprint); every **later** ``update`` of the same
registration (a recovery's targeted push, a re-push) checks again before it pushes, one pass
for all its targets, and is refused, nothing pushed, if a weight is no longer finite. The one
window left is a write between ``register`` and the first ``update`` that the staleness check
cannot see (through ``.data``, touching no sampled element): the same window in which such a
write would already push unregistered bytes; register a copy there (``snapshot_weights``). With
``check_finite=False`` nothing is checked here and each engine checks every call itself.

Version and cache flush travel with the **last** bucket only: an engine that failed half way
keeps reporting its old version (the fleet marks the target failed either way). Per-target
failures are reported in the :class:`~rollsafe.transports.base.UpdateReport`, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch

from rollsafe.errors import InvalidArgument
from rollsafe.ports import EngineTarget
from rollsafe.transports.base import NonFiniteWeights, StagedTransport, TransportError
from rollsafe.transports.delta import DeltaSettings
from rollsafe.transports.pipeline import (
    BucketPlan,
    BucketStream,
    BufferPool,
    check_tensors,
    delta_header_first,
    direct_view,
    plan_buckets,
)
from rollsafe.wire.bucket import FlatBucket, serialize_bucket
from rollsafe.wire.finite import describe_non_finite, non_finite_index

__all__ = ["DEFAULT_IPC_BUCKET_BYTES", "IPCTransport"]

#: Default bucket size: large enough that per-call overhead (HTTP, pickling, the engine's
#: two-phase commit) is small, small enough that two buckets are a small share of GPU memory.
DEFAULT_IPC_BUCKET_BYTES = 128 << 20
_UNLIMITED = 1 << 62


class IPCTransport(StagedTransport):
    """Push registered weights to colocated engines through shared memory / CUDA IPC.

    ``world_size``: size of the target rank space (the fleet's engine ranks).
    ``bucket_bytes``: bucket size of packed buckets. ``direct_bucket_bytes``: cap of *direct*
    buckets -- tensors that lie back to back in one storage (a flat parameter buffer, see
    :func:`~rollsafe.transports.contiguous.flatten_parameters`) travel as a slice of it, with
    no copy and no extra memory, so by default (``None``) a whole run goes in one call.
    ``device``: where buckets are packed (default: the tensors'
    device; ``"cuda"`` gathers CPU tensors onto the GPU). ``request_timeout``: seconds each
    engine call may take. ``flush_cache``: ask the engine to drop its KV cache with the last
    bucket. ``double_buffer``: pack the next bucket while the engine loads the current one (two
    buffers) instead of one buffer. ``keep_buffers``: keep the two pack buffers between updates
    (default: on CPU yes -- shared memory, no re-faulting; on CUDA no -- the trainer gets the
    memory back between syncs). ``check_finite``: refuse a version holding NaN or inf here, once
    per version, and tell the engines they need not check it (module docstring); False leaves
    the check to each engine.
    """

    name = "ipc"
    reads_by_reference = True
    supports_delta = True

    def __init__(
        self,
        world_size: int,
        *,
        bucket_bytes: int = DEFAULT_IPC_BUCKET_BYTES,
        direct_bucket_bytes: int | None = None,
        device: torch.device | str | None = None,
        request_timeout: float = 600.0,
        flush_cache: bool = True,
        double_buffer: bool = True,
        keep_buffers: bool | None = None,
        allow_missing_prefixes: Iterable[str] = ("mtp.",),
        max_parallel_targets: int = 8,
        check_finite: bool = True,
        delta: DeltaSettings | None = None,
    ) -> None:
        super().__init__(
            world_size,
            allow_missing_prefixes=allow_missing_prefixes,
            max_parallel_targets=max_parallel_targets,
            delta=delta,
        )
        if bucket_bytes <= 0:
            raise InvalidArgument(
                "bucket_bytes", f"bucket_bytes must be positive, got {bucket_bytes}"
            )
        if request_timeout <= 0:
            raise InvalidArgument(
                "request_timeout", f"request_timeout must be positive, got {request_timeout}"
            )
        if direct_bucket_bytes is not None and direct_bucket_bytes <= 0:
            raise InvalidArgument(
                "direct_bucket_bytes",
                f"direct_bucket_bytes must be positive, got {direct_bucket_bytes}",
            )
        self.bucket_bytes = int(bucket_bytes)
        self.direct_bucket_bytes = direct_bucket_bytes
        self.device = torch.device(device) if device is not None else None
        self.request_timeout = float(request_timeout)
        self.flush_cache = flush_cache
        self.slots = 2 if double_buffer else 1
        self.keep_buffers = keep_buffers
        self._pool: BufferPool | None = None
        self._items: list[tuple[str, torch.Tensor]] = []
        self._plans: list[BucketPlan] = []
        self._pack_device: torch.device | None = None
        self._stream: BucketStream | None = None
        self._direct: list[torch.Tensor | None] = []
        self.check_finite = bool(check_finite)
        #: seconds of the last finite check (register or a later update); None: none ran
        self.finite_check_s: float | None = None
        #: the register-time verdict is still unused by an update
        self._finite_fresh = False
        #: the current update's payloads say the sender checked them finite
        self._vouch = False

    @property
    def plans(self) -> tuple[BucketPlan, ...]:
        """The bucket plan of the registered version (empty when nothing is registered)."""
        return tuple(self._plans)

    @property
    def direct_buckets(self) -> int:
        """How many buckets of the registered version travel as is (no copy, no buffer)."""
        return sum(1 for d in self._direct if d is not None)

    # ------------------------------------------------------------------ register
    def _stage(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Sequence[int], Sequence[str]]:
        self._unstage()
        device = check_tensors(items, device=self.device)
        shared_cpu = device.type == "cpu"

        def sendable(t: torch.Tensor) -> bool:
            # what BucketStream can hand over as is: on the pack device, and on CPU already in
            # shared memory (the payload names the shared file)
            return t.device == device and (not shared_cpu or bool(cast(Any, t).is_shared()))

        plans = plan_buckets(
            items,
            self.bucket_bytes,
            direct_bucket_bytes=self.direct_bucket_bytes or _UNLIMITED,
            sendable=sendable,
        )
        if self.check_finite:
            self._check_finite(items, version)
        self._items = [(n, t.detach()) for n, t in items]
        self._plans, self._pack_device = plans, device
        # the registered tensors are fixed objects: which plans travel as is cannot change
        self._direct = [direct_view(self._items, p, device=device, shared=True) for p in plans]
        self._plans, self._direct = delta_header_first(self._items, self._plans, self._direct)
        if self._pool is not None and self._pool.device != device:
            self._pool = None
        # the verdict of this registration (the _check_finite above), for its first update
        self._finite_fresh = self.check_finite
        return range(self.registration.world_size), [n for n, _ in items]

    def _unstage(self) -> None:
        self._items, self._plans, self._pack_device = [], [], None
        self._direct = []
        self._finite_fresh, self._vouch = False, False

    def _check_finite(self, items: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        """One pass over every byte of ``items``; raise :class:`NonFiniteWeights` naming the
        first weight holding NaN or inf."""
        t0 = time.perf_counter()
        bad = non_finite_index([t.detach() for _, t in items])
        self.finite_check_s = time.perf_counter() - t0
        if bad is not None:
            name, tensor = items[bad]
            raise NonFiniteWeights(
                name,
                f"{self.name}: weight {name!r} of v{version} {describe_non_finite(tensor)}; "
                "nothing was pushed (IPCTransport(check_finite=False) leaves the check to each "
                "engine)",
            )

    def _before_begin_update(self, targets: Sequence[EngineTarget]) -> None:
        self._vouch = False
        if not self.check_finite or self.version is None:
            return
        if not self._finite_fresh:  # a later push of this registration: check again
            self._check_finite(self._items, self.version)
        self._finite_fresh = False
        self._vouch = True

    # ------------------------------------------------------------------ update
    def _before_push(self, targets: Sequence[EngineTarget]) -> None:
        if self._pack_device is None or not self._plans:
            raise TransportError(f"{self.name}: no bucket plan registered")
        if self._pool is None:
            self._pool = BufferPool(self._pack_device, shared=True, slots=self.slots)
        self._stream = BucketStream(
            self._items,
            self._plans,
            device=self._pack_device,
            shared=True,
            consumers=[t.name for t in targets],
            slots=self.slots,
            pool=self._pool,
            direct=self._direct,
        )

    def _push(self, target: EngineTarget) -> int:
        stream = self._stream
        assert stream is not None and self.version is not None
        version = str(self.version)
        moved = 0
        try:
            last = len(stream) - 1
            for i in range(len(stream)):
                bucket = stream.get(target.name, i, timeout=self.request_timeout)
                assert isinstance(bucket, FlatBucket)  # ipc plans are never unpacked
                # metadata built by plan_buckets at register: no need to re-check it per call
                payloads = [serialize_bucket(bucket, validate=False) for _ in range(target.tp_size)]
                try:
                    target.client.update_weights_from_tensor(
                        payloads,
                        load_format="flattened_bucket",
                        flush_cache=self.flush_cache and i == last,
                        weight_version=version if i == last else None,
                        timeout=self.request_timeout,
                        finite_checked=self._vouch,
                    )
                except Exception as exc:
                    raise TransportError(
                        f"target {target.name!r} (ranks {list(target.ranks)}): bucket {i + 1}/"
                        f"{len(stream)} ({bucket.dtype}, {len(bucket.metas)} tensors from "
                        f"{bucket.metas[0].name!r}) failed: {exc}"
                    ) from exc
                stream.release(target.name, i)
                moved += bucket.nbytes
        finally:
            stream.leave(target.name)
        return moved

    def _after_push(self, targets: Sequence[EngineTarget]) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        keep = self.keep_buffers
        if keep is None:
            keep = self._pack_device is not None and self._pack_device.type == "cpu"
        if not keep:
            self._pool = None

    def close(self) -> None:
        self._unstage()
        self._pool = None
        super().close()
