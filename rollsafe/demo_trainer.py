"""The demo's trainer: a tiny Llama trained with SGD, in this process or as a Ray actor.

This module owns the trainer side of ``rollsafe demo``:

* :class:`Trainer` -- a plain PyTorch trainer (the reference engine's tiny Llama loaded from a
  local directory, SGD on seeded synthetic token batches). ``step()``, ``weights()``,
  ``checksum()``; ``benchmarks/bench_recovery.py`` uses it in-process.
* :class:`TrainerHost` -- the body of the Ray trainer actor. It owns a :class:`Trainer` (model and
  optimizer live in the actor's process) and answers with plain, picklable data: a weights
  snapshot is one flat ``uint8`` numpy array per tensor, which Ray's serializer moves out of band
  into the object store.
* :class:`RayTrainer` -- the driver's handle, with :class:`Trainer`'s interface. It starts a local
  Ray (or joins ``RAY_ADDRESS``'s cluster through :func:`rollsafe.adapters.ray.init_ray`), creates
  the actor pinned to the driver's node, times every round trip (driver-measured and in-actor
  seconds) and shuts down what it started.

Where the weights travel (the verl / slime split of trainer and rollout): the trainer actor owns
model and optimizer; each version is fetched by the driver through the object store
(``ray.get`` on one node maps the snapshot's buffers zero-copy; the only copy is the actor's
serialization into shared memory) and handed to ``RolloutFleet.sync_weights``. So the whole
fleet -- router, health manager, recovery coordinator and the transport's registration that a
targeted push re-sends -- stays in one process, and every transport (``ipc`` shared-memory
buckets, ``nccl`` broadcast, gloo on CPU) pushes from the process holding the tensors: the
driver's read-only views of the actor's snapshot. A snapshot is immutable: the actor's next
optimizer step cannot change a registered version behind the transport's back. The fetched
tensors are checked against the checksum the actor computed when it took the snapshot.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollsafe.errors import RollsafeError

if TYPE_CHECKING:
    import torch

    from rollsafe.adapters.ray.session import RayStopReport

__all__ = [
    "RayTrainer",
    "RoundTrips",
    "Trainer",
    "TrainerError",
    "TrainerHost",
    "TrainerLike",
]

#: Seconds the driver waits for the actor to be created and load the model.
ACTOR_START_TIMEOUT_S = 180.0
#: Seconds the driver waits for one actor call (train step, snapshot, checksum).
CALL_TIMEOUT_S = 120.0
#: Object-store size of the local Ray the demo starts (the tiny model is under 1 MB).
OBJECT_STORE_BYTES = 128 << 20


class TrainerError(RollsafeError, RuntimeError):
    """The trainer actor could not be started, or a weights snapshot arrived corrupted."""


class TrainerLike(Protocol):
    """What the demo needs of a trainer."""

    def step(self) -> float: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def checksum(self) -> str: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- in-process
class Trainer:
    """A plain PyTorch trainer: a tiny Llama and SGD on seeded synthetic token batches."""

    def __init__(self, model_dir: Path | str, seed: int = 0, lr: float = 0.05) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        self.model.train()
        self.vocab = int(self.model.config.vocab_size)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> float:
        """One SGD step on a fresh synthetic batch; return the loss."""
        import torch

        batch = torch.randint(0, self.vocab, (4, 16), generator=self.gen)
        out = self.model(input_ids=batch, labels=batch)
        self.opt.zero_grad()
        out.loss.backward()
        self.opt.step()
        return float(out.loss.detach())

    def weights(self) -> dict[str, torch.Tensor]:
        """A snapshot (copies) of the parameters: the next ``step()`` does not change it."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def checksum(self) -> str:
        """The whole-model digest of the current parameters (``rollsafe.checksum``)."""
        from rollsafe.checksum import weights_checksum

        live = {n: p.detach() for n, p in self.model.named_parameters()}
        return str(weights_checksum(live)["model"])

    def describe(self) -> dict[str, Any]:
        """Where the trainer runs (for the demo's summary)."""
        return {"kind": "in_process", "pid": os.getpid(), "driver_pid": os.getpid()}

    def close(self) -> None:
        """Nothing to release in-process."""


