"""A real multi-node Ray cluster on one machine: for the demo's ``--nodes``, the node-loss
benchmark and the tests (``docs/cluster.md``, "Testing on one machine").

:func:`local_cluster` starts ``ray.cluster_utils.Cluster``: a head node and worker nodes, each
its own raylet with its own resources, in a private temporary directory (``RAY_TMPDIR``, so the
cluster's address file never makes another process's bare ``ray.init()`` join it; short, since
Ray's socket paths under it must fit AF_UNIX's 107 bytes), with the GCS's node health check at
``health_check_period_ms`` (so a removed node is noticed within seconds), the raylets' worker
registration timeout at ``worker_register_timeout_s`` (Ray's 60 s default kills a worker that
has not registered by then and fails the lease that waited for it: on a loaded one-machine
cluster that turns a slow actor start into a lost one), its workers at niceness
:data:`WORKER_NICENESS` (Ray's default, 15, starves them beside any busy process at 0: the
trainer actor and the engines their hosts start are the work, not background; at 15 on a
2-core machine with 6 busy processes the demo's trainer actor did not start in 180 s, 4 times
in 5, and started in 136 s the fifth), and sets ``RAY_ADDRESS`` for whoever calls
``ray.init`` next. Leaving the context disconnects the
driver, shuts down exactly the nodes it started, waits for every process of the cluster (its
raylets' workers and agents too) to be gone (:func:`~rollsafe.adapters.ray.session.stop_local_ray`)
and restores the environment; with
``ROLLSAFE_KEEP_RAY_LOGS=DIR`` set, the cluster's Ray logs (GCS, raylets, workers) are copied
to ``DIR/<the private directory's name>`` first, for a post-mortem.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rollsafe.adapters.ray.session import stop_local_ray

__all__ = [
    "HEALTH_PERIOD",
    "KEEP_LOGS",
    "NICENESS",
    "REGISTER_TIMEOUT",
    "WORKER_NICENESS",
    "local_cluster",
]

#: the GCS's node health-check period (ms; Ray's default 3000), read by the GCS it starts
HEALTH_PERIOD = "RAY_health_check_period_ms"
#: the raylets' worker registration timeout (s; Ray's default 60), read by each raylet
REGISTER_TIMEOUT = "RAY_worker_register_timeout_seconds"
#: the niceness Ray gives its worker processes (Ray's default 15), read by each worker
NICENESS = "RAY_worker_niceness"
#: the niceness of the workers of the clusters rollsafe starts (here and in ``init_ray``)
WORKER_NICENESS = 0
#: where the cluster's Ray logs are copied when it shuts down (unset: they are removed with it)
KEEP_LOGS = "ROLLSAFE_KEEP_RAY_LOGS"


@contextlib.contextmanager
def local_cluster(
    workers: Sequence[Mapping[str, float]],
    *,
    head_resources: Mapping[str, float] | None = None,
    cpus_per_node: int = 1,
    health_check_period_ms: int = 1000,
    worker_register_timeout_s: int = 300,
) -> Iterator[Any]:
    """A head node (``cpus_per_node`` CPUs, ``head_resources``) and one worker node per
    ``workers`` entry (``cpus_per_node`` CPUs and those custom resources each); yields the
    ``Cluster``; the driver is not connected (``RAY_ADDRESS`` points at the head)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")
    keys = ("RAY_TMPDIR", "RAY_ADDRESS", HEALTH_PERIOD, REGISTER_TIMEOUT, NICENESS)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["RAY_TMPDIR"] = tmp
    os.environ[HEALTH_PERIOD] = str(health_check_period_ms)
    os.environ[REGISTER_TIMEOUT] = str(worker_register_timeout_s)
    os.environ[NICENESS] = str(WORKER_NICENESS)
    cluster = Cluster(shutdown_at_exit=True)
    try:
        cluster.add_node(
            num_cpus=cpus_per_node, resources=dict(head_resources or {}), include_dashboard=False
        )
        for resources in workers:
            cluster.add_node(num_cpus=cpus_per_node, resources=dict(resources))
        cluster.wait_for_nodes(timeout=120)
        os.environ["RAY_ADDRESS"] = str(cluster.address)
        yield cluster
    finally:

        def shutdown() -> None:
            with contextlib.suppress(Exception):
                ray.shutdown()
            with contextlib.suppress(Exception):
                cluster.shutdown()  # type: ignore[no-untyped-call]

        stopped = stop_local_ray(shutdown, tmp)
        if stopped.left:
            print(f"note: the local Ray cluster under {tmp} left {stopped.describe_left()}")
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _keep_logs(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _keep_logs(tmp: str) -> None:
    """Copy ``tmp``'s Ray session logs under ``$ROLLSAFE_KEEP_RAY_LOGS`` (when set)."""
    keep = os.environ.get(KEEP_LOGS)
    if not keep:
        return
    dest = os.path.join(keep, os.path.basename(tmp))
    for root, _dirs, files in os.walk(tmp):
        if os.path.basename(root) != "logs":
            continue
        for name in files:
            src = os.path.join(root, name)
            rel = os.path.relpath(src, tmp)
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
                shutil.copyfile(src, os.path.join(dest, rel))
