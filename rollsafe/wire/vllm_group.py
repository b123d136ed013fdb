"""Rank 0 of a real vLLM's ``nccl`` weight-transfer group: the trainer's side of vLLM's own join.

A real vLLM (0.26.0 through 0.33.0, ``--weight-transfer-config '{"backend": "nccl"}'``) joins
its workers to the trainer's group with vLLM's own classes, not ``torch.distributed``
(``vllm/distributed/weight_transfer/nccl_common.py``):

1. every rank calls ``StatelessProcessGroup.create(master_address, master_port, rank,
   world_size)`` (``vllm/distributed/utils.py``): a ``TCPStore`` whose server rank 0 hosts
   (``use_libuv=False``), with **no key prefix** and vLLM's own key protocol (an object
   broadcast from rank ``src`` is ``pickle.dumps(obj)`` under ``broadcast_from/{src}/{n}``,
   ``n`` counting that sender's broadcasts from 0). The workers are ranks ``rank_offset ..``;
   the trainer is rank 0;
2. then ``PyNcclCommunicator(group, device)`` (``device_communicators/pynccl.py``): rank 0 calls
   ``ncclGetUniqueId`` and broadcasts it through the store (the worker waits, up to 300 s, for
   ``broadcast_from/0/0``: the key a ``torch.distributed`` group never writes), every rank
   calls ``ncclCommInitRank(world_size, unique_id, rank)`` and then a one-element float32
   ``all_reduce`` (a warm-up every rank must join before any other collective);
3. each ``/update_weights`` is received by ``ncclBroadcast`` from rank 0: packed (``packed``,
   in ``init_info`` from 0.32, in every ``update_info`` in 0.26), each call's tensors as uint8
   chunks closed once they exceed ``packed_buffer_size_bytes``
   (:func:`rollsafe.wire.bucket.packed_chunks`), or one broadcast per tensor.

:func:`open_vllm_weight_transfer_group` does steps 1 and 2 on rank 0 the way vLLM documents for
trainers (``trainer_init``): the ``TCPStore`` server is rollsafe's (:class:`VLLMStoreServer`:
bounded connect, closed with the group, so the transport can reuse the port), the group on it
is vLLM's ``StatelessProcessGroup`` and the communicator vLLM's ``PyNcclCommunicator``, so the
unique id travels as vLLM's own pickled ``ncclUniqueId`` and the NCCL library is the one vLLM
loads on the engine. That needs ``vllm`` importable in the trainer process (TRL and verl
trainers have it; on the device the carried vLLM is on ``PYTHONPATH``); without it the join
fails at once with :class:`VLLMRendezvousUnavailable` (:func:`require_vllm_rendezvous`), before
the engine is asked to join. Not done without vLLM: the unique id is a pickle of a vLLM class
and the communicator must match the engine's NCCL, so imitating them would be forging vLLM's
internals with nothing on CPU to check the NCCL half against.

:class:`VLLMStoreServer` also speaks the store protocol itself (:meth:`~VLLMStoreServer.
broadcast_obj`): ``tests/test_vllm_group.py`` has a real vLLM's ``StatelessProcessGroup`` join
it as rank 1 and receive what it broadcasts (no CUDA needed). Imports only torch (vLLM inside
the functions that need it).
"""

from __future__ import annotations

import datetime
import pickle
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed

from rollsafe.concurrency import start_daemon
from rollsafe.errors import InvalidArgument, RollsafeError
from rollsafe.wire.group_names import RENDEZVOUS_VLLM, VLLM_WEIGHT_TRANSFER_GROUP

# torch stubs do not export the store classes; they exist at runtime
dist: Any = torch.distributed

__all__ = [
    "VLLMRendezvousUnavailable",
    "VLLMStoreServer",
    "VLLMWeightTransferGroup",
    "broadcast_key",
    "open_vllm_weight_transfer_group",
    "require_vllm_rendezvous",
]

#: vLLM's ``StatelessProcessGroup.create`` store timeout (``store_timeout``, seconds)
VLLM_STORE_TIMEOUT_S = 300.0
#: seconds :meth:`VLLMWeightTransferGroup.close` gives ``ncclCommAbort`` (as vLLM's ``destroy``)
ABORT_TIMEOUT_S = 5.0