# ---------------------------------------------------------------------------- actor body
class TrainerHost:
    """The Ray trainer actor's body: owns a :class:`Trainer`; answers with picklable data.

    Every method returns the seconds it spent in the actor under ``"seconds"`` so the driver
    can split a round trip into work and Ray overhead.
    """

    def __init__(self, model_dir: str, seed: int = 0, lr: float = 0.05) -> None:
        t = time.monotonic()
        self._trainer = Trainer(model_dir, seed=seed, lr=lr)
        self._load_s = time.monotonic() - t

    def info(self) -> dict[str, Any]:
        """pid, node, torch threads and model size of the actor."""
        import torch

        node: str | None = None
        with contextlib.suppress(Exception):
            import ray

            node = str(ray.get_runtime_context().get_node_id())
        params = list(self._trainer.model.parameters())
        return {
            "pid": os.getpid(),
            "node_id": node,
            "torch_threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in params),
            "bytes": sum(p.numel() * p.element_size() for p in params),
            "model_load_s": self._load_s,
            "seconds": 0.0,
        }

    def step(self) -> dict[str, Any]:
        """One training step: ``{"loss", "seconds"}``."""
        t = time.monotonic()
        loss = self._trainer.step()
        return {"loss": loss, "seconds": time.monotonic() - t}

    def checksum(self) -> dict[str, Any]:
        """``{"checksum", "seconds"}`` of the actor's current parameters."""
        t = time.monotonic()
        digest = self._trainer.checksum()
        return {"checksum": digest, "seconds": time.monotonic() - t}

    def snapshot(self) -> dict[str, Any]:
        """The current parameters as one flat ``uint8`` array each, plus their checksum.

        The arrays view the live parameters; Ray serializes them into the object store when
        this method returns, before the actor runs its next call, so what the driver gets is the
        state at this call.
        """
        t = time.monotonic()
        names, dtypes, shapes, arrays = [], [], [], []
        for name, p in self._trainer.model.named_parameters():
            flat = p.detach().contiguous().reshape(-1).view(_uint8())
            names.append(name)
            dtypes.append(str(p.dtype).removeprefix("torch."))
            shapes.append(list(p.shape))
            arrays.append(flat.numpy())
        digest = self._trainer.checksum()
        return {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "arrays": arrays,
            "checksum": digest,
            "seconds": time.monotonic() - t,
        }


def _uint8() -> torch.dtype:
    import torch

    return torch.uint8


