"""The Ray actor that owns one engine group: ``EngineHost`` / ``EngineActor``, and ``init_ray()``.

``EngineActor`` runs an :class:`~rollsafe.adapters.engines.EngineLauncher` on the node it is
scheduled on, so an engine group's processes live and die with the actor's node placement. It is
a threaded actor (``max_concurrency`` > 1): a health probe or ``url()`` answers while a slow
``restart()`` runs, so one recovery never blocks health checking (``docs/design.md``, invariant
``recovery_never_on_health_thread``).

Ray is imported only when ``init_ray()`` is called or ``EngineActor`` / ``engine_actor()`` is
first used, so ``import rollsafe.adapters`` and ``rollsafe.adapters.engines`` work without it.
The plain class :class:`EngineHost` holds the logic and can be used (and tested) without Ray.
With ``bind_node_ip=True`` the engine listens on the IP of the node the actor runs on (Ray's
``get_node_ip_address()``), so the URL it reports reaches it from another node
(:class:`~rollsafe.adapters.ray.group.RayEngineGroup` uses that).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rollsafe.adapters.engines.launch.spec import EngineSpec
from rollsafe.adapters.engines.launcher import EngineLauncher
from rollsafe.adapters.ray.session import sigterm_back_to_python
from rollsafe.ports import GenerateResult, WeightsChecksum

# EngineActor is provided lazily by the module-level __getattr__ below.
__all__ = ["EngineActor", "EngineHost", "driver_node_ip", "engine_actor", "init_ray"]  # noqa: F822

#: Default Ray options for the actor: threaded so health stays responsive during a restart.
DEFAULT_ACTOR_OPTIONS: Mapping[str, Any] = {"num_cpus": 0, "max_concurrency": 8}


def init_ray(**kwargs: Any) -> bool:
    """Connect to Ray once: a no-op if already initialized.

    With ``RAY_ADDRESS`` set (or an ``address=`` argument) it connects to that cluster; otherwise
    it starts a new local Ray without the dashboard (never silently joining a cluster that
    ``ray start`` left running on this machine) whose workers run at niceness
    :data:`~rollsafe.adapters.ray.local.WORKER_NICENESS`, not Ray's 15 (``_system_config``'s
    ``worker_niceness``, unless given: the engines and the trainer actor are the work). Other
    keyword arguments go to ``ray.init``.
    Afterwards SIGTERM reaches the Python handler ``ray.init`` set, not Ray's C++ failure
    handler in front of it (whose alarm aborts the process 3 s after a SIGTERM, whatever its
    cleanup is doing: :func:`~rollsafe.adapters.ray.session.sigterm_back_to_python`).
    Returns True if this call initialized Ray.
    """
    import ray

    if ray.is_initialized():
        return False
    address = kwargs.pop("address", None) or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":
        ray.init(address=address, **kwargs)
    else:
        # "local": start a new local Ray even when `ray start` left a cluster under /tmp/ray
        # (a bare ray.init() would join that one)
        from rollsafe.adapters.ray.local import WORKER_NICENESS

        kwargs.setdefault("include_dashboard", False)
        system = dict(kwargs.pop("_system_config", None) or {})
        system.setdefault("worker_niceness", WORKER_NICENESS)
        ray.init(address="local", _system_config=system, **kwargs)
    sigterm_back_to_python()
    return True


class EngineHost:
    """Owns one engine group through an :class:`EngineLauncher`; the body of ``EngineActor``.

    Every method returns plain, picklable data. ``health()`` never takes the launcher lock, so it
    answers (False) while a restart is in progress instead of waiting for it.
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        bind_node_ip: bool = False,
        node_slice: tuple[int, str, str | None] | None = None,
    ) -> None:
        """``node_slice`` (a group that spans nodes): ``(node_rank, key, dist_init_addr)``; the
        head (node rank 0) picks its own address (this node's IP or ``spec.host``, a free port,
        :meth:`dist_init_addr`), every other slice is given it: at creation, or (created with
        None, so that its actor starts beside the head's) by :meth:`join_head` before its
        first start."""
        if bind_node_ip:
            spec = dataclasses.replace(spec, host=_node_ip())
        #: a slice still waiting for its head's address: (its spec, its node rank, the key)
        self._pending: tuple[EngineSpec, int, str] | None = None
        #: True: the log directory was made here (a waiting slice's), its launcher removes it;
        #: None: the launcher's default (it owns a directory it makes itself)
        self._owns_log_dir: bool | None = None
        if node_slice is not None:
            from rollsafe.adapters.engines.launch.spec import slice_spec
            from rollsafe.net import free_port

            node_rank, key, addr = node_slice
            if addr is None and node_rank == 0:
                host = "127.0.0.1" if spec.host in ("0.0.0.0", "::", "") else spec.host
                addr = f"{host}:{free_port(host)}"
            if addr is None:  # the launcher made now is replaced by join_head's (same logs)
                if spec.log_dir is None:
                    spec = dataclasses.replace(
                        spec, log_dir=tempfile.mkdtemp(prefix="rollsafe-engine-")
                    )
                    self._owns_log_dir = True
                self._pending = (spec, node_rank, key)
            else:
                spec = slice_spec(spec, node_rank, addr, key)
        self._spec = spec
        self._launcher = EngineLauncher(spec, owns_log_dir=self._owns_log_dir)
        self._lock = threading.Lock()
        #: the process that started this one: under Ray, the raylet of the actor's node
        self._parent_pid = os.getppid()

    # -- lifecycle ------------------------------------------------------------------------
    def join_head(self, dist_init_addr: str) -> None:
        """Take the head's ``HOST:PORT`` (:meth:`dist_init_addr` of the head's actor): a slice
        created without it (``node_slice=(R, key, None)``, R > 0) starts joined to it from now
        on. ``RuntimeError`` for any other actor, or once it was given one."""
        from rollsafe.adapters.engines.launch.spec import slice_spec

        with self._lock:
            if self._pending is None:
                raise RuntimeError(
                    "join_head: this actor is not a node slice waiting for its head's address"
                )
            spec, node_rank, key = self._pending
            self._spec = slice_spec(spec, node_rank, dist_init_addr, key)
            self._launcher = EngineLauncher(self._spec, owns_log_dir=self._owns_log_dir)
            self._pending = None

    def _require_joined(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                f"node slice {self._pending[1]} has no head address yet: call join_head() first"
            )

    def start(self) -> dict[str, Any]:
        """Start the engine group; return its ready info (url, pid, rank_pids, ...)."""
        with self._lock:
            self._require_joined()
            self._launcher.start()
            return self._launcher.ready_info

    def stop(self, timeout: float = 10.0, *, keep_standby: bool = False) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after ``timeout``); ``keep_standby`` keeps a warm
        standby for the restart that follows (see :meth:`EngineLauncher.stop`)."""
        with self._lock:
            self._launcher.stop(timeout=timeout, keep_standby=keep_standby)

    def kill(self) -> None:
        """SIGKILL the whole engine group now."""
        with self._lock:
            self._launcher.kill()

    def kill_rank(self, rank: int) -> int:
        """SIGKILL one rank process (chaos testing); return its pid."""
        return self._launcher.kill_rank(rank)

    def restart(
        self,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        weight_version: str | None = None,
        stop_timeout: float = 10.0,
    ) -> dict[str, Any]:
        """Stop and start again with overrides (:meth:`EngineLauncher.restart`); return the new
        ready info."""
        with self._lock:
            self._require_joined()
            self._launcher.restart(
                model_path=model_path,
                tokenizer_path=tokenizer_path,
                load_format=load_format,
                skip_load_weights=skip_load_weights,
                weight_version=weight_version,
                stop_timeout=stop_timeout,
            )
            return self._launcher.ready_info

    def reinit(
        self,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        skip_load_weights: bool = False,
    ) -> dict[str, Any]:
        """XTuner rollout-worker contract (see :meth:`EngineLauncher.reinit`)."""
        return self.restart(
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            skip_load_weights=skip_load_weights,
        )

    # -- observation ----------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self._launcher.is_alive()

    def health(self, timeout: float = 5.0) -> bool:
        """True when the engine answers its health check within ``timeout``."""
        try:
            client = self._launcher.client
        except RuntimeError:
            return False
        return client.is_healthy(timeout=timeout)

    def url(self) -> str | None:
        """The engine's base URL, or None while it is not running."""
        try:
            return self._launcher.url
        except RuntimeError:
            return None

    def pids(self) -> dict[str, Any]:
        """``{"pid": server pid, "rank_pids": [...]}`` (empty while not running)."""
        try:
            return {"pid": self._launcher.pid, "rank_pids": self._launcher.rank_pids}
        except RuntimeError:
            return {"pid": None, "rank_pids": []}

    def standby(self) -> dict[str, Any]:
        """The warm standby without the launcher lock (answers during a restart):
        ``{"state": ..., "last_start_source": ..., "status": {...}}``."""
        return {
            "state": self._launcher.standby_state,
            "last_start_source": self._launcher.last_start_source,
            "status": self._launcher.standby_status(),
        }

    def spec(self) -> dict[str, Any]:
        return dataclasses.asdict(self._launcher.spec)

    def dist_init_addr(self) -> str | None:
        """The head's ``HOST:PORT`` the other slices of its group join (None: one node)."""
        return self._spec.dist_init_addr

    def node_alive(self) -> bool:
        """Whether the process that started this one (under Ray: the raylet of the actor's
        node) still runs. A worker whose raylet died is orphaned: it answers actor calls for a
        while (calls go worker to worker, not through the raylet; 0.2-2 s idle, longer on a
        loaded machine) until it notices, but its node is lost (``docs/cluster.md``)."""
        return os.getppid() == self._parent_pid

    def node_id(self) -> str | None:
        """The Ray node this actor runs on (None outside Ray)."""
        try:
            import ray

            return str(ray.get_runtime_context().get_node_id())
        except Exception:
            return None

    def output_tail(self) -> str:
        return self._launcher.output_tail()

    def pull_export(
        self,
        parcel: Any,
        dest_root: str | None,
        *,
        fleet: str | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Copy a published export (:func:`~rollsafe.adapters.ray.exports.publish_export`) to
        this node's ``dest_root`` through Ray's object store, every file checked against the
        export's manifest before it is kept (a mismatch raises ``ExportPullRefused``);
        ``{"path", "nbytes", "reused", "node_id"}``: ``path`` is what a restart loads.
        ``fleet`` (the fleet's mover): the copy goes under
        ``<dest_root or this node's temporary directory>/rollsafe-moved/<fleet>/<node id>``,
        so fleets, and nodes that share a disk, never take each other's copies. ``timeout_s``
        bounds the fetch (``ExportPullTimeout``, nothing left behind; None: no bound)."""
        from rollsafe.adapters.ray.exports import receive_export

        if fleet is not None:
            node = self.node_id() or "local"
            base = dest_root if dest_root is not None else tempfile.gettempdir()
            dest_root = os.path.join(base, "rollsafe-moved", fleet, node[:16])
        elif dest_root is None:
            raise ValueError("pull_export: dest_root is None and no fleet is named")
        pulled = receive_export(parcel, dest_root, timeout_s=timeout_s)
        return {**dataclasses.asdict(pulled), "node_id": self.node_id()}

    # -- serving and weights --------------------------------------------------------------
    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        return self._launcher.client.generate(
            input_ids, text=text, sampling_params=sampling_params, timeout=timeout
        )

    def weights_checksum(self) -> WeightsChecksum:
        return self._launcher.client.weights_checksum()

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> str:
        return self._launcher.client.update_weights_from_disk(
            model_path, load_format=load_format, weight_version=weight_version
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call any :class:`EngineClient` method on the engine (e.g. ``"flush_cache"``)."""
        if method.startswith("_"):
            raise AttributeError(f"refusing to call private client method {method!r}")
        return getattr(self._launcher.client, method)(*args, **kwargs)


def _node_ip() -> str:
    import ray

    api: Any = ray.util  # get_node_ip_address() is untyped
    return str(api.get_node_ip_address())


def driver_node_ip() -> str:
    """The IP of the Ray node this process (the trainer's driver) runs on, as Ray reports it:
    the address engines on other nodes reach the trainer's weight-update store on."""
    return _node_ip()


def engine_actor(**options: Any) -> Any:
    """The ``EngineActor`` Ray actor class with ``options`` over :data:`DEFAULT_ACTOR_OPTIONS`.

    ``engine_actor(num_cpus=1).remote(spec)`` creates one actor owning one engine group.
    """
    import ray

    merged = {**DEFAULT_ACTOR_OPTIONS, **options}
    return ray.remote(**merged)(EngineHost)


_actor_class: Any = None


def __getattr__(name: str) -> Any:
    # ``EngineActor`` is built on first access so that importing this module does not import Ray.
    global _actor_class
    if name == "EngineActor":
        if _actor_class is None:
            _actor_class = engine_actor()
        return _actor_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