_NEEDED = (
    "vllm.distributed.utils.StatelessProcessGroup and "
    "vllm.distributed.device_communicators.pynccl.PyNcclCommunicator"
)


class VLLMRendezvousUnavailable(RollsafeError, ImportError):
    """The trainer cannot join a real vLLM's ``nccl`` weight-transfer group in this process:
    ``vllm`` is not importable (or its PyNccl is disabled); the message says what is needed."""


def broadcast_key(src: int, n: int) -> str:
    """The store key of the ``n``-th object rank ``src`` broadcasts (vLLM's protocol)."""
    return f"broadcast_from/{src}/{n}"


@dataclass(frozen=True)
class _VLLMAPI:
    group_cls: Any  # vllm.distributed.utils.StatelessProcessGroup
    communicator_cls: Any  # vllm.distributed.device_communicators.pynccl.PyNcclCommunicator
    nccl_env: Any  # () -> context manager (0.33's unpinned_nccl_env; else a no-op)


def require_vllm_rendezvous(where: str = "") -> Any:
    """vLLM's ``StatelessProcessGroup`` and ``PyNcclCommunicator`` (and 0.33's NCCL env guard),
    or :class:`VLLMRendezvousUnavailable` naming what is missing (nothing else happens)."""
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except Exception as exc:  # ImportError, or vLLM failing at import on this machine
        prefix = f"{where}: " if where else ""
        raise VLLMRendezvousUnavailable(
            f"{prefix}a real vLLM's 'nccl' weight transfer is joined with vLLM's own "
            f"{_NEEDED} (its StatelessProcessGroup store protocol and PyNccl communicator), "
            f"so the trainer process must import vllm (the release the engine runs, same "
            f"NCCL): install it or put it on PYTHONPATH ({type(exc).__name__}: {exc})",
            name="vllm",
        ) from exc
    env: Any = nullcontext
    try:  # 0.33: communicators shared with other processes are built without vLLM's pins
        from vllm.utils.nccl import unpinned_nccl_env

        env = unpinned_nccl_env
    except Exception:
        pass
    return _VLLMAPI(StatelessProcessGroup, PyNcclCommunicator, env)


class VLLMStoreServer:
    """Rank 0's ``TCPStore`` server of a vLLM ``StatelessProcessGroup`` (no key prefix), and
    rank 0's side of its object broadcast.

    ``connect_timeout_s`` bounds every store wait (vLLM's ranks use 300 s). The server does not
    wait for the others to connect (the unique-id broadcast and ``ncclCommInitRank`` do)."""

    rank = 0

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        *,
        connect_timeout_s: float = VLLM_STORE_TIMEOUT_S,
    ) -> None:
        if world_size < 2:
            raise InvalidArgument(
                "world_size",
                f"a weight-transfer group needs the trainer and >= 1 engine rank, "
                f"got world_size {world_size}",
            )
        if not 0 < int(port) < 65536:
            raise InvalidArgument("master_port", f"not a TCP port: {port}")
        self.host = host
        self.port = int(port)
        self.world_size = int(world_size)
        self.store: Any = dist.TCPStore(
            host,
            self.port,
            self.world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=connect_timeout_s),
            wait_for_workers=False,
            use_libuv=False,  # as vLLM's ranks (github.com/pytorch/pytorch/pull/150215)
        )
        self._sent = 0

    def broadcast_obj(self, obj: Any) -> None:
        """Broadcast ``obj`` from rank 0 as vLLM's ``StatelessProcessGroup.broadcast_obj``
        does: the ranks read ``broadcast_from/0/{n}`` in order."""
        if self.store is None:
            raise InvalidArgument("store", "the store server is closed")
        self.store.set(broadcast_key(0, self._sent), pickle.dumps(obj))
        self._sent += 1

    def close(self) -> None:
        """Drop the server (its port is free again once torch has released it)."""
        self.store = None


