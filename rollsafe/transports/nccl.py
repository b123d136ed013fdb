"""``nccl`` weight transport: disaggregated engines receive a broadcast from trainer rank 0.

``register(weights, version)`` records the source tensors, the bucket plan and the version (no
copy; an ``update`` after the tensors changed in place refuses with
:class:`~rollsafe.transports.base.StaleRegistration`). ``update(targets)`` gives **every target
its own process group** (trainer rank 0 plus the target's ``tp_size`` engine ranks at
``rank_offset=1``). Per target, in its own thread:

1. unless a group is kept for the target from an earlier update (``keep_groups``, the default,
   as slime and verl keep theirs: NCCL communicator set-up costs far more than a small update),
   ``/init_weights_update_group`` (vLLM: ``/init_weight_transfer_engine``) is sent while the
   trainer joins the group (:func:`rollsafe.wire.group.open_weight_update_group`, rank 0,
   store master); both must finish within ``group_timeout``. Both join under one name
   (:func:`rollsafe.wire.group_names.join_name`): a fresh one per group for SGLang, which
   takes it from the request; the fixed ``VLLM_WEIGHT_TRANSFER_GROUP`` for vLLM, whose one
   group has no name (each target's group still has its own store port). A kept group is
   dropped when the target's engine address or rank layout changed; one whose engine lost it
   (a restart on the same address) fails on its first bucket, before anything was applied, and
   is re-formed once. A real vLLM over NCCL (``EngineTarget.rendezvous == "vllm"``, the
   ``vllm`` engine kind's trait) is joined as vLLM's ranks expect: rank 0 of vLLM's
   ``StatelessProcessGroup`` (a ``TCPStore`` without prefix) and vLLM's ``PyNcclCommunicator``
   (:mod:`rollsafe.wire.vllm_group`; ``vllm`` must be importable in this process, else the
   update is refused at once with ``VLLMRendezvousUnavailable``); the buckets then go by
   PyNccl's ``ncclBroadcast`` in the same packed chunks;
2. for every bucket, ``/update_weights_from_distributed`` is sent while the trainer broadcasts
   the bucket, and the next bucket follows the engine's answer. An engine answers once the
   receive and its copies into the weights are queued on its GPU (SGLang does no device sync
   there either; the reference engine syncs only on the call that carries the version), so
   bucket ``i + 1`` moves while the engine copies bucket ``i``. Small tensors are packed into
   one flat buffer of one dtype (``load_format="flattened_bucket"``), tensors back to back in
   one storage as one slice of it (same format, no copy), and big contiguous tensors one
   broadcast each (``load_format`` unset, no copy: ``unpacked_min_bytes``); version and cache
   flush travel with the last bucket only;
3. the group is kept for the next update; after a failure (or with ``keep_groups=False``)
   ``/destroy_weights_update_group`` is sent (best effort) and the trainer's side is closed.
   :meth:`NCCLTransport.close_groups` / :meth:`NCCLTransport.forget` release kept groups.

Why one group per target: a broadcast in a group with a dead member fails for every member, so
one engine killed mid-update would fail every target of a shared group. Separate groups isolate
it: the others finish, and a subset re-sync (only the recovered group) never touches the
others. The cost is that rank 0 sends each bucket once per target instead of once per update
(NCCL's pipelined broadcast would make a shared group's cost nearly independent of the number
of targets); the CPU benchmark measures it (``benchmarks/bench_transports_cpu.py``). Buckets
are packed once for all targets, at most two ahead (:mod:`rollsafe.transports.pipeline`).

Every wait is bounded: group set-up and each bucket by ``group_timeout``, HTTP calls by
``group_timeout`` plus a margin. If the engine answers an error while the trainer's broadcast
is still pending (gloo cannot cancel it), the pending work and its group are handed to a reaper
thread that waits for gloo's own timeout and then drops them; the pushing thread returns at once.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rollsafe.concurrency import DaemonCall, Outcome, start_daemon
from rollsafe.errors import InvalidArgument
from rollsafe.net import free_port
from rollsafe.ports import EngineTarget
from rollsafe.transports.base import NonFiniteWeights, StagedTransport, TransportError
from rollsafe.transports.delta import DeltaSettings, is_delta_refusal
from rollsafe.transports.pipeline import (
    BucketPlan,
    BucketStream,
    TensorList,
    check_tensors,
    delta_header_first,
    direct_view,
    plan_buckets,
    split_unpacked,
)
from rollsafe.wire.bucket import FlatBucket, packed_chunks
from rollsafe.wire.finite import describe_non_finite, non_finite_index
from rollsafe.wire.group import WeightUpdateGroup, host_store, open_weight_update_group
from rollsafe.wire.group_names import RENDEZVOUS_TORCH, RENDEZVOUS_VLLM, join_name
from rollsafe.wire.vllm_group import (
    VLLMWeightTransferGroup,
    open_vllm_weight_transfer_group,
    require_vllm_rendezvous,
)

__all__ = ["DEFAULT_NCCL_BUCKET_BYTES", "NCCLTransport"]

log = logging.getLogger("rollsafe.transports.nccl")

#: Default bucket size for broadcasts. Each bucket is one HTTP call (about 1.5-3 ms round trip),
#: so a bucket should take several times that on the wire: measured on two NVLinked H200s
#: (8.06 GiB, ``benchmarks/gpu/multi_gpu.py``), 512 MiB / 1 / 2 / 4 / 8 GiB buckets reached
#: 0.58 / 0.87 / 0.84 / 0.78 / 0.69 of a raw NCCL broadcast (flat trainer buffer). Memory: the
#: trainer packs separately allocated tensors into two buckets, the reference engine receives
#: into two.
DEFAULT_NCCL_BUCKET_BYTES = 1 << 30
#: Per backend: contiguous tensors of at least this size are broadcast one by one, without
#: packing (0: pack them all). A gloo broadcast costs a few milliseconds on its own (measured
#: on 2 CPU cores: 16 MiB messages reach 2.0 GB/s, 64 MiB ones 3.2 GB/s), more than packing
#: such a tensor, so only very big tensors skip packing there. On NVLinked H200s packing won:
#: 8 GB of separately allocated Qwen3-4B tensors in 1 GiB buckets reached 0.72-0.74x a raw
#: broadcast packed and 0.57-0.62x with tensors of 1 MiB and up sent one by one (the packing
#: copy runs on the trainer's GPU two buckets ahead; per-tensor collectives cost on both sides).
#: Set it to save the trainer's two packing buffers.
DEFAULT_UNPACKED_MIN_BYTES: dict[str, int] = {"gloo": 64 << 20, "nccl": 0}
#: Seconds added to ``group_timeout`` for the HTTP calls that wrap a collective.
HTTP_MARGIN_S = 30.0
#: Seconds the engine gets to leave a group after an update (best effort).
DESTROY_TIMEOUT_S = 10.0


class NCCLTransport(StagedTransport):
    """Push registered weights to disaggregated engines by broadcast (nccl on GPU, gloo on CPU).

    ``world_size``: size of the target rank space (the fleet's engine ranks).
    ``master_address``: address engines reach the trainer's store on. ``master_port``: base port
    (a new group takes the lowest ``master_port + k`` no kept group owns); None picks free
    ports. ``backend``:
    ``"gloo"``/``"nccl"``, None = nccl when the tensors are on CUDA, else gloo.
    ``bucket_bytes``: bucket size. ``group_timeout``: bound on group set-up and on each bucket.
    ``flush_cache``: ask the engine to drop its KV cache with the last bucket.
    ``unpacked_min_bytes``: contiguous tensors at least this big, already where the broadcast
    runs, skip the packing copy: they travel in calls of their own, one broadcast per tensor
    (``load_format`` unset, the non-flattened format); tensors back to back in one storage
    (a flat parameter buffer) are broadcast as one slice; only the rest is packed. None: the
    backend's default (:data:`DEFAULT_UNPACKED_MIN_BYTES`); 0: pack every tensor that is not
    already contiguous in one storage. ``keep_groups``: keep each target's weight-update group
    for the next update (default) instead of forming and destroying one per update.
    """

    name = "nccl"
    reads_by_reference = True
    supports_delta = True

    def __init__(
        self,
        world_size: int,
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
        bucket_bytes: int = DEFAULT_NCCL_BUCKET_BYTES,
        group_timeout: float = 120.0,
        device: torch.device | str | None = None,
        flush_cache: bool = True,
        double_buffer: bool = True,
        allow_missing_prefixes: Iterable[str] = ("mtp.",),
        max_parallel_targets: int = 8,
        unpacked_min_bytes: int | None = None,
        keep_groups: bool = True,
        delta: DeltaSettings | None = None,
        check_finite: bool = True,
    ) -> None:
        super().__init__(
            world_size,
            allow_missing_prefixes=allow_missing_prefixes,
            max_parallel_targets=max_parallel_targets,
            delta=delta,
        )
        #: refuse a version holding NaN or inf at register (one pass over its bytes), so that
        #: nothing of it reaches an engine that would load it (the real vLLM does)
        self.check_finite = bool(check_finite)
        #: seconds of the last finite check (None: none ran)
        self.finite_check_s: float | None = None
        if backend not in (None, "gloo", "nccl"):
            raise InvalidArgument(
                "backend", f"backend must be 'gloo', 'nccl' or None, got {backend!r}"
            )
        if bucket_bytes <= 0:
            raise InvalidArgument(
                "bucket_bytes", f"bucket_bytes must be positive, got {bucket_bytes}"
            )
        if group_timeout <= 0:
            raise InvalidArgument(
                "group_timeout", f"group_timeout must be positive, got {group_timeout}"
            )
        if unpacked_min_bytes is not None and unpacked_min_bytes < 0:
            raise InvalidArgument(
                "unpacked_min_bytes", f"unpacked_min_bytes must be >= 0, got {unpacked_min_bytes}"
            )
        self.unpacked_min_bytes = unpacked_min_bytes
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.bucket_bytes = int(bucket_bytes)
        self.group_timeout = float(group_timeout)
        self.device = torch.device(device) if device is not None else None
        self.flush_cache = flush_cache
        self.slots = 2 if double_buffer else 1
        self._items: list[tuple[str, torch.Tensor]] = []
        self._plans: list[BucketPlan] = []
        self._pack_device: torch.device | None = None
        self._direct: list[torch.Tensor | None] = []
        self._stream: BucketStream | None = None
        self._ports_in_use: set[int] = set()
        self._calls: ThreadPoolExecutor | None = None
        self._closing = threading.Event()
        self.keep_groups = keep_groups
        self._uid = uuid.uuid4().hex[:8]
        self._serial = 0
        self._live: dict[str, _LiveGroup] = {}
        self._live_lock = threading.Lock()

    @property
    def plans(self) -> tuple[BucketPlan, ...]:
        return tuple(self._plans)

    def resolved_backend(self) -> str:
        """The backend the next update uses."""
        if self.backend is not None:
            return self.backend
        dev = self._pack_device or self.device
        return "nccl" if dev is not None and dev.type == "cuda" else "gloo"

    # ------------------------------------------------------------------ register
    def _stage(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Sequence[int], Sequence[str]]:
        self._unstage()
        device = check_tensors(items, device=self.device)
        backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and device.type != "cuda":
            raise TransportError(
                f"{self.name}: backend 'nccl' needs the buckets on CUDA, weights are on {device}; "
                "pass device='cuda' or backend='gloo'"
            )
        if backend == "gloo" and device.type != "cpu":
            device = torch.device("cpu")  # gloo broadcasts host buffers: pack there
        if self.check_finite:
            self._check_finite(items, version)
        self._items = [(n, t.detach()) for n, t in items]
        plans = plan_buckets(self._items, self.bucket_bytes)
        self._pack_device = device
        # fixed registered objects: which plans are broadcast straight from their storage
        direct = [direct_view(self._items, p, device=device, shared=False) for p in plans]
        min_bytes = self.unpacked_min_bytes
        if min_bytes is None:
            min_bytes = DEFAULT_UNPACKED_MIN_BYTES[backend]
        if min_bytes > 0:
            # big contiguous tensors are broadcast one by one, as they are: no packing copy
            plans, direct = split_unpacked(
                self._items,
                plans,
                direct,
                device=device,
                bucket_bytes=self.bucket_bytes,
                min_bytes=min_bytes,
            )
        self._plans, self._direct = delta_header_first(self._items, plans, direct)
        return range(self.registration.world_size), [n for n, _ in items]

    def _check_finite(self, items: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        """One pass over every byte of ``items``; raise :class:`NonFiniteWeights` naming the
        first weight holding NaN or inf (nothing is registered, nothing pushed)."""
        t0 = time.perf_counter()
        bad = non_finite_index([t.detach() for _, t in items])
        self.finite_check_s = time.perf_counter() - t0
        if bad is not None:
            name, tensor = items[bad]
            raise NonFiniteWeights(
                name,
                f"{self.name}: weight {name!r} of v{version} {describe_non_finite(tensor)}; "
                "nothing was pushed (NCCLTransport(check_finite=False) leaves the check to each "
                "engine)",
            )

    def _unstage(self) -> None:
        self._items, self._plans, self._pack_device = [], [], None
        self._direct = []

    # ------------------------------------------------------------------ update
    def _before_begin_update(self, targets: Sequence[EngineTarget]) -> None:
        """A real vLLM target over NCCL is joined with vLLM's own classes: without ``vllm`` in
        this process the update is refused at once (:class:`~rollsafe.wire.vllm_group.
        VLLMRendezvousUnavailable`), before any engine is asked to join."""
        if self.resolved_backend() != "nccl":
            return
        for t in targets:
            if t.rendezvous == RENDEZVOUS_VLLM:
                require_vllm_rendezvous(f"{self.name} transport, target {t.name!r}")
                return

    def _before_push(self, targets: Sequence[EngineTarget]) -> None:
        if self._pack_device is None or not self._plans:
            raise TransportError(f"{self.name}: no bucket plan registered")
        self._ports_in_use = set()  # ports of groups being formed in this update
        # two HTTP calls in flight per target at most (init/update/destroy + one spare)
        self._calls = ThreadPoolExecutor(
            max(2, 2 * len(targets)), thread_name_prefix=f"{self.name}-http"
        )
        self._stream = BucketStream(
            self._items,
            self._plans,
            device=self._pack_device,
            shared=False,
            consumers=[t.name for t in targets],
            slots=self.slots,
            direct=self._direct,
        )

    def _push(self, target: EngineTarget) -> int:
        backend = self.resolved_backend()
        world = 1 + target.tp_size
        url = str(getattr(target.client, "url", ""))
        with self._live_lock:
            live = self._live.pop(target.name, None)
        if live is not None and (live.url, live.world, live.backend, live.rendezvous) != (
            url,
            world,
            backend,
            _rendezvous(target, backend),
        ):
            self._drop(live, target, reason="its engine or layout changed")
            live = None
        if live is not None:
            try:
                return self._push_buckets(target, live)
            except _FirstBucketFailed as exc:
                # a kept group whose engine side is gone (the engine restarted on the same
                # address): nothing was applied; build a fresh group once
                log.info(
                    "%s: kept group failed on its first bucket (%s); re-forming it",
                    target.name,
                    exc.__cause__,
                )
        try:
            live = self._form(target, world, backend, url)
        except BaseException:
            # this target takes no bucket: the packer must not wait for it (the other targets
            # of the update go on)
            stream = self._stream
            if stream is not None:
                stream.leave(target.name)
            raise
        return self._push_buckets(target, live)

    def _form(self, target: EngineTarget, world: int, backend: str, url: str) -> _LiveGroup:
        """Form the target's group: the engine's init call and the trainer's join, concurrently."""
        calls = self._calls
        assert calls is not None
        where = f"target {target.name!r} (ranks {list(target.ranks)})"
        self._serial += 1
        dialect = target.client.dialect
        # both ends must join under one name: SGLang takes ours from the request; vLLM's group
        # has no name (none travels), so its ranks and we join under the fixed one
        group_name = join_name(dialect, f"rollsafe-{self._uid}-{self._serial}-{target.name}")
        rendezvous = _rendezvous(target, backend)
        store: Any = None
        if rendezvous == RENDEZVOUS_TORCH:
            # the store listens before the engine hears its port (host_store: a port picked
            # free and bound later was taken in between on a busy machine, seen under load)
            store, port = self._host_store(where, group_name, world)
        else:  # vLLM's StatelessProcessGroup binds its own store: a port picked free
            port = self._claim_port()
        # vLLM fixes its packing for the group's lifetime: packed, chunks of bucket_bytes
        extra: dict[str, Any] = (
            {"packed": True, "packed_buffer_size_bytes": self.bucket_bytes}
            if dialect == "vllm"
            else {}
        )
        if extra and target.delta_base_by_content and self._delta is not None:
            # rollsafe's vLLM CPU plugin keeps a host copy of what it loads, to apply deltas onto
            extra["keep_delta_base"] = True
        init = calls.submit(
            target.client.init_weights_update_group,
            self.master_address,
            port,
            1,
            world,
            group_name=group_name,
            backend=backend,
            timeout=self.group_timeout + HTTP_MARGIN_S,
            **extra,
        )
        group = self._join(port, world, group_name, backend, init, where, rendezvous, store)
        return _LiveGroup(group, group_name, port, world, backend, url, rendezvous)

    def _host_store(self, where: str, group_name: str, world: int) -> tuple[Any, int]:
        """Rank 0's store for a new group, listening: on ``master_port + k`` (the smallest no
        kept or forming group owns) or, with ``master_port`` None, a port the system picks.
        A port that cannot be bound is a :class:`TransportError` naming it; the engine was
        told nothing."""
        port = 0 if self.master_port is None else self._claim_port()
        try:
            store = host_store(self.master_address, port, world, timeout_s=self.group_timeout)
        except Exception as exc:
            raise TransportError(
                f"{where}: the store of weight-update group {group_name!r} could not listen on "
                f"{self.master_address}:{port or '(any free port)'}: {exc}"
            ) from exc
        return store, int(store.port)

    def _wire(self, bucket: FlatBucket | TensorList, vllm: bool) -> list[torch.Tensor]:
        """What one call broadcasts, in order, in the target dialect's wire format.

        SGLang: a packed bucket is one uint8 buffer (``flattened_bucket``: its bytes, no copy);
        an unpacked one is one broadcast per tensor. vLLM (packed, fixed at init): the call's
        tensors cut into uint8 chunks by vLLM's packed rule
        (:func:`~rollsafe.wire.bucket.packed_chunks` with ``bucket_bytes``); a chunk of a
        packed bucket is a slice of it (no copy), one of an unpacked bucket is concatenated.
        """
        if not vllm:
            if isinstance(bucket, TensorList):
                return list(bucket.tensors)
            return [bucket.flat.view(torch.uint8)]
        if isinstance(bucket, TensorList):
            raw = [t.reshape(-1).view(torch.uint8) for t in bucket.tensors]
            return [
                raw[a] if b - a == 1 else torch.cat(raw[a:b])
                for a, b in packed_chunks([r.numel() for r in raw], self.bucket_bytes)
            ]
        size = bucket.flat.element_size()
        flat = bucket.flat.view(torch.uint8)
        metas = bucket.metas
        return [
            flat[metas[a].start * size : metas[b - 1].end * size]
            for a, b in packed_chunks([m.numel * size for m in metas], self.bucket_bytes)
        ]

    def _claim_port(self) -> int:
        """A store port for a new group: ``master_port + k`` for the smallest ``k`` no kept or
        forming group owns, or a free port when ``master_port`` is None."""
        if self.master_port is None:
            return free_port(self.master_address)
        with self._live_lock:
            taken = {g.port for g in self._live.values()} | self._ports_in_use
            port = self.master_port
            while port in taken:
                port += 1
            self._ports_in_use.add(port)
        return port

    def _push_buckets(self, target: EngineTarget, live: _LiveGroup) -> int:
        """Every bucket over ``live``; keeps the group afterwards (``keep_groups``) or tears it
        down. A failure always tears it down; :class:`_FirstBucketFailed` when nothing moved."""
        stream, calls = self._stream, self._calls
        assert stream is not None and calls is not None and self.version is not None
        where = f"target {target.name!r} (ranks {list(target.ranks)})"
        http_timeout = self.group_timeout + HTTP_MARGIN_S
        client = target.client
        group: _Group | None = live.group
        moved = 0
        ok = retry = False
        i = 0
        vllm = client.dialect == "vllm"
        try:
            last = len(stream) - 1
            version = str(self.version)
            for i in range(len(stream)):
                bucket = stream.get(target.name, i, timeout=self.group_timeout)
                unpacked = isinstance(bucket, TensorList)
                what = (
                    f"bucket {i + 1}/{len(stream)} ({bucket.dtype}, {len(bucket.metas)} tensors "
                    f"from {bucket.metas[0].name!r}{', unpacked' if unpacked else ''})"
                )
                call = calls.submit(
                    client.update_weights_from_distributed,
                    [m.name for m in bucket.metas],
                    [m.dtype for m in bucket.metas],
                    [list(m.shape) for m in bucket.metas],
                    group_name=live.group_name,
                    # unpacked: one broadcast per tensor, in order (the non-flattened format)
                    load_format=None if unpacked else "flattened_bucket",
                    flush_cache=self.flush_cache and i == last,
                    weight_version=version if i == last else None,
                    timeout=http_timeout,
                )
                works = [live.group.broadcast(t, 0) for t in self._wire(bucket, vllm)]
                try:
                    self._await_pair(works, call, f"{where}: {what}")
                except BaseException:
                    self._reap(live.group, works)
                    group = None
                    raise
                stream.release(target.name, i)
                moved += bucket.nbytes
            ok = True
        except TransportError as exc:
            # an engine that refused a delta on its first bucket answered: the group is fine,
            # the delta is not (the full push follows in the same update)
            refused = is_delta_refusal(str(exc))
            if i == 0 and moved == 0 and self.keep_groups and live.reused and not refused:
                retry = True
                raise _FirstBucketFailed(str(exc)) from exc
            raise
        finally:
            if ok and self.keep_groups:
                live.reused = True
                with self._live_lock:
                    self._live[target.name] = live
            else:
                # the engine side is best effort (a dead engine has nothing to destroy, a hung
                # one is given DESTROY_TIMEOUT_S); the trainer side is closed (or being reaped)
                self._destroy_remote(target, live.group_name)
                if group is not None:
                    group.close()
            if not retry:  # a retry takes the same buckets again
                stream.leave(target.name)
        return moved

    def _destroy_remote(self, target: EngineTarget, group_name: str) -> None:
        try:
            target.client.destroy_weights_update_group(group_name, timeout=DESTROY_TIMEOUT_S)
        except Exception as exc:
            log.warning("target %r: destroy_weights_update_group failed: %s", target.name, exc)

    def _drop(self, live: _LiveGroup, target: EngineTarget | None, *, reason: str) -> None:
        """Close a kept group (and ask its engine to leave it, when one is named)."""
        log.info("dropping weight-update group %s: %s", live.group_name, reason)
        if target is not None and live.url == str(getattr(target.client, "url", "")):
            self._destroy_remote(target, live.group_name)
        live.group.close()

    def forget(self, target_name: str) -> None:
        """Close the kept group of ``target_name`` (a retired or removed engine); its next push
        is full (deltas on)."""
        super().forget(target_name)
        with self._live_lock:
            live = self._live.pop(target_name, None)
        if live is not None:
            self._drop(live, None, reason="forgotten")

    @property
    def kept_groups(self) -> dict[str, str]:
        """Target name -> name of the weight-update group kept for it."""
        with self._live_lock:
            return {k: g.group_name for k, g in self._live.items()}

    def _join(
        self,
        port: int,
        world: int,
        group_name: str,
        backend: str,
        init: Future[Any],
        where: str,
        rendezvous: str = RENDEZVOUS_TORCH,
        store: Any = None,
    ) -> _Group:
        """Open rank 0's side of the group while the engine's init call runs; bounded.

        ``rendezvous``: rollsafe's ``torch.distributed`` group (over ``store``, listening
        already: :meth:`_host_store`), or (``"vllm"``, a real vLLM over NCCL) vLLM's
        ``StatelessProcessGroup`` + PyNccl on this transport's device
        (:func:`~rollsafe.wire.vllm_group.open_vllm_weight_transfer_group`). The join runs on a
        :class:`~rollsafe.concurrency.DaemonCall`: given up on, a group it forms late is closed
        on the joining thread (nobody will use it). A failure names its side: the engine's
        init call's reason when it failed, else the trainer's join error."""

        def join() -> _Group:
            if rendezvous == RENDEZVOUS_VLLM:
                return open_vllm_weight_transfer_group(
                    master_address=self.master_address,
                    master_port=port,
                    world_size=world,
                    device=self._pack_device,
                    timeout_s=self.group_timeout,
                )
            return open_weight_update_group(
                master_address=self.master_address,
                master_port=port,
                rank=0,
                world_size=world,
                group_name=group_name,
                backend=backend,
                timeout_s=self.group_timeout,
                store=store,
            )

        call = DaemonCall.start(join, name=f"rollsafe-join-{group_name}", on_late=_close_group)
        joined = call.future
        done = threading.Event()
        init.add_done_callback(lambda _: done.set())
        joined.add_done_callback(lambda _: done.set())
        deadline = self.group_timeout + 5.0
        try:
            if not _wait_both(init, joined, done, deadline):
                raise TransportError(
                    f"{where}: weight-update group {group_name!r} not formed within {deadline}s"
                )
            if _failed(init):
                init.result(timeout=0)  # an init failure names the engine's reason
            if _failed(joined):  # the trainer's side failed while the engine's call runs
                joined.result(timeout=0)
            init.result(timeout=0)
            return joined.result(timeout=0)
        except TransportError:
            _give_up(call)
            raise
        except Exception as exc:
            _give_up(call)
            raise TransportError(
                f"{where}: joining weight-update group {group_name!r} "
                f"({self.master_address}:{port}, world {world}, {backend}) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _await_pair(self, works: Sequence[Any], call: Future[Any], what: str) -> None:
        """Wait for the broadcasts and the engine's answer; the first failure wins; bounded."""
        done = threading.Event()
        members = [w.get_future() for w in works]
        bcast = members[0] if len(members) == 1 else torch.futures.collect_all(members)
        bcast.add_done_callback(lambda _: done.set())
        call.add_done_callback(lambda _: done.set())
        deadline = self.group_timeout
        if not _wait_both(call, _TorchFuture(bcast), done, deadline):
            raise TransportError(f"{what}: not done within {deadline}s (broadcast or engine)")
        if call.done() and call.exception() is not None:
            raise TransportError(f"{what}: engine refused or failed: {call.exception()}")
        if bcast.done():
            for member in members:  # collect_all completes even when a member failed
                try:
                    member.wait()
                except Exception as exc:
                    raise TransportError(f"{what}: broadcast failed: {exc}") from exc
        try:
            call.result(timeout=0)
        except Exception as exc:
            raise TransportError(f"{what}: engine refused or failed: {exc}") from exc

    def _reap(self, group: _Group, works: Sequence[Any]) -> None:
        """Hand a group with possibly pending work to a daemon thread that waits it out."""

        def reap() -> None:
            for work in works:
                try:
                    work.wait(datetime.timedelta(seconds=self.group_timeout))
                except Exception:
                    break  # the group is broken: the rest cannot finish either
            group.close()

        start_daemon(reap, name="rollsafe-nccl-reaper")

    def _after_push(self, targets: Sequence[EngineTarget]) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        calls, self._calls = self._calls, None
        if calls is not None:
            calls.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Drop the registered version and close every kept group (the engines are asked to
        leave them only through :meth:`close_groups`, which needs their clients)."""
        with self._live_lock:
            live, self._live = list(self._live.values()), {}
        for g in live:
            g.group.close()
        self._unstage()
        super().close()

    def close_groups(self, targets: Sequence[EngineTarget]) -> None:
        """Ask each target's engine to leave its kept group, then close the trainer's side."""
        for t in targets:
            with self._live_lock:
                live = self._live.pop(t.name, None)
            if live is not None:
                self._drop(live, t, reason="closed")


#: rank 0's side of a weight-update group: rollsafe's, or a real vLLM's (vLLM's own classes)
_Group = WeightUpdateGroup | VLLMWeightTransferGroup


def _rendezvous(target: EngineTarget, backend: str) -> str:
    """How ``target``'s ranks join a group of ``backend``: vLLM's way only over NCCL (a vLLM
    on CPU joins through rollsafe's ``rollsafe_gloo`` plugin, a ``torch.distributed`` group)."""
    return target.rendezvous if backend == "nccl" else RENDEZVOUS_TORCH


class _FirstBucketFailed(TransportError):
    """A kept group failed before any byte moved: safe to re-form it and retry once."""


class _LiveGroup:
    """A weight-update group kept between updates for one target."""

    def __init__(
        self,
        group: _Group,
        group_name: str,
        port: int,
        world: int,
        backend: str,
        url: str,
        rendezvous: str = RENDEZVOUS_TORCH,
    ) -> None:
        self.group = group
        self.group_name = group_name
        self.port = port
        self.world = world
        self.backend = backend
        self.url = url
        self.rendezvous = rendezvous
        self.reused = False


class _TorchFuture:
    """Adapter: the parts of ``torch.futures.Future`` that :func:`_wait_both` reads."""

    def __init__(self, fut: Any) -> None:
        self._fut = fut

    def done(self) -> bool:
        return bool(self._fut.done())

    def failed(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.wait()
        except Exception:
            return True
        return False


def _failed(f: Any) -> bool:
    if isinstance(f, _TorchFuture):
        return f.failed()
    return bool(f.done() and f.exception() is not None)


def _close_group(outcome: Outcome[_Group]) -> None:
    """A join given up on formed its group late: close it (nobody will use it)."""
    if outcome.ok and outcome.value is not None:
        outcome.value.close()


def _give_up(call: DaemonCall[_Group]) -> None:
    """The update gives up on a join: a still running one closes its group late; a finished one
    is closed now."""
    if not call.abandon():
        _close_group(call.outcome())


def _wait_both(a: Any, b: Any, signal: threading.Event, timeout: float) -> bool:
    """Wait until both ``a`` and ``b`` are done, or either failed; False on timeout."""
    deadline = _now() + timeout
    while True:
        if (a.done() and b.done()) or _failed(a) or _failed(b):
            return True
        left = deadline - _now()
        if left <= 0:
            return False
        signal.wait(min(left, 1.0))
        signal.clear()


def _now() -> float:
    return time.monotonic()
