"""The engine's rank processes: what each rank runs and how rank 0 drives the others.

Owns the multi-process (tensor-parallel-like) structure. :class:`RankRuntime` is everything one
rank holds (its model shard, its slot in the engine's gloo group, trainer weight-update groups)
and the operations it executes. :class:`RankSet` lives in rank 0: it spawns ranks ``1..N-1``
(``spawn`` start method), sends every operation to all ranks over pipes, runs its own share, and
collects replies. A watcher thread waits on the children's process sentinels so a dead rank is
reported at once, not after a collective timeout. Children die with rank 0: they set
``PR_SET_PDEATHSIG=SIGKILL`` and also exit when their control pipe reaches EOF.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from rollsafe.adapters.reference_engine import errors
from rollsafe.adapters.reference_engine.collective import RankGroup, open_weight_update_group
from rollsafe.adapters.reference_engine.errors import EngineError, RankFailure, WeightUpdateError
from rollsafe.adapters.reference_engine.model import ShardedCausalLM, load_config
from rollsafe.adapters.reference_engine.weights import (
    UpdateMeta,
    decode_tensor_entry,
    read_checkpoint_dir,
    receive_broadcast,
    receive_from_ipc,
)

__all__ = ["RankOptions", "RankRuntime", "RankSet"]

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankOptions:
    """Start-up options shared by every rank."""

    model_path: str
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    world_size: int = 1
    collective_timeout_s: float = 30.0
    weight_group_timeout_s: float = 120.0
    threads: int = 0  # torch intra-op threads per rank; 0 = (cpus - 1) // ranks, at least 1

    def torch_threads(self) -> int:
        if self.threads > 0:
            return self.threads
        # leave a core for rank 0's HTTP loop; oversubscribed OpenMP spinning is very slow
        return max(1, ((os.cpu_count() or 1) - 1) // self.world_size)


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: the pipe-EOF watchdog still applies
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)


def _device_for(opts: RankOptions, rank: int) -> str:
    if opts.device == "cuda":
        return f"cuda:{rank % max(1, torch.cuda.device_count())}"
    return opts.device


class RankRuntime:
    """One rank's state and operations (executed identically on every rank)."""

    def __init__(self, opts: RankOptions, rank: int, group: RankGroup | None) -> None:
        self.opts = opts
        self.rank = rank
        self.group = group
        self.device = torch.device(_device_for(opts, rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
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
        if opts.load_format == "auto":
            self.op_stage_disk(opts.model_path)
            self.op_commit()
        elif opts.load_format != "dummy":
            raise WeightUpdateError(
                f"load_format must be 'auto' or 'dummy', got {opts.load_format!r}"
            )

    def handle(self, op: str, args: dict[str, Any]) -> Any:
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise errors.BadRequest(f"rank {self.rank}: unknown operation {op!r}")
        return fn(**args)

    # ---- generation ----
    def op_forward(self, sid: str, token_ids: list[int]) -> torch.Tensor | None:
        local = self.model.forward(sid, token_ids)
        if self.group is None:
            return local
        full = self.group.all_gather_rows(local, self.model.rows_per_rank, self.model.vocab_size)
        return full if self.rank == 0 else None

    def op_end(self, sid: str) -> None:
        self.model.end(sid)

    def op_drop_sessions(self) -> None:
        self.model.drop_sessions()

    def op_ping(self) -> int:
        return os.getpid()

    # ---- weights ----
    def op_stage_disk(self, model_path: str) -> None:
        named = read_checkpoint_dir(model_path, self.model.specs)
        self.model.stage(named.items(), where=f"rank {self.rank}")

    def op_stage_tensor(self, entry: Any) -> None:
        named = decode_tensor_entry(entry, rank=self.rank)
        self.model.stage(named, where=f"serialized_named_tensors[{self.rank}]")

    def op_stage_distributed(self, group_name: str, meta: UpdateMeta, flattened: bool) -> None:
        pg = self.weight_groups.get(group_name)
        if pg is None:
            raise WeightUpdateError(f"rank {self.rank}: no weight update group {group_name!r}")
        named = receive_broadcast(pg, meta, flattened=flattened, device=self.device)
        self.model.stage(named, where=f"rank {self.rank}")

    def op_stage_ipc(self, zmq_handles: Any) -> None:
        receive_from_ipc(
            zmq_handles,
            device=self.device,
            stage=lambda named: self.model.stage(named, where=f"rank {self.rank}"),
        )

    def op_commit(self) -> list[str]:
        return self.model.commit()

    def op_discard(self) -> None:
        self.model.discard()

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

    def op_init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        if group_name in self.weight_groups:
            raise WeightUpdateError(f"rank {self.rank}: group {group_name!r} already exists")
        self.weight_groups[group_name] = open_weight_update_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset + self.rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=self.opts.weight_group_timeout_s,
        )

    def op_destroy_group(self, group_name: str) -> None:
        pg = self.weight_groups.pop(group_name, None)
        if pg is None:
            raise WeightUpdateError(f"rank {self.rank}: no weight update group {group_name!r}")
        pg.close()

    def op_release(self, backup: bool = False) -> None:
        self.model.release(backup=backup)

    def op_resume(self) -> None:
        self.model.resume()

    def local_tensors(self) -> dict[str, torch.Tensor]:
        return self.model.local_tensors()


def _child_main(rank: int, opts: RankOptions, store_port: int, conn: Any, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    torch.set_num_threads(opts.torch_threads())
    try:
        group = RankGroup(
            port=store_port,
            rank=rank,
            world_size=opts.world_size,
            timeout_s=opts.collective_timeout_s,
        )
        runtime = RankRuntime(opts, rank, group)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", type(exc).__name__, f"rank {rank} failed to start: {exc}"))
        os._exit(1)
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
        except EngineError as exc:
            conn.send(("error", type(exc).__name__, str(exc)))
        except Exception as exc:
            conn.send(("error", "RankFailure", f"rank {rank}: {type(exc).__name__}: {exc}"))


def _rebuild_error(kind: str, message: str) -> EngineError:
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, EngineError):
        return cls(message)
    return RankFailure(message)


class RankSet:
    """Rank 0's handle on all ranks: runs each operation everywhere, reports dead ranks."""

    def __init__(
        self,
        opts: RankOptions,
        *,
        on_failure: Callable[[str], None] | None = None,
        start_timeout_s: float = 180.0,
    ) -> None:
        self.opts = opts
        self.world_size = opts.world_size
        self._on_failure = on_failure
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._failed: str | None = None
        self._closing = False
        torch.set_num_threads(opts.torch_threads())
        group: RankGroup | None = None
        if self.world_size > 1:
            store = RankGroup.master_store(self.world_size, opts.collective_timeout_s)
            ctx = mp.get_context("spawn")
            for r in range(1, self.world_size):
                parent_conn, child_conn = ctx.Pipe()
                p = ctx.Process(
                    target=_child_main,
                    args=(r, opts, store.port, child_conn, os.getpid()),
                    name=f"rollsafe-engine-rank{r}",
                    daemon=True,
                )
                p.start()
                child_conn.close()
                self._procs.append(p)
                self._conns.append(parent_conn)
            try:
                group = RankGroup(
                    port=store.port,
                    rank=0,
                    world_size=self.world_size,
                    timeout_s=opts.collective_timeout_s,
                    store=store,
                )
                self.local = RankRuntime(opts, 0, group)
                self._await_ready(time.monotonic() + start_timeout_s)
            except BaseException:
                self.close()
                raise
            threading.Thread(target=self._watch, name="rank-watcher", daemon=True).start()
        else:
            self.local = RankRuntime(opts, 0, None)

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid()] + [int(p.pid) for p in self._procs]

    def _await_ready(self, deadline: float) -> None:
        for r, (p, conn) in enumerate(zip(self._procs, self._conns, strict=False), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise RankFailure(
                        f"rank {r} (pid {p.pid}) exited with code {p.exitcode} at start"
                    )
                if time.monotonic() > deadline:
                    raise RankFailure(f"rank {r} (pid {p.pid}) not ready before the start timeout")
            kind, a, b = conn.recv()
            if kind != "ready":
                raise _rebuild_error(a, b)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self._procs, start=1)}
        ready = mpc.wait(list(sentinels))
        if self._closing:
            return
        r, p = sentinels[cast(int, ready[0])]
        p.join(timeout=1)
        self.fail(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}")

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
                    self.fail(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}")
        return self._failed

    def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        per_rank: Sequence[dict[str, Any]] | None = None,
    ) -> Any:
        """Run ``op`` on every rank; return rank 0's result; raise the first rank error."""
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
        first_error: EngineError | None = None
        result: Any = None
        try:
            result = self.local.handle(op, args_for(0))
        except EngineError as exc:
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
        if first_error is not None:
            if isinstance(first_error, RankFailure) and self.world_size > 1:
                self.fail(str(first_error))
            raise first_error
        return result

    def close(self) -> None:
        self._closing = True
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("shutdown", {}))
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
