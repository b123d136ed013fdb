"""A real multi-node Ray cluster on this machine for tests, and the gate of tests that need Ray.

:func:`require_ray` imports Ray: without it a developer's run skips with the reason, and under
``CI=true`` the test fails instead (CI never passes without having run the Ray tests).

:func:`local_cluster` starts ``ray.cluster_utils.Cluster``: a head node and worker nodes, each
its own raylet with its own resources, in a private temporary directory (``RAY_TMPDIR``, so the
cluster's address file never makes another process's bare ``ray.init()`` join it), and sets
``RAY_ADDRESS`` for the fleet under test to join. Teardown disconnects the driver and shuts
down exactly the nodes it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

#: the GCS's node health-check period (ms; Ray's default 3000), read by the GCS it starts
HEALTH_PERIOD = "RAY_health_check_period_ms"


def require_ray() -> Any:
    """``import ray``; skip without it, except under ``CI=true`` where that fails."""
    try:
        import ray
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Ray is required under CI=true: {exc}")
        pytest.skip(f"Ray is not installed: {exc}")
    return ray


@contextlib.contextmanager
def local_cluster(
    workers: Sequence[Mapping[str, float]], *, head_resources: Mapping[str, float] | None = None
) -> Iterator[Any]:
    """A head node (1 CPU, ``head_resources``) and one worker node per ``workers`` entry (1 CPU
    and those custom resources each); yields the ``Cluster``; the driver is not connected
    (``RAY_ADDRESS`` points at the head for whoever calls ``ray.init`` next)."""
    ray = require_ray()
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")  # short: raylet socket paths
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ADDRESS", HEALTH_PERIOD)}
    os.environ["RAY_TMPDIR"] = tmp
    os.environ[HEALTH_PERIOD] = "1000"  # the GCS notices a removed node within seconds
    cluster = Cluster(shutdown_at_exit=True)
    try:
        cluster.add_node(num_cpus=1, resources=dict(head_resources or {}), include_dashboard=False)
        for resources in workers:
            cluster.add_node(num_cpus=1, resources=dict(resources))
        cluster.wait_for_nodes(timeout=120)
        os.environ["RAY_ADDRESS"] = str(cluster.address)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        with contextlib.suppress(Exception):
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for(predicate: Callable[[], bool], timeout: float = 120.0, step: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` s passed; return its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(step)
    return True
