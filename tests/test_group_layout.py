"""A weight-update group's two ends meet under SGLang's key layout (``rollsafe.wire.group``).

SGLang 0.5.16 joins a weight-update group (``/init_weights_update_group``) with its
``init_custom_process_group``: a ``tcp://`` rendezvous as rank ``rank_offset + tp_rank``, the
store prefixed with the group's name, then torch's new-group helper (which prefixes it with
``"{name}/"`` and the backend's device again). ``_sglang_rank`` below joins that way, with
torch's own helper, in a process of its own; a trainer whose keys were laid out otherwise never
met it (SGLang's first GPU run: both ends waited, docs/engines.md). gloo on the CPU; the layout
is the same for NCCL but ``"cuda/"``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rollsafe.wire.group import host_store, open_weight_update_group

TIMEOUT_S = 30.0


def _sglang_rank(port: int, rank: int, world: int, name: str, out: Any) -> None:
    """An engine rank that joins as SGLang 0.5.16's ``init_custom_process_group`` does, then
    receives one broadcast from rank 0."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend("gloo"), store, group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    got = torch.zeros(4)
    dist.broadcast(got, src=0, group=pg)
    out.put(got.tolist())


@pytest.mark.parametrize("engine_ranks", [1, 2])
def test_rollsafes_trainer_meets_an_engine_that_joins_as_sglang_does(engine_ranks: int) -> None:
    world = 1 + engine_ranks
    store = host_store("127.0.0.1", 0, world, timeout_s=TIMEOUT_S)
    name = f"rollsafe-layout-{engine_ranks}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_sglang_rank, args=(int(store.port), r, world, name, out), daemon=True)
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    try:
        group = open_weight_update_group(
            master_address="127.0.0.1",
            master_port=int(store.port),
            rank=0,
            world_size=world,
            group_name=name,
            backend="gloo",
            timeout_s=TIMEOUT_S,
            store=store,
        )
        group.broadcast(torch.arange(4, dtype=torch.float32) + 1, 0).wait()
        got = [out.get(timeout=TIMEOUT_S) for _ in procs]
        group.close()
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
    assert got == [[1.0, 2.0, 3.0, 4.0]] * engine_ranks
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
