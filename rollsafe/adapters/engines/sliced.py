"""``SlicedLauncher``: one engine group over several node slices, on this machine.

A group that spans nodes (``EngineSpec.ranks_per_node``, ``docs/cluster.md``) runs one engine
process per node slice: the head (node rank 0: the HTTP server and the first slice's ranks) and
one process per other slice (its ranks, no server), all joined to the head at one
``dist_init_addr``. Placed by Ray, each slice runs on its own node
(:class:`~rollsafe.adapters.ray.RayEngineGroup`); on this machine (``placement="local"``) the
slices are virtual nodes: one :class:`~rollsafe.adapters.engines.EngineLauncher` each, the same
processes and the same joining as across machines, on loopback.

The group lives and dies whole: :meth:`SlicedLauncher.start` starts every slice at once and
returns when the head is ready (the head waits for every slice's ranks); a slice that fails to
start fails the start and stops the others; :meth:`~SlicedLauncher.restart` restarts every slice
with the same overrides (each slice loads its shard from the same path); a slice's process that
dies fails the head's ranks at once (the engine's health says so), and the group's recovery
restarts it whole. The head's address (a free port on ``spec.host``) and the group's key are
picked once, for the launcher's life.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import secrets
from typing import Any

from rollsafe.adapters.engines.launch.spec import EngineSpec, slice_spec
from rollsafe.adapters.engines.launcher import EngineLauncher
from rollsafe.errors import InvalidArgument
from rollsafe.net import free_port
from rollsafe.ports import StandbyState, StartSource

__all__ = ["SlicedLauncher", "launcher_for"]


def launcher_for(spec: EngineSpec) -> EngineLauncher | SlicedLauncher:
    """The launcher of ``spec``'s group on this machine: an ``EngineLauncher``, or a
    :class:`SlicedLauncher` for a group that spans nodes."""
    return SlicedLauncher(spec) if spec.slices > 1 else EngineLauncher(spec)


class SlicedLauncher:
    """One engine group of ``spec.slices`` node slices on this machine (see the module).
    Implements :class:`~rollsafe.ports.LaunchableEngine`. Thread-safe as its launchers are."""

    def __init__(self, spec: EngineSpec) -> None:
        if spec.slices < 2:
            raise InvalidArgument(
                "EngineSpec.ranks_per_node",
                f"a SlicedLauncher runs a group over several nodes; this one has ranks="
                f"{spec.ranks}, ranks_per_node={spec.ranks_per_node} (use EngineLauncher)",
            )
        host = "127.0.0.1" if spec.host in ("0.0.0.0", "::", "") else spec.host
        self.dist_init_addr = f"{host}:{free_port(host)}"
        self._key = secrets.token_hex(16)
        self.slices = [
            EngineLauncher(slice_spec(spec, r, self.dist_init_addr, self._key))
            for r in range(spec.slices)
        ]

    # ------------------------------------------------------------------ what it tells
    @property
    def head(self) -> EngineLauncher:
        return self.slices[0]

    @property
    def spec(self) -> EngineSpec:
        return self.head.spec

    @property
    def client(self) -> Any:
        return self.head.client

    @property
    def url(self) -> str:
        return self.head.url

    @property
    def ready_info(self) -> dict[str, Any]:
        """The head's ready info, with ``slices``: every slice's (head first)."""
        return {**self.head.ready_info, "slices": [s.ready_info for s in self.slices]}

    @property
    def rank_pids(self) -> list[int]:
        """Every rank's pid in rank order (all on this machine)."""
        return [pid for s in self.slices for pid in s.rank_pids]

    @property
    def standby_state(self) -> StandbyState | None:
        return self.head.standby_state

    @property
    def last_start_source(self) -> StartSource | None:
        return self.head.last_start_source

    def standby_status(self) -> dict[str, Any]:
        return self.head.standby_status()

    def is_alive(self) -> bool:
        return all(s.is_alive() for s in self.slices)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SlicedLauncher:
        """Start every slice at once; return when the head is ready (every slice's ranks
        joined it). A slice that fails fails the start: every slice is stopped, the error
        raised."""
        self._together(lambda s: s.start())
        return self

    def restart(
        self,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        weight_version: str | None = None,
        stop_timeout: float = 10.0,
    ) -> SlicedLauncher:
        """Restart every slice with the same overrides (each loads its shard from the same
        ``model_path``); returns when the head is ready."""
        self._stop_workers(stop_timeout)
        self._together(
            lambda s: s.restart(
                model_path=model_path,
                load_format=load_format,
                skip_load_weights=skip_load_weights,
                weight_version=weight_version,
                stop_timeout=stop_timeout,
            )
        )
        return self

    def stop(self, *, timeout: float = 10.0, keep_standby: bool = False) -> None:
        """Stop the head (its slices' links close and they exit), then every other slice."""
        try:
            self.head.stop(timeout=timeout, keep_standby=keep_standby)
        finally:
            self._stop_workers(timeout)

    def kill(self) -> None:
        for s in self.slices:
            with contextlib.suppress(Exception):
                s.kill()

    def kill_rank(self, rank: int) -> int:
        """SIGKILL rank ``rank`` (on whichever slice runs it); return its pid."""
        per_node = self.spec.ranks // len(self.slices)
        if not 0 <= rank < self.spec.ranks:
            raise IndexError(f"rank {rank} out of range: the group has {self.spec.ranks} ranks")
        return self.slices[rank // per_node].kill_rank(rank % per_node)

    def kill_slice(self, node_rank: int) -> None:
        """SIGKILL node slice ``node_rank``'s processes at once, as a lost node (chaos)."""
        self.slices[node_rank].kill()

    # ------------------------------------------------------------------ internals
    def _stop_workers(self, timeout: float) -> None:
        for s in self.slices[1:]:
            with contextlib.suppress(Exception):
                s.stop(timeout=timeout)

    def _together(self, run: Any) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(self.slices)) as pool:
            futures = [pool.submit(run, s) for s in self.slices]
            errors = []
            for fut in futures:
                try:
                    fut.result()
                except BaseException as exc:
                    errors.append(exc)
                    self.kill()  # one slice failed: the others never finish joining
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"SlicedLauncher({len(self.slices)} slices, head {self.head!r})"
