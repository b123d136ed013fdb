"""``nccl`` weight transport: disaggregated engines receive a broadcast from trainer rank 0.

``register(weights, version)`` records the source tensors, the bucket plan and the version (no
copy). ``update(targets)`` gives **every target its own process group** (trainer rank 0 plus the
target's ``tp_size`` engine ranks at ``rank_offset=1``), built for this update only and torn
down after it. Per target, in its own thread:

1. ``/init_weights_update_group`` is sent while the trainer joins the group
   (:func:`rollsafe.adapters.reference_engine.collective.open_weight_update_group`, rank 0,
   store master); both must finish within ``group_timeout``;
2. for every bucket, ``/update_weights_from_distributed`` (``load_format="flattened_bucket"``,
   one flat buffer of one dtype per call) is sent while the trainer broadcasts the bucket (the
   engine's HTTP call blocks until it received it); version and cache flush travel with the last
   bucket only;
3. ``/destroy_weights_update_group``, and the trainer's side of the group is closed.

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
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rollsafe.adapters.reference_engine.collective import (
    WeightUpdateGroup,
    open_weight_update_group,
)
from rollsafe.transports.base import EngineTarget, StagedTransport, TransportError
from rollsafe.transports.pipeline import (
    BucketPlan,
    BucketStream,
    check_tensors,
    direct_view,
    plan_buckets,
)

__all__ = ["DEFAULT_NCCL_BUCKET_BYTES", "NCCLTransport"]

log = logging.getLogger("rollsafe.transports.nccl")

#: Default bucket size for broadcasts.
DEFAULT_NCCL_BUCKET_BYTES = 128 << 20
#: Seconds added to ``group_timeout`` for the HTTP calls that wrap a collective.
HTTP_MARGIN_S = 30.0
#: Seconds the engine gets to leave a group after an update (best effort).
DESTROY_TIMEOUT_S = 10.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("localhost", "") else "127.0.0.1", 0))
        return int(s.getsockname()[1])


class NCCLTransport(StagedTransport):
    """Push registered weights to disaggregated engines by broadcast (nccl on GPU, gloo on CPU).

    ``world_size``: size of the target rank space (the fleet's engine ranks).
    ``master_address``: address engines reach the trainer's store on. ``master_port``: base port
    (target ``k`` of an update uses ``master_port + k``); None picks free ports. ``backend``:
    ``"gloo"``/``"nccl"``, None = nccl when the tensors are on CUDA, else gloo.
    ``bucket_bytes``: bucket size. ``group_timeout``: bound on group set-up and on each bucket.
    ``flush_cache``: ask the engine to drop its KV cache with the last bucket.
    """

    name = "nccl"

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
    ) -> None:
        super().__init__(
            world_size,
            allow_missing_prefixes=allow_missing_prefixes,
            max_parallel_targets=max_parallel_targets,
        )
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if group_timeout <= 0:
            raise ValueError(f"group_timeout must be positive, got {group_timeout}")
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
        self._ports: dict[str, int] = {}
        self._update_id = ""
        self._calls: ThreadPoolExecutor | None = None
        self._closing = threading.Event()

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
        self._items = [(n, t.detach()) for n, t in items]
        self._plans = plan_buckets(items, self.bucket_bytes)
        self._pack_device = device
        # fixed registered objects: which plans are broadcast straight from their storage
        self._direct = [
            direct_view(self._items, p, device=device, shared=False) for p in self._plans
        ]
        return range(self.registration.world_size), [n for n, _ in items]

    def _unstage(self) -> None:
        self._items, self._plans, self._pack_device = [], [], None
        self._direct = []

    # ------------------------------------------------------------------ update
    def _before_push(self, targets: Sequence[EngineTarget]) -> None:
        if self._pack_device is None or not self._plans:
            raise TransportError(f"{self.name}: no bucket plan registered")
        self._update_id = uuid.uuid4().hex[:8]
        self._ports = {}
        for k, t in enumerate(targets):
            if self.master_port is not None:
                self._ports[t.name] = self.master_port + k
            else:
                self._ports[t.name] = _free_port(self.master_address)
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
        stream, calls = self._stream, self._calls
        assert stream is not None and calls is not None and self.version is not None
        where = f"target {target.name!r} (ranks {list(target.ranks)})"
        group_name = f"rollsafe-v{self.version}-{self._update_id}-{target.name}"
        port = self._ports[target.name]
        world = 1 + target.tp_size
        backend = self.resolved_backend()
        http_timeout = self.group_timeout + HTTP_MARGIN_S
        client = target.client
        group: WeightUpdateGroup | None = None
        joined = False
        moved = 0
        try:
            # 1. group set-up: the engine's HTTP call and the trainer's join run concurrently
            init = calls.submit(
                client.init_weights_update_group,
                self.master_address,
                port,
                1,
                world,
                group_name=group_name,
                backend=backend,
                timeout=http_timeout,
            )
            group = self._join(port, world, group_name, backend, init, where)
            joined = True
            # 2. buckets
            last = len(stream) - 1
            version = str(self.version)
            for i in range(len(stream)):
                bucket = stream.get(target.name, i, timeout=self.group_timeout)
                what = (
                    f"bucket {i + 1}/{len(stream)} ({bucket.dtype}, {len(bucket.metas)} tensors "
                    f"from {bucket.metas[0].name!r})"
                )
                call = calls.submit(
                    client.update_weights_from_distributed,
                    [m.name for m in bucket.metas],
                    [m.dtype for m in bucket.metas],
                    [list(m.shape) for m in bucket.metas],
                    group_name=group_name,
                    load_format="flattened_bucket",
                    flush_cache=self.flush_cache and i == last,
                    weight_version=version if i == last else None,
                    timeout=http_timeout,
                )
                work = group.broadcast(bucket.flat, 0)
                try:
                    self._await_pair(work, call, f"{where}: {what}")
                except BaseException:
                    self._reap(group, work)
                    group = None
                    raise
                stream.release(target.name, i)
                moved += bucket.nbytes
        finally:
            stream.leave(target.name)
            # 3. tear-down; the engine side is best effort (a dead engine has nothing to destroy,
            # a hung one is given DESTROY_TIMEOUT_S)
            if joined:
                try:
                    client.destroy_weights_update_group(group_name, timeout=DESTROY_TIMEOUT_S)
                except Exception as exc:
                    log.warning("%s: destroy_weights_update_group failed: %s", where, exc)
            if group is not None:
                group.close()
        return moved

    def _join(
        self,
        port: int,
        world: int,
        group_name: str,
        backend: str,
        init: Future[Any],
        where: str,
    ) -> WeightUpdateGroup:
        """Open rank 0's side of the group while the engine's init call runs; bounded."""
        joined: Future[WeightUpdateGroup] = Future()
        abandoned = threading.Event()

        def join() -> None:
            try:
                g = open_weight_update_group(
                    master_address=self.master_address,
                    master_port=port,
                    rank=0,
                    world_size=world,
                    group_name=group_name,
                    backend=backend,
                    timeout_s=self.group_timeout,
                )
            except BaseException as exc:
                joined.set_exception(exc)
                return
            if abandoned.is_set():
                g.close()  # nobody will use it: the update already gave up on this target
            else:
                joined.set_result(g)

        threading.Thread(target=join, name=f"rollsafe-join-{group_name}", daemon=True).start()
        done = threading.Event()
        init.add_done_callback(lambda _: done.set())
        joined.add_done_callback(lambda _: done.set())
        deadline = self.group_timeout + 5.0
        try:
            if not _wait_both(init, joined, done, deadline):
                raise TransportError(
                    f"{where}: weight-update group {group_name!r} not formed within {deadline}s"
                )
            init.result(timeout=0)  # an init failure names the engine's reason
            return joined.result(timeout=0)
        except TransportError:
            abandoned.set()
            self._close_if_joined(joined)
            raise
        except Exception as exc:
            abandoned.set()
            self._close_if_joined(joined)
            raise TransportError(
                f"{where}: joining weight-update group {group_name!r} "
                f"({self.master_address}:{port}, world {world}, {backend}) failed: {exc}"
            ) from exc

    @staticmethod
    def _close_if_joined(joined: Future[WeightUpdateGroup]) -> None:
        if joined.done() and joined.exception() is None:
            joined.result().close()

    def _await_pair(self, work: Any, call: Future[Any], what: str) -> None:
        """Wait for the broadcast and the engine's answer; the first failure wins; bounded."""
        done = threading.Event()
        bcast = work.get_future()
        bcast.add_done_callback(lambda _: done.set())
        call.add_done_callback(lambda _: done.set())
        deadline = self.group_timeout
        if not _wait_both(call, _TorchFuture(bcast), done, deadline):
            raise TransportError(f"{what}: not done within {deadline}s (broadcast or engine)")
        if call.done() and call.exception() is not None:
            raise TransportError(f"{what}: engine refused or failed: {call.exception()}")
        if bcast.done():
            try:
                bcast.wait()
            except Exception as exc:
                raise TransportError(f"{what}: broadcast failed: {exc}") from exc
        try:
            call.result(timeout=0)
        except Exception as exc:
            raise TransportError(f"{what}: engine refused or failed: {exc}") from exc

    def _reap(self, group: WeightUpdateGroup, work: Any) -> None:
        """Hand a group with possibly pending work to a daemon thread that waits it out."""

        def reap() -> None:
            try:
                work.wait(datetime.timedelta(seconds=self.group_timeout))
            except Exception:
                pass
            group.close()

        threading.Thread(target=reap, name="rollsafe-nccl-reaper", daemon=True).start()

    def _after_push(self, targets: Sequence[EngineTarget]) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        calls, self._calls = self._calls, None
        if calls is not None:
            calls.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._unstage()
        super().close()


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
