"""The engine's rank processes: what each rank runs and how rank 0 drives the others.

Owns the multi-process (tensor-parallel-like) structure. :class:`RankRuntime` is everything one
rank holds (its model shard, its slot in the engine's rank group, trainer weight-update groups)
and the operations it executes. :class:`RankSet` lives in rank 0: it takes the ranks ``1..N-1``
that :func:`.bootstrap.spawn_ranks` started early (or spawns them itself), runs the start-up
protocol described in :mod:`.bootstrap` (load everywhere, then store, then group), sends every
operation to all ranks over pipes, runs its own share, and collects replies. A watcher thread
waits on the children's process sentinels so a dead rank is reported at once, not after a
collective timeout. Children die with rank 0: they set ``PR_SET_PDEATHSIG=SIGKILL`` and also exit
when their control pipe reaches EOF.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from rollsafe.adapters.reference_engine import errors
from rollsafe.adapters.reference_engine.bootstrap import (
    RankChild,
    RankOptions,
    apply_start_fault,
    spawn_ranks,
)
from rollsafe.adapters.reference_engine.collective import RankGroup
from rollsafe.adapters.reference_engine.deltas import DeltaParts, refused
from rollsafe.adapters.reference_engine.errors import (
    RankFailure,
    ServerError,
    StartupError,
    WeightUpdateError,
)
from rollsafe.adapters.reference_engine.gc_heap import freeze_heap, warn_long_pauses
from rollsafe.adapters.reference_engine.model import LM_HEAD, ShardedCausalLM, load_config
from rollsafe.adapters.reference_engine.nodes import RemoteRank
from rollsafe.adapters.reference_engine.profiling import PROFILE, profile_line
from rollsafe.adapters.reference_engine.weights import (
    ReceiveBuffers,
    SharedMappings,
    UpdateMeta,
    check_model_path,
    decode_tensor_entry,
    read_checkpoint_dir,
    receive_broadcast,
    receive_from_ipc,
)
from rollsafe.wire.delta import DeltaError, DeltaFormatError, apply_delta, read_header
from rollsafe.wire.group import WeightUpdateGroup, open_weight_update_group

__all__ = ["GroupJoin", "RankRuntime", "RankSet", "child_main", "rank_devices"]

RANK_BACKENDS = ("gloo", "nccl")


def rank_devices(opts: RankOptions) -> list[str]:
    """The device of every rank: ``cpu``, or ``cuda:{rank % visible GPUs}``."""
    if opts.device != "cuda":
        return [opts.device] * opts.world_size
    n = max(1, torch.cuda.device_count())
    return [f"cuda:{r % n}" for r in range(opts.world_size)]


def check_rank_setup(opts: RankOptions) -> None:
    """Refuse a device / rank-group combination that cannot work; raise :class:`StartupError`."""
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda but torch.cuda.is_available() is false")
    if opts.rank_backend not in RANK_BACKENDS:
        raise StartupError(f"--rank-backend must be one of {list(RANK_BACKENDS)}")
    if opts.rank_backend == "nccl" and opts.world_size > 1:
        devices = rank_devices(opts)
        if opts.device != "cuda":
            raise StartupError("--rank-backend nccl needs --device cuda")
        if len(set(devices)) < len(devices):
            raise StartupError(
                f"--rank-backend nccl needs one GPU per rank: {opts.world_size} ranks share "
                f"{len(set(devices))} visible GPU(s) and NCCL refuses two ranks on one device; "
                "use --rank-backend gloo"
            )


class RankRuntime:
    """One rank's state and operations (executed identically on every rank).

    ``group`` (the engine's own rank group) is attached after every rank has loaded; see
    :mod:`.bootstrap` for the start-up order.
    """

    def __init__(
        self,
        opts: RankOptions,
        rank: int,
        group: RankGroup | None = None,
        *,
        clock: Any = None,
    ) -> None:
        """``clock`` (a :class:`~.bootstrap.StartupClock`, rank 0's) gets the load's phases:
        ``cuda_init`` (CUDA context created), ``model_built``, ``weights_read`` (the HF files
        read into host memory) and ``weights_loaded`` (staged onto the device, checked and
        committed); the ready line reports them, which is how a recovery's restart is timed."""
        self.opts = opts
        self.rank = rank
        self.group = group
        check_rank_setup(opts)
        self.device = torch.device(rank_devices(opts)[rank])

        def mark(phase: str) -> None:
            if clock is not None:
                clock.mark(phase)

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)  # the context exists from here on
            mark("cuda_init")
        config = load_config(opts.model_path)
        dtype = getattr(torch, opts.dtype) if opts.dtype else None
        self.model = ShardedCausalLM(
            config,
            rank=rank,
            world_size=opts.world_size,
            device=str(self.device),
            dtype=dtype,
            seed=opts.seed,
        )
        self.weight_groups: dict[str, Any] = {}
        #: weight-update groups being joined, by name (see :class:`GroupJoin`)
        self.group_joins: dict[str, GroupJoin] = {}
        #: joins given up on (deadline, failure on another rank) whose thread still runs
        self.abandoned_joins: list[GroupJoin] = []
        # kept between updates: distributed receive buffers, mapped shared-memory buckets
        self.recv_buffers = ReceiveBuffers(pin=self.device.type == "cuda")
        self._recv_stream: Any = None
        self.shm_mappings = SharedMappings()
        #: a delta update in transit (``rollsafe.wire.delta``): held until its versioned call
        self.delta = DeltaParts()
        mark("model_built")
        if opts.load_format == "auto":
            # the start-up load serves what it is given, as upstream engines do; only weight
            # update requests refuse NaN / inf unless they opt in
            self.op_stage_disk(opts.model_path, allow_non_finite=True, on_read=mark)
            self.op_commit()
            mark("weights_loaded")
        elif opts.load_format != "dummy":
            raise WeightUpdateError(
                f"load_format must be 'auto' or 'dummy', got {opts.load_format!r}"
            )

    def join_group(self, port: int, store: Any = None, host: str = "127.0.0.1") -> None:
        """Join the engine's rank group through the store on ``host:port`` (loopback on one
        node; the head's address when the ranks span nodes, :mod:`.nodes`)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread; rank 0 joins on a helper thread
        device_host = "127.0.0.1"
        if self.opts.nnodes > 1:
            from rollsafe.adapters.reference_engine.nodes import local_address

            device_host = local_address(host, port)
        self.group = RankGroup(
            host=host,
            device_host=device_host,
            port=port,
            rank=self.rank,
            world_size=self.opts.world_size,
            timeout_s=self.opts.collective_timeout_s,
            connect_timeout_s=self.opts.start_timeout_s,
            store=store,
            backend=self.opts.rank_backend,
            device=self.device,
        )

    def handle(self, op: str, args: dict[str, Any]) -> Any:
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise errors.BadRequest(f"rank {self.rank}: unknown operation {op!r}")
        if self.device.type == "cuda":
            # the current device is per thread: rank 0 loads on a start-up thread and serves
            # on the engine's driver thread
            torch.cuda.set_device(self.device)
        if not PROFILE:
            return fn(**args)
        t0 = time.perf_counter()
        try:
            return fn(**args)
        finally:
            profile_line(op, self.rank, time.perf_counter() - t0)

    def _sync(self) -> None:
        """Wait for this rank's queued GPU work (copies out of buffers a sender will reuse)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- generation ----
    def op_forward(self, sid: str, token_ids: list[int]) -> torch.Tensor | None:
        """This step's full-vocabulary logits on rank 0 (a CPU float tensor); ``None`` elsewhere."""
        local = self.model.forward(sid, token_ids)
        if self.group is None:
            return local.cpu()
        full = self.group.all_gather_rows(local, self.model.rows_per_rank, self.model.vocab_size)
        return full.cpu() if self.rank == 0 else None

    def op_end(self, sid: str) -> None:
        self.model.end(sid)

    def op_drop_sessions(self) -> None:
        self.model.drop_sessions()

    def op_ping(self) -> int:
        return os.getpid()

    def op_local_checksum(self) -> str:
        """Digest of this rank's live tensors (its trunk and its ``lm_head`` rows)."""
        from rollsafe.checksum import weights_checksum

        return weights_checksum(self.model.local_tensors())["model"]

    # ---- weights ----
    # Every stage op validates the whole call and records its tensors without copying them
    # where they stay valid until the commit of the same request (see ShardedCausalLM.stage):
    # ``commit`` then copies each byte once, straight into the live weights.
    #
    # A stage op is phase 1 of the engine's two-phase commit (``ReferenceEngine._two_phase``):
    # a refusal is a named :class:`WeightUpdateError` (every rank then discards), never a
    # :class:`RankFailure`, so bad data cannot fail a multi-rank engine. ``allow_non_finite``
    # lets NaN / inf through (see ``ShardedCausalLM.stage``).
    def op_stage_disk(
        self,
        model_path: str,
        allow_non_finite: bool = False,
        on_read: Callable[[str], None] | None = None,
    ) -> None:
        check_model_path(model_path)
        self.delta.drop()  # another kind of update: a delta in transit was given up
        try:
            named = read_checkpoint_dir(model_path, self.model.specs)
        except (OSError, ValueError) as exc:  # a file vanished or became unreadable mid-read
            raise WeightUpdateError(f"model_path {model_path!r}: cannot be read: {exc}") from exc
        if on_read is not None:
            on_read("weights_read")
        self._stage(named.items(), f"rank {self.rank}", allow_non_finite=allow_non_finite)

    def op_stage_tensor(self, entry: Any, allow_non_finite: bool = False) -> str:
        # views of the sender's shared memory / CUDA IPC buffers: the sender keeps them
        # unchanged until this request is answered, and commit runs before the answer
        where = f"serialized_named_tensors[{self.rank}]"
        t0 = time.perf_counter()
        try:
            named = decode_tensor_entry(entry, rank=self.rank, mappings=self.shm_mappings)
        except ServerError:
            raise
        except Exception as exc:  # a payload the decoder did not foresee: the request's fault
            raise WeightUpdateError(f"{where}: cannot be decoded: {type(exc).__name__}") from exc
        profile_line("stage_tensor.decode", self.rank, time.perf_counter() - t0)
        return self._stage_or_hold(named, where, allow_non_finite=allow_non_finite)

    def _stage_or_hold(
        self, named: Sequence[tuple[str, torch.Tensor]], where: str, *, allow_non_finite: bool
    ) -> str:
        """Stage an ordinary call (a delta in transit is then given up) or hold a delta's call
        until the update's versioned call applies it (:mod:`.deltas`). Returns ``"delta"`` or
        ``"weights"``."""
        if self.delta.belongs([n for n, _ in named]):
            self.delta.hold(named)
            self._sync()  # the copies are made before the sender may reuse its buffers
            return "delta"
        self.delta.drop()
        self._stage(named, where, allow_non_finite=allow_non_finite)
        return "weights"

    def _stage(
        self,
        named: Any,
        where: str,
        *,
        copy: bool = False,
        allow_non_finite: bool = False,
    ) -> None:
        """``model.stage`` with any unexpected error turned into a named refusal."""
        try:
            self.model.stage(named, where=where, copy=copy, allow_non_finite=allow_non_finite)
        except ServerError:
            raise
        except Exception as exc:
            raise WeightUpdateError(
                f"{where}: cannot be staged: {type(exc).__name__}: {exc}"
            ) from exc

    def op_stage_distributed(
        self,
        group_name: str,
        meta: UpdateMeta,
        flattened: bool,
        chunk_bytes: int | None = None,
        allow_non_finite: bool = False,
    ) -> str:
        pg = self.weight_groups.get(group_name)
        if pg is None:
            raise WeightUpdateError(f"rank {self.rank}: no weight update group {group_name!r}")
        # gloo moves host memory: receive on the CPU and let ``commit`` copy to the device
        device = self.device if pg.backend == "nccl" else torch.device("cpu")
        # the kept buffers hold no staged views here (one update at a time); fresh ones if so
        buffers = None if self.model.staged_names else self.recv_buffers
        stream = self._receive_stream() if device.type == "cuda" else None
        named = receive_broadcast(
            pg,
            meta,
            flattened=flattened,
            device=device,
            buffers=buffers,
            stream=stream,
            chunk_bytes=chunk_bytes,
        )
        return self._stage_or_hold(named, f"rank {self.rank}", allow_non_finite=allow_non_finite)

    def _receive_stream(self) -> Any:
        """The CUDA stream nccl receives are posted from (see :func:`receive_broadcast`)."""
        if self._recv_stream is None:
            cuda: Any = torch.cuda  # Stream and Event are untyped
            self._recv_stream = cuda.Stream(device=self.device)
        return self._recv_stream

    def op_stage_ipc(self, zmq_handles: Any, allow_non_finite: bool = False) -> None:
        self.delta.drop()  # another kind of update: a delta in transit was given up
        receive_from_ipc(
            zmq_handles,
            device=self.device,
            # checkpoint-engine refills its buffers for the next bucket: copy while staging
            stage=lambda named: self._stage(
                named, f"rank {self.rank}", copy=True, allow_non_finite=allow_non_finite
            ),
        )
        self._sync()

    def op_commit(self, sync: bool = True) -> list[str]:
        """Copy the staged tensors into the weights.

        ``sync=False`` (an nccl call that is not an update's last, see
        ``ReferenceEngine._two_phase``) answers once the copies are queued: they run on this
        rank's current stream, so every
        later generation, read or release is ordered after them, and the receive buffers they
        read stay reserved until they end (:class:`ReceiveBuffers`). The next call's receive
        then overlaps them. Otherwise the rank waits for its GPU work, as a sender that reuses
        its buffers (CUDA IPC) needs.
        """
        t0 = time.perf_counter()
        names = self.model.commit()
        t1 = time.perf_counter()
        event: Any = None
        if not sync and self.device.type == "cuda":
            cuda: Any = torch.cuda
            event = cuda.Event()
            event.record()
        self.recv_buffers.mark_read(event)
        if sync:
            self._sync()
        profile_line("commit.copy_launch", self.rank, t1 - t0)
        if sync:
            profile_line("commit.sync", self.rank, time.perf_counter() - t1)
        return names

    def op_discard(self) -> None:
        self.model.discard()
        self.delta.drop()
        self.recv_buffers.mark_read(None)

    def op_delta_pending(self) -> bool:
        return self.delta.pending

    def op_stage_delta(
        self,
        current_version: str,
        weight_version: str | None,
        gather_lm_head: bool,
        allow_non_finite: bool = False,
    ) -> list[str]:
        """Phase 1 of a delta's commit: apply the held delta onto this rank's current weights
        (:func:`~rollsafe.wire.delta.apply_delta`: base ``current_version``, format and every
        touched tensor's result digest checked) and stage the new tensors like an ordinary
        update's (finite check included). The held parts are dropped whatever happens.

        ``gather_lm_head`` (decided by rank 0 from its header, the same on every rank, so the
        collective runs everywhere before anything can refuse): the full ``lm_head`` is gathered
        from every rank's rows first, so its delta (flat indices into the full matrix) and its
        digest are checked whole on every rank, which then stages its own rows.
        """
        current = dict(self.model.local_tensors())
        if gather_lm_head:
            shard = self.model.lm_head_shard
            full = (
                shard
                if self.group is None
                else self.group.all_gather_rows(
                    shard.t().contiguous(), self.model.rows_per_rank, self.model.vocab_size
                ).t()
            )
            current[LM_HEAD] = full
        received = self.delta.take() if self.delta.pending else None
        try:
            if received is None:
                raise DeltaFormatError(
                    f"rank {self.rank}: no delta was received for this update", key=None
                )
            new = apply_delta(current, received, current_version=current_version)
            made = read_header(received).version
            if weight_version is not None and made != weight_version:
                raise DeltaFormatError(
                    f"the delta makes v{made} but the update carries weight_version "
                    f"{weight_version!r}; nothing was applied",
                    key=None,
                )
        except DeltaError as exc:
            raise refused(exc) from exc
        except Exception as exc:  # what the checks did not foresee: still a refusal, not a fault
            raise WeightUpdateError(
                f"rank {self.rank}: the delta cannot be applied: {type(exc).__name__}: {exc}"
            ) from exc
        self._stage(list(new.items()), f"rank {self.rank}", allow_non_finite=allow_non_finite)
        return sorted(new)

    def op_gather_lm_head(self) -> torch.Tensor | None:
        """All ranks contribute their ``lm_head`` rows; rank 0 gets the full matrix."""
        if self.model.tied:
            return None
        shard = self.model.lm_head_shard
        if self.group is None:
            return shard
        full = self.group.all_gather_rows(
            shard.t().contiguous(), self.model.rows_per_rank, self.model.vocab_size
        )
        return full.t().contiguous() if self.rank == 0 else None

    # ---- trainer weight-update groups ----
    # Joining a group is a rendezvous with the trainer that can take as long as the trainer
    # (or a dead address) makes it: it runs on a thread per rank (:class:`GroupJoin`), never on
    # the engine's driver thread. The engine starts it (``init_group_start``), polls it
    # (``init_group_poll``, between generation steps), then installs it on every rank at once
    # (``init_group_finish``) or gives it up everywhere (``init_group_cancel``).
    def op_init_group_start(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        token: str,
        timeout_s: float,
    ) -> None:
        if group_name in self.weight_groups or group_name in self.group_joins:
            raise WeightUpdateError(f"rank {self.rank}: group {group_name!r} already exists")
        self._reap_joins()
        join = GroupJoin(
            token,
            dict(
                master_address=master_address,
                master_port=master_port,
                rank=rank_offset + self.rank,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=self.opts.weight_group_timeout_s,
                connect_timeout_s=timeout_s,
            ),
            device=self.device,
        )
        self.group_joins[group_name] = join
        join.start()

    def op_init_group_poll(self, group_name: str, token: str) -> bool:
        """Whether this rank's join is done; :class:`WeightUpdateError` if it failed."""
        join = self.group_joins.get(group_name)
        if join is None or join.token != token:
            raise WeightUpdateError(f"rank {self.rank}: no pending join of group {group_name!r}")
        if not join.done.is_set():
            return False
        if join.error is not None:
            raise WeightUpdateError(
                f"rank {self.rank}: joining weight update group {group_name!r} failed: "
                f"{_first_line(join.error)}"
            )
        return True

    def op_init_group_finish(self, group_name: str, token: str) -> None:
        join = self.group_joins.get(group_name)
        if join is None or join.token != token or join.group is None:
            raise WeightUpdateError(f"rank {self.rank}: group {group_name!r} is not joined")
        del self.group_joins[group_name]
        join.group.token = token
        self.weight_groups[group_name] = join.group

    def op_init_group_cancel(self, group_name: str, token: str) -> None:
        """Give up the join ``token`` of ``group_name``: close its group if it was joined or
        installed, or leave its thread to close it when the rendezvous ends. Never raises."""
        join = self.group_joins.get(group_name)
        if join is not None and join.token == token:
            del self.group_joins[group_name]
            if not join.cancel():
                self.abandoned_joins.append(join)
        pg = self.weight_groups.get(group_name)
        if pg is not None and getattr(pg, "token", None) == token:
            del self.weight_groups[group_name]
            pg.close()
        self._reap_joins()

    def op_group_state(self) -> dict[str, Any]:
        """This rank's weight-update groups: installed, being joined, abandoned but running."""
        self._reap_joins()
        return {
            "groups": sorted(self.weight_groups),
            "joining": sorted(self.group_joins),
            "abandoned": len(self.abandoned_joins),
        }

    def cancel_group_joins(self) -> None:
        """Shutting down: give up every join (a late rendezvous closes its own group)."""
        for join in self.group_joins.values():
            join.cancel()
        self.group_joins.clear()

    def _reap_joins(self) -> None:
        self.abandoned_joins = [j for j in self.abandoned_joins if not j.done.is_set()]

    def op_destroy_group(self, group_name: str) -> None:
        pg = self.weight_groups.pop(group_name, None)
        if pg is None:
            raise WeightUpdateError(f"rank {self.rank}: no weight update group {group_name!r}")
        pg.close()
        if not self.weight_groups:
            self.recv_buffers.clear()

    def op_release(self, backup: bool = False) -> None:
        self.delta.drop()
        self.recv_buffers.clear()  # before release() hands cached CUDA blocks back
        self.shm_mappings.clear()
        self.model.release(backup=backup)

    def op_resume(self) -> None:
        self.model.resume()

    def local_tensors(self) -> dict[str, torch.Tensor]:
        return self.model.local_tensors()

    def op_checker_reset(self, mode: str, keep: Sequence[str] = ()) -> None:
        """Weight checkers' reset: overwrite this rank's live weights with ``"zero"`` (vLLM
        ``reset``) or uniform ``[0, 1)`` values (SGLang ``reset_tensors``), except the tensors
        named in ``keep``. Random values come from a generator seeded per name (and rank, for
        the ``lm_head`` shard), so replicated tensors stay equal across ranks."""
        import zlib

        kept = set(keep)
        with torch.no_grad():
            for name, t in self.model.local_tensors().items():
                if name in kept:
                    continue
                if mode == "zero":
                    t.zero_()
                    continue
                seed = zlib.crc32(name.encode()) + (
                    self.rank << 32 if name == "lm_head.weight" else 0
                )
                gen = torch.Generator().manual_seed(seed)
                if t.dtype.is_floating_point:
                    t.copy_(torch.rand(t.shape, generator=gen).to(t.dtype))
                else:
                    t.copy_(torch.randint(0, 2, t.shape, generator=gen).to(t.dtype))
        self._sync()


class GroupJoin:
    """One rank's join of a trainer weight-update group, on its own daemon thread.

    :func:`.collective.open_weight_update_group` blocks in the store connect and the
    rendezvous (a dead or silent address holds the connect for minutes, whatever its
    timeout); here it runs off the serving path. The engine bounds the wait with its own
    deadline; a join given up on (:meth:`cancel`) closes the group its thread may still
    produce, so a late rendezvous leaks no process group, and the daemon thread never holds up
    shutdown.
    """

    def __init__(self, token: str, kwargs: dict[str, Any], *, device: torch.device) -> None:
        self.token = token
        self.kwargs = kwargs
        self.device = device
        self.done = threading.Event()
        self.group: WeightUpdateGroup | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self._thread = threading.Thread(
            target=self._run, name=f"join-{kwargs['group_name']}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        group: WeightUpdateGroup | None = None
        error: BaseException | None = None
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # an nccl group binds the current device
            group = open_weight_update_group(**self.kwargs)
        except BaseException as exc:
            error = exc
        with self._lock:
            cancelled = self._cancelled
            if not cancelled:
                self.group, self.error = group, error
        if cancelled and group is not None:
            group.close()  # the engine gave up on this join: leak nothing
        self.done.set()

    def cancel(self) -> bool:
        """Give the join up; ``True`` if its thread has ended (its group, if any, closed)."""
        with self._lock:
            self._cancelled = True
            group, self.group = self.group, None
        if group is not None:
            group.close()
        return self.done.is_set()

    @property
    def thread(self) -> threading.Thread:
        return self._thread


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (c10d errors carry a C++ stack trace after it)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _error_reply(rank: int, exc: BaseException, *, starting: bool) -> tuple[str, str, str]:
    what = f"rank {rank} failed to start" if starting else f"rank {rank}"
    if isinstance(exc, ServerError):
        return ("error", type(exc).__name__, f"{what}: {exc}" if starting else str(exc))
    return ("error", "RankFailure", f"{what}: {type(exc).__name__}: {exc}")


def child_main(rank: int, opts: RankOptions, conn: Any) -> None:
    """Rank ``rank``'s life after :func:`.bootstrap.child_entry`: load, join, serve."""
    torch.set_num_threads(opts.torch_threads())
    try:
        apply_start_fault(rank)
        runtime = RankRuntime(opts, rank)
        conn.send(("loaded", os.getpid(), None))
        msg, args = conn.recv()
        if msg != "join":  # "shutdown": rank 0 gave up starting
            os._exit(0)
        runtime.join_group(int(args["port"]), host=str(args.get("host", "127.0.0.1")))
    except (EOFError, OSError) as exc:
        if isinstance(exc, (EOFError, BrokenPipeError, ConnectionResetError)):
            os._exit(0)  # rank 0 is gone
        with contextlib.suppress(Exception):
            conn.send(_error_reply(rank, exc, starting=True))
        os._exit(1)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(_error_reply(rank, exc, starting=True))
        os._exit(1)
    freeze_heap()  # as the real engines' processes once up (gc_heap)
    warn_long_pauses(f"rank {rank}")
    conn.send(("ready", os.getpid(), None))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # rank 0 is gone
        if op == "shutdown":
            os._exit(0)
        try:
            result = runtime.handle(op, args)
            if isinstance(result, torch.Tensor):
                result = None  # tensors travel through the group, not the pipe
            conn.send(("ok", result, None))
        except Exception as exc:
            conn.send(_error_reply(rank, exc, starting=False))


def _exit_reason(rank: int, proc: Any) -> str:
    """Why rank ``rank`` is gone: its exit code, or how its node was lost."""
    if isinstance(proc, RemoteRank):
        return f"rank {rank} (pid {proc.pid} on node {proc.link.node_rank}): {proc.link.reason}"
    return f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"


def _local(child: RankChild) -> bool:
    """Whether ``child`` is a process on this node (not a :class:`~.nodes.RemoteRank`)."""
    return not isinstance(child.proc, RemoteRank)


def _rebuild_error(kind: str, message: str) -> ServerError:
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, ServerError):
        return cls(message)
    return RankFailure(message)


class RankSet:
    """Rank 0's handle on all ranks: runs each operation everywhere, reports dead ranks.

    ``children`` are ranks already started by :func:`.bootstrap.spawn_ranks` (the command line
    starts them before importing torch); without them this spawns its own. ``clock`` records
    start-up phases. With ranks on several nodes (``opts.nnodes`` > 1) ``listener`` is the
    head's open :class:`~.nodes.NodeListener`: the other nodes' ranks join the set from it
    (their liveness is their node's link) and the rank group's store listens on the head's
    address.
    """

    def __init__(
        self,
        opts: RankOptions,
        *,
        children: list[RankChild] | None = None,
        on_failure: Callable[[str], None] | None = None,
        clock: Any = None,
        listener: Any = None,
    ) -> None:
        self.opts = opts
        self._listener = listener
        self.world_size = opts.world_size
        self._on_failure = on_failure
        self._failed: str | None = None
        self._closing = False
        torch.set_num_threads(opts.torch_threads())
        if children is None and opts.ranks_per_node > 1:
            children = spawn_ranks(opts)
        self._children = list(children or [])
        self._procs: list[Any] = [c.proc for c in self._children]
        self._conns: list[Any] = [c.conn for c in self._children]
        deadline = time.monotonic() + opts.start_timeout_s
        try:
            if listener is not None:  # the other nodes' ranks, once every one joined
                self.local = RankRuntime(opts, 0, clock=clock)
                self._children += listener.children(deadline)
            if len(self._children) != self.world_size - 1:
                raise StartupError(
                    f"{len(self._children)} rank processes for world size {self.world_size}"
                )
            self._procs = [c.proc for c in self._children]
            self._conns = [c.conn for c in self._children]
            if listener is None:
                self.local = RankRuntime(opts, 0, clock=clock)
            if clock is not None:
                clock.mark("rank0_loaded")
            if self.world_size > 1:
                self._await_all("loaded", deadline)
                if clock is not None:
                    clock.mark("ranks_loaded")
                # the store binds its own (kernel-chosen) port before anyone is told about it
                host = opts.dist_init_host if opts.nnodes > 1 else "127.0.0.1"
                store = RankGroup.master_store(self.world_size, opts.start_timeout_s, host)
                for conn in self._conns:
                    conn.send(("join", {"port": int(store.port), "host": host}))
                self._join_group(int(store.port), store, deadline, host)
                if clock is not None:
                    clock.mark("group_joined")
        except BaseException:
            self.close(graceful=False)
            raise
        if self._procs:
            threading.Thread(target=self._watch, name="rank-watcher", daemon=True).start()

    def _join_group(self, port: int, store: Any, deadline: float, host: str) -> None:
        """Join the rank group here while watching the children: one that fails or dies while
        joining fails the start at once, not after the rendezvous times out."""
        outcome: list[BaseException | None] = []

        def join() -> None:
            try:
                self.local.join_group(port, store=store, host=host)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        joiner = threading.Thread(target=join, name="rank0-join", daemon=True)
        joiner.start()
        self._await_all("ready", deadline)
        joiner.join(max(0.0, deadline - time.monotonic()))
        if not outcome:
            raise RankFailure("rank 0 did not join the rank group within the start timeout")
        if outcome[0] is not None:
            raise outcome[0]

    @property
    def rank_pids(self) -> list[int]:
        """The pids of the ranks on this node (rank 0 first): the only ones this machine may
        signal. :attr:`remote_rank_pids` has the others."""
        return [os.getpid()] + [int(c.proc.pid) for c in self._children if _local(c)]

    @property
    def remote_rank_pids(self) -> dict[int, int]:
        """``{rank: pid}`` of the ranks on other nodes (pids on their own nodes)."""
        return {c.rank: int(c.proc.pid) for c in self._children if not _local(c)}

    def _await_all(self, kind: str, deadline: float) -> None:
        """Wait for every child's ``kind`` message; raise at once if one fails or dies."""
        for child in self._children:
            r, p, conn = child.rank, child.proc, child.conn
            while not conn.poll(0.05):
                if not p.is_alive():
                    # it may have sent its reason just before exiting
                    if conn.poll(0):
                        break
                    raise RankFailure(
                        f"rank {r} (pid {p.pid}) exited with code {p.exitcode} at start"
                    )
                if time.monotonic() > deadline:
                    raise RankFailure(
                        f"rank {r} (pid {p.pid}) not {kind} within the start timeout "
                        f"({self.opts.start_timeout_s:g}s)"
                    )
            try:
                got, a, b = conn.recv()
            except (EOFError, OSError) as exc:
                raise RankFailure(
                    f"rank {r} (pid {p.pid}) exited with code {p.exitcode} at start"
                ) from exc
            if got == "error":
                raise _rebuild_error(a, b)
            if got != kind:
                raise RankFailure(f"rank {r}: expected {kind!r} at start, got {got!r}")

    def _watch(self) -> None:
        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self._procs, start=1)}
        ready = mpc.wait(list(sentinels))
        if self._closing:
            return
        r, p = sentinels[cast(int, ready[0])]
        p.join(timeout=1)
        self.fail(_exit_reason(r, p))

    def fail(self, reason: str) -> None:
        if self._failed is None:
            self._failed = reason
            if self._on_failure is not None:
                self._on_failure(reason)

    @property
    def failure(self) -> str | None:
        if self._failed is None:
            for r, p in enumerate(self._procs, start=1):
                if not p.is_alive():
                    self.fail(_exit_reason(r, p))
        return self._failed

    def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        per_rank: Sequence[dict[str, Any]] | None = None,
    ) -> Any:
        """Run ``op`` on every rank; return rank 0's result; raise the first rank error."""
        return self.call_all(op, args, per_rank)[0]

    def call_all(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        per_rank: Sequence[dict[str, Any]] | None = None,
    ) -> list[Any]:
        """Run ``op`` on every rank; return every rank's result (tensors: ``None`` off rank 0);
        raise the first rank error."""
        if self._failed is not None:
            raise RankFailure(self._failed)
        base = args or {}

        def args_for(r: int) -> dict[str, Any]:
            return {**base, **per_rank[r]} if per_rank is not None else base

        try:
            for r, conn in enumerate(self._conns, start=1):
                conn.send((op, args_for(r)))
        except (OSError, EOFError) as exc:
            self.fail(f"rank pipe broken while sending {op!r}: {exc}")
            raise RankFailure(self._failed or str(exc)) from exc
        first_error: ServerError | None = None
        results: list[Any] = [None] * self.world_size
        try:
            results[0] = self.local.handle(op, args_for(0))
        except ServerError as exc:
            first_error = exc
        except Exception as exc:
            if self.world_size == 1:
                raise
            first_error = RankFailure(f"rank 0: {type(exc).__name__}: {exc}")
        for r, conn in enumerate(self._conns, start=1):
            try:
                kind, a, b = conn.recv()
            except (OSError, EOFError) as exc:
                self.fail(f"rank {r} (pid {self._procs[r - 1].pid}) vanished during {op!r}")
                raise RankFailure(self._failed or str(exc)) from exc
            if kind == "error" and first_error is None:
                first_error = _rebuild_error(a, b)
            elif kind == "ok":
                results[r] = a
        if first_error is not None:
            if isinstance(first_error, RankFailure) and self.world_size > 1:
                self.fail(str(first_error))
            raise first_error
        return results

    def close(self, *, graceful: bool = True) -> None:
        """Stop every child: ask them to exit (``graceful``), then kill what is left."""
        self._closing = True
        if hasattr(self, "local"):
            self.local.cancel_group_joins()
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("shutdown", {}))
        for p in self._procs:
            if graceful:
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
            p.join(timeout=2)
        if self._listener is not None:
            self._listener.close()