class VLLMWeightTransferGroup:
    """The trainer's side (rank 0) of a real vLLM's ``nccl`` weight-transfer group: what the
    ``nccl`` transport broadcasts its buckets through, like a
    :class:`~rollsafe.wire.group.WeightUpdateGroup`."""

    backend = "nccl"
    rendezvous = RENDEZVOUS_VLLM

    def __init__(self, communicator: Any, server: VLLMStoreServer, device: torch.device) -> None:
        self.communicator = communicator
        self.server: VLLMStoreServer | None = server
        self.device = device
        self.name = VLLM_WEIGHT_TRANSFER_GROUP
        self.token: str | None = None
        self._stream: Any = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()

    @property
    def store(self) -> Any:
        return None if self.server is None else self.server.store

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> _EventWork:
        """Enqueue ``ncclBroadcast`` of ``tensor`` from ``root`` on the group's stream, after
        what the current stream queued (the packing copy); returns a work whose future
        completes when the broadcast did."""
        comm = self.communicator
        if comm is None:
            raise InvalidArgument("group", "the weight-transfer group is closed")
        with self._lock:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            comm.broadcast(tensor, src=root, stream=stream)
            tensor.record_stream(stream)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        return _EventWork(done)

    def close(self) -> None:
        """Abort the communicator (bounded, as vLLM's ``destroy``) and drop the store server."""
        comm, self.communicator = self.communicator, None
        if comm is not None:
            destroy = getattr(comm, "destroy", None)
            if destroy is not None:
                finished = threading.Event()

                def abort() -> None:
                    try:
                        destroy()
                    except Exception:
                        pass
                    finished.set()

                start_daemon(abort, name="rollsafe-vllm-nccl-abort")
                finished.wait(ABORT_TIMEOUT_S + 1.0)
        server, self.server = self.server, None
        if server is not None:
            server.close()


class _EventWork:
    """A ``torch.distributed`` ``Work`` look-alike over a CUDA event (what the transport waits
    on): ``get_future()`` completes once the event did (a daemon thread synchronizes it)."""

    def __init__(self, event: Any) -> None:
        self._event = event
        self._future: Any = torch.futures.Future()
        future = self._future

        def wait() -> None:
            try:
                event.synchronize()
            except Exception as exc:
                future.set_exception(exc)
                return
            future.set_result(None)

        start_daemon(wait, name="rollsafe-vllm-nccl-work")

    def get_future(self) -> Any:
        return self._future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            self._future.wait()
            return True
        done = threading.Event()
        self._future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout.total_seconds()):
            raise TimeoutError(f"broadcast not done within {timeout.total_seconds()}s")
        self._future.wait()
        return True


def open_vllm_weight_transfer_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    device: torch.device | str | int | None = None,
    timeout_s: float = VLLM_STORE_TIMEOUT_S,
) -> VLLMWeightTransferGroup:
    """Join a real vLLM's ``nccl`` weight-transfer group as its rank 0 (the trainer); blocks
    until every engine rank joined (``ncclCommInitRank`` and the warm-up ``all_reduce``).

    ``device``: the CUDA device the trainer broadcasts from (default: the current one).
    ``timeout_s`` bounds the store waits; NCCL's own init is bounded by the engine's 300 s
    store wait (the transport runs this on a thread of its own and enforces its deadline)."""
    api = require_vllm_rendezvous()
    if device is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        if dev.type != "cuda":
            raise InvalidArgument("device", f"vLLM's PyNccl broadcasts from CUDA, not {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    server = VLLMStoreServer(master_address, master_port, world_size, connect_timeout_s=timeout_s)
    try:
        group = api.group_cls(rank=0, world_size=world_size, store=server.store)
        env: AbstractContextManager[Any] = api.nccl_env()
        with env, torch.cuda.device(dev):
            communicator = api.communicator_cls(group, device=dev)
        if getattr(communicator, "disabled", False):
            raise VLLMRendezvousUnavailable(
                "vLLM's PyNcclCommunicator came up disabled in the trainer process (no NCCL "
                "library it can load, or VLLM_DISABLE_PYNCCL): the engine waits for "
                f"{broadcast_key(0, 0)!r} in vain; set VLLM_NCCL_SO_PATH or unset "
                "VLLM_DISABLE_PYNCCL",
                name="vllm",
            )
    except BaseException:
        server.close()
        raise
    return VLLMWeightTransferGroup(communicator, server, dev)