def tensors_from_snapshot(snapshot: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rebuild named tensors from :meth:`TrainerHost.snapshot` without copying the bytes.

    The arrays Ray hands back from the object store are read-only; the tensors view them (torch
    warns about non-writable arrays: nothing here or in the transports writes to them).
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        for name, dtype, shape, arr in zip(
            snapshot["names"],
            snapshot["dtypes"],
            snapshot["shapes"],
            snapshot["arrays"],
            strict=True,
        ):
            flat = torch.from_numpy(arr)
            out[name] = flat.view(getattr(torch, dtype)).reshape(shape)
    return out


# ---------------------------------------------------------------------------- driver handle
@dataclass
class RoundTrips:
    """Calls to one actor method: count, driver-measured seconds and in-actor seconds."""

    calls: int = 0
    seconds: float = 0.0
    in_actor_s: float = 0.0

    def add(self, seconds: float, in_actor_s: float) -> None:
        self.calls += 1
        self.seconds += seconds
        self.in_actor_s += in_actor_s

    def as_dict(self) -> dict[str, float | int]:
        return {
            "calls": self.calls,
            "seconds": round(self.seconds, 4),
            "in_actor_s": round(self.in_actor_s, 4),
            "overhead_s": round(max(0.0, self.seconds - self.in_actor_s), 4),
        }


def _stop_summary(stop: RayStopReport) -> dict[str, Any]:
    """The local Ray's shutdown for the summary: how many processes its session had, which
    outlived ``ray.shutdown()`` (ended here by pid), which needed SIGKILL, which are left."""
    return {
        "session": len(stop.processes),
        "outlived_shutdown": [p.describe() for p in stop.outlived_shutdown],
        "killed": [p.describe() for p in stop.killed],
        "left": [f"{p.describe()}: {files}" for p, files in stop.left],
        "shutdown_s": round(stop.shutdown_s, 3),
        "wait_s": round(stop.wait_s, 3),
    }


class RayTrainer:
    """The demo's trainer as a Ray actor (:class:`TrainerHost`), with :class:`Trainer`'s API.

    Without ``RAY_ADDRESS`` it starts a fresh local Ray (``address="local"``: never a cluster
    found in Ray's default temp dir) with ``num_cpus`` CPUs, its files under ``temp_dir``;
    with ``RAY_ADDRESS`` it joins that cluster. The actor is pinned to the driver's node (it
    reads ``model_dir`` from the local disk). :meth:`close` kills the actor and shuts down the
    Ray this object started; it is idempotent and also runs if the constructor fails.
    """

    kind = "ray_actor"

    def __init__(
        self,
        model_dir: Path | str,
        seed: int = 0,
        lr: float = 0.05,
        *,
        temp_dir: Path | str | None = None,
        num_cpus: int | None = None,
        actor_cpus: float = 1.0,
    ) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        except ImportError as exc:  # pragma: no cover - the [ray] extra is missing
            raise TrainerError(
                "the Ray trainer actor needs Ray: pip install 'rollsafe[ray]'"
                " (or run the demo with --trainer inprocess)"
            ) from exc
        from rollsafe.adapters.ray import init_ray

        self._ray: Any = ray
        self.round_trips: dict[str, RoundTrips] = {
            m: RoundTrips() for m in ("step", "snapshot", "checksum")
        }
        self.fetch_s = 0.0  # driver time rebuilding and verifying snapshots
        self.start_s = 0.0
        self.shutdown_s = 0.0
        #: what the shutdown of the local Ray found and ended (``None``: not shut down here)
        self.ray_stop: RayStopReport | None = None
        self.actor: Any = None
        self.started_ray = False
        self._closed = False
        self._info: dict[str, Any] = {}
        self._zero_copy = True
        self.temp_dir = str(temp_dir) if temp_dir is not None else None
        t0 = time.monotonic()
        try:
            address = os.environ.get("RAY_ADDRESS") or None
            if address:
                self.started_ray = init_ray(
                    address=address, log_to_driver=False, configure_logging=False
                )
            else:
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                self.started_ray = init_ray(
                    address="local",
                    num_cpus=num_cpus or max(1, os.cpu_count() or 1),
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    object_store_memory=OBJECT_STORE_BYTES,
                    _temp_dir=self.temp_dir,
                )
            self.ray_init_s = time.monotonic() - t0
            node = ray.get_runtime_context().get_node_id()
            actor_cls = ray.remote(num_cpus=actor_cpus, max_restarts=0)(TrainerHost)
            self.actor = actor_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            ).remote(str(model_dir), seed, lr)
            try:
                self._info = ray.get(self.actor.info.remote(), timeout=ACTOR_START_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError as exc:
                raise TrainerError(
                    f"the trainer actor did not start within {ACTOR_START_TIMEOUT_S}s"
                    f" (cluster resources: {self._ray.available_resources()})"
                ) from exc
            self._info["address"] = ray.get_runtime_context().gcs_address
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - t0

    # ------------------------------------------------------------------ the Trainer API
    def _call(self, method: str) -> dict[str, Any]:
        if self._closed:
            raise TrainerError("the trainer actor was closed")
        t = time.monotonic()
        out: dict[str, Any] = self._ray.get(
            getattr(self.actor, method).remote(), timeout=CALL_TIMEOUT_S
        )
        self.round_trips[method].add(time.monotonic() - t, float(out.get("seconds", 0.0)))
        return out

    def step(self) -> float:
        """One training step in the actor; return the loss."""
        return float(self._call("step")["loss"])

    def weights(self) -> dict[str, torch.Tensor]:
        """The actor's current parameters, fetched through the object store (zero-copy).

        Raises :class:`TrainerError` if the fetched tensors do not digest to the checksum the
        actor computed when it took the snapshot.
        """
        from rollsafe.checksum import weights_checksum

        snap = self._call("snapshot")
        t = time.monotonic()
        tensors = tensors_from_snapshot(snap)
        self._zero_copy = self._zero_copy and all(
            not a.flags.writeable for a in snap["arrays"] if a.nbytes
        )
        got = weights_checksum(tensors)["model"]
        self.fetch_s += time.monotonic() - t
        if got != snap["checksum"]:
            raise TrainerError(
                f"weights fetched from the trainer actor digest to {got},"
                f" the actor sent {snap['checksum']}"
            )
        return tensors

    def checksum(self) -> str:
        """The whole-model digest of the actor's current parameters (asked of the actor)."""
        return str(self._call("checksum")["checksum"])

    def describe(self) -> dict[str, Any]:
        """Where the trainer ran and what its round trips cost (for the demo's summary)."""
        return {
            "kind": self.kind,
            "pid": self._info.get("pid"),
            "driver_pid": os.getpid(),
            "node_id": self._info.get("node_id"),
            "ray_address": self._info.get("address"),
            "started_local_ray": self.started_ray,
            "ray_temp_dir": self.temp_dir if self.started_ray else None,
            "torch_threads": self._info.get("torch_threads"),
            "parameters": self._info.get("parameters"),
            "weights_bytes": self._info.get("bytes"),
            "model_load_s": round(float(self._info.get("model_load_s", 0.0)), 3),
            "start_s": round(self.start_s, 3),
            "ray_init_s": round(getattr(self, "ray_init_s", 0.0), 3),
            "round_trips": {m: r.as_dict() for m, r in self.round_trips.items()},
            "fetch_rebuild_verify_s": round(self.fetch_s, 4),
            "weights_fetched_zero_copy": self._zero_copy,
            "shutdown_s": round(self.shutdown_s, 3),
            "ray_processes": None if self.ray_stop is None else _stop_summary(self.ray_stop),
        }

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Kill the actor and shut down the Ray this object started; with ``temp_dir``, wait
        until every process of that Ray session is gone (:attr:`ray_stop` says what was found
        and ended, and what could not be), so its files can be removed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        t = time.monotonic()
        ray = self._ray
        try:
            if self.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(self.actor, no_restart=True)
                self.actor = None
        finally:
            if self.started_ray and ray.is_initialized():
                if self.temp_dir is None:
                    ray.shutdown()
                else:  # every process of the session gone, by pid, before its files go
                    from rollsafe.adapters.ray.session import stop_local_ray

                    self.ray_stop = stop_local_ray(ray.shutdown, self.temp_dir)
            self.shutdown_s = time.monotonic() - t
