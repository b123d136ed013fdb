"""A real multi-node Ray cluster on one machine: for the demo's ``--nodes``, the node-loss
benchmark and the tests (``docs/cluster.md``, "Testing on one machine").

:func:`local_cluster` starts ``ray.cluster_utils.Cluster``: a head node and worker nodes, each
its own raylet with its own resources, in a private temporary directory (``RAY_TMPDIR``, so the
cluster's address file never makes another process's bare ``ray.init()`` join it; short, since
Ray's socket paths under it must fit AF_UNIX's 107 bytes), with the GCS's node health check at
``health_check_period_ms`` (so a removed node is noticed within seconds), and sets
``RAY_ADDRESS`` for whoever calls ``ray.init`` next. Leaving the context disconnects the
driver, shuts down exactly the nodes it started and restores the environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["HEALTH_PERIOD", "local_cluster"]

#: the GCS's node health-check period (ms; Ray's default 3000), read by the GCS it starts
HEALTH_PERIOD = "RAY_health_check_period_ms"


@contextlib.contextmanager
def local_cluster(
    workers: Sequence[Mapping[str, float]],
    *,
    head_resources: Mapping[str, float] | None = None,
    cpus_per_node: int = 1,
    health_check_period_ms: int = 1000,
) -> Iterator[Any]:
    """A head node (``cpus_per_node`` CPUs, ``head_resources``) and one worker node per
    ``workers`` entry (``cpus_per_node`` CPUs and those custom resources each); yields the
    ``Cluster``; the driver is not connected (``RAY_ADDRESS`` points at the head)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ADDRESS", HEALTH_PERIOD)}
    os.environ["RAY_TMPDIR"] = tmp
    os.environ[HEALTH_PERIOD] = str(health_check_period_ms)
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
        with contextlib.suppress(Exception):
            ray.shutdown()
        with contextlib.suppress(Exception):
            cluster.shutdown()  # type: ignore[no-untyped-call]
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)
