"""checkpoint-engine as a fleet transport: config, fallback, P2P over TCP, targeted recovery.

Everything here runs on CPU. checkpoint-engine's ``ParameterServer`` refuses to construct
without CUDA, so where it is needed a stand-in (:class:`FakeParameterServer`) takes its place
through ``CheckpointEngineTransport(server_factory=...)``: it records each call (with the
environment it saw) and, on ``update``, calls rollsafe's ``req_func`` as checkpoint-engine does,
so every line of rollsafe's own logic (planning, waves, environment scoping, result merging,
registration machines, the recovery coordinator) runs for real. The GPU run of the same path
is ``benchmarks/gpu/ce_p2p_recovery.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fleet_sim import SimEngineClient, make_fleet

from rollsafe.adapters.engines import EngineSpec
from rollsafe.errors import InvalidArgument
from rollsafe.fleet import (
    CheckpointEngineSettings,
    FleetConfig,
    FleetConfigError,
    GroupSpec,
    RecoverySettings,
    RolloutFleet,
)
from rollsafe.fleet.recovery import RecoveryCoordinator
from rollsafe.fleet.sync import SyncCoordinator
from rollsafe.ports import EngineTarget
from rollsafe.registry import FleetRegistry
from rollsafe.transports import (
    CheckpointEngineFleetTransport,
    CheckpointEngineTransport,
    NCCLTransport,
    P2PUnavailable,
    RegisterError,
)
from rollsafe.transports.checkpoint_engine import (
    DEFAULT_TCP_SLICE_BYTES,
    TCP_PLACEHOLDER_DEVICE,
    fleet_fallback_reasons,
    p2p_environment,
    split_waves,
)

WAIT_S = 30.0
P2P_VARS = (
    "MC_FORCE_TCP",
    "PS_P2P_STORE_RDMA_DEVICES",
    "MC_TRANSFER_TIMEOUT",
    "MC_TCP_SLICE_SIZE",
    "RANK",
)


# ====================================================================== stand-ins
def _env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in P2P_VARS}


class FakeParameterServer:
    """Stands in for ``checkpoint_engine.ps.ParameterServer`` (which needs CUDA).

    ``p2p``: whether Mooncake "starts" (``_p2p_store`` set) when it is not hidden;
    ``p2p_error``: raise it from the constructor instead when Mooncake is visible (as a host
    without RDMA devices does). ``update`` calls ``req_func`` with one socket path per rank and
    records the ``ranks=`` argument, the environment and ``on_update()``'s value.
    """

    def __init__(
        self,
        *,
        p2p: bool = True,
        p2p_error: Exception | None = None,
        on_update: Any = None,
        fail_register: bool = False,
        **kwargs: Any,
    ) -> None:
        mooncake_hidden = "mooncake" in sys.modules and sys.modules["mooncake"] is None
        if p2p_error is not None and not mooncake_hidden:
            raise p2p_error
        self.kwargs = kwargs
        self.env_at_init = _env()
        self.mooncake_hidden = mooncake_hidden
        self._p2p_store = object() if p2p and not mooncake_hidden else None
        self._zmq_ctx = SimpleNamespace(setsockopt=lambda *a: None)
        self.registered: dict[str, dict[str, torch.Tensor]] = {}
        self.env_at_register: list[dict[str, str | None]] = []
        self.updates: list[dict[str, Any]] = []
        self.on_update = on_update
        self.fail_register = fail_register
        self._metas: dict[int, Any] = {}

    def register_checkpoint(
        self, name: str, *, named_tensors: Mapping[str, torch.Tensor] | None = None, **kw: Any
    ) -> None:
        self.env_at_register.append(_env())
        if self.fail_register:
            raise RuntimeError("pinning failed (out of host memory)")
        self.registered[name] = {n: t.clone() for n, t in (named_tensors or {}).items()}

    def unregister_checkpoint(self, name: str, force: bool = False) -> None:
        self.registered.pop(name, None)

    def gather_metas(self, name: str) -> None:
        metas = [
            SimpleNamespace(name=n, aligned_size=t.numel() * t.element_size())
            for n, t in self.registered[name].items()
        ]
        self._metas = {0: SimpleNamespace(memory_buffer_metas_list=[SimpleNamespace(metas=metas)])}

    def get_metas(self) -> dict[int, Any]:
        return self._metas

    def update(self, name: str, req_func: Any, *, ranks: list[int] | None = None) -> None:
        self.updates.append(
            {
                "name": name,
                "ranks": ranks,
                "env": _env(),
                "seen": self.on_update() if self.on_update is not None else None,
            }
        )
        req_func([("GPU-fake-0", f"ipc://@fake-{len(self.updates)}.sock")])


class IPCClient(SimEngineClient):
    """A simulated engine that accepts ``/update_weights_from_ipc`` and records it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.ipc_calls: list[dict[str, Any]] = []

    def update_weights_from_ipc(self, zmq_handles: Mapping[str, str], **kw: Any) -> str:
        self.ipc_calls.append({"handles": dict(zmq_handles), **kw})
        return "ok"


class Handle:
    """A restartable engine handle without a process (records each restart's arguments); it
    declares every ``RestartableEngine`` member and keeps no warm standby."""

    standby_state = None
    last_start_source = None

    def __init__(self, client: SimEngineClient) -> None:
        self._client = client
        self.calls: list[dict[str, Any]] = []

    def restart(
        self,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        weight_version: str | None = None,
        stop_timeout: float = 10.0,
    ) -> Handle:
        self.calls.append({"model_path": model_path, "skip_load_weights": skip_load_weights})
        self._client.health_error = None
        return self

    def stop(self, *, timeout: float = 10.0, keep_standby: bool = False) -> None:
        pass

    @property
    def client(self) -> SimEngineClient:
        return self._client

    def standby_status(self) -> dict[str, Any]:
        return {"state": "none"}


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-rank gloo default group (the transport's collectives; no CUDA needed)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ce_transport(**kw: Any) -> tuple[CheckpointEngineTransport, list[FakeParameterServer]]:
    """A CheckpointEngineTransport over a FakeParameterServer; ``fake_*`` go to the fake."""
    fake_kw = {k[5:]: kw.pop(k) for k in list(kw) if k.startswith("fake_")}
    made: list[FakeParameterServer] = []

    def factory(**ps_kw: Any) -> FakeParameterServer:
        ps = FakeParameterServer(**fake_kw, **ps_kw)
        made.append(ps)
        return ps

    return CheckpointEngineTransport(server_factory=factory, **kw), made


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(4, 4, generator=g) for i in range(3)}


# ====================================================================== config
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def config(tmp_path: Path, **kw: Any) -> FleetConfig:
    args: dict[str, Any] = {
        "model_path": model_dir(tmp_path),
        "export_root": tmp_path / "exports",
        "transport": "checkpoint_engine",
    }
    args.update(kw)
    if isinstance(args.get("engine"), dict):  # the engine's fields: its spec on this model
        args["engine"] = EngineSpec(model_path=str(args["model_path"]), **args["engine"])
    return FleetConfig(**args)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"bucket_bytes": 1.5}, "bucket_bytes"),
        ({"p2p": "yes"}, "p2p"),
        ({"p2p_protocol": "infiniband"}, "p2p_protocol"),
        ({"rdma_devices": "mlx5_0"}, "rdma_devices"),
        ({"rdma_devices": []}, "rdma_devices"),
        ({"p2p": True, "p2p_protocol": "rdma"}, "rdma_devices"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"socket_timeout_s": -1.0}, "socket_timeout_s"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
        ({"tcp_slice_bytes": 0}, "tcp_slice_bytes"),
        ({"tcp_slice_bytes": 1.5}, "tcp_slice_bytes"),
    ],
)
def test_malformed_checkpoint_engine_settings_name_the_key(
    tmp_path: Path, kw: dict[str, Any], key: str
) -> None:
    with pytest.raises(FleetConfigError) as info:
        RolloutFleet(config(tmp_path, checkpoint_engine=CheckpointEngineSettings(**kw)))
    key = f"checkpoint_engine.{key}"
    assert info.value.key == key and key in str(info.value)


def test_checkpoint_engine_settings_that_are_accepted(tmp_path: Path) -> None:
    for kw in (
        {},
        {"p2p": True, "p2p_protocol": "tcp"},  # TCP needs no device names
        {"p2p": True, "rdma_devices": ["mlx5_0", "mlx5_1"], "bucket_bytes": 1 << 30},
        {"socket_timeout_s": None, "transfer_timeout_s": 120.0},
        {"p2p": True, "p2p_protocol": "tcp", "tcp_slice_bytes": None},  # Mooncake's 64 KiB
        {"p2p": True, "p2p_protocol": "tcp", "tcp_slice_bytes": 4 << 20},
    ):
        ce = CheckpointEngineSettings(**kw)
        RolloutFleet(config(tmp_path, checkpoint_engine=ce)).close()
    # the other transports keep working, and ignore the checkpoint_engine settings
    ce = CheckpointEngineSettings(p2p=True, p2p_protocol="tcp")
    RolloutFleet(config(tmp_path, transport="nccl", checkpoint_engine=ce)).close()


def test_fallback_reasons_name_each_cause() -> None:
    assert fleet_fallback_reasons(kind="sglang", cuda_available=True) == []
    assert fleet_fallback_reasons(device="cuda", cuda_available=True) == []
    (vllm,) = fleet_fallback_reasons(kind="vllm", cuda_available=True)
    assert "vLLM dialect" in vllm and "kind='vllm'" in vllm
    (vllm,) = fleet_fallback_reasons(dialect="vllm", device="cuda", cuda_available=True)
    assert "dialect='vllm'" in vllm
    (cpu,) = fleet_fallback_reasons(kind="sglang", cuda_available=False)
    assert "weights are on CPU" in cpu
    (far,) = fleet_fallback_reasons(device="cpu", cuda_available=True)
    assert "disaggregated" in far


class FakeLauncher(Handle):
    """A launcher for a fleet's factory: a :class:`Handle` that starts at once."""

    def __init__(self, gid: str) -> None:
        super().__init__(SimEngineClient(gid))

    def start(self) -> FakeLauncher:
        return self


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_a_fleet_without_cuda_falls_back_to_nccl_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dialect: str
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the weights could be there")
    cfg = config(
        tmp_path,
        groups=[GroupSpec(1), GroupSpec(1)],
        engine={"dialect": dialect, "device": "cuda", "load_format": "dummy"},
        launcher_factory=lambda gid, spec: FakeLauncher(gid),
        checkpoint_engine=CheckpointEngineSettings(p2p=True, p2p_protocol="tcp"),
    )
    caplog.set_level(logging.WARNING)
    with RolloutFleet(cfg) as fleet:
        assert isinstance(fleet.transport, NCCLTransport)
        assert fleet.transport.name == "nccl"
        assert fleet.recovery is not None and fleet.recovery.transport is fleet.transport
        reason = fleet.transport_fallback
    warnings = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and "checkpoint_engine" in r.getMessage()
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    assert text.startswith("transport 'checkpoint_engine' falls back to 'nccl': ")
    assert "the trainer's weights are on CPU (torch.cuda.is_available() is False)" in text
    assert ("vLLM dialect" in text) == (dialect == "vllm")
    assert reason is not None and reason in text


# ====================================================================== transport: P2P over TCP
def test_tcp_environment_is_scoped_around_the_parameter_server(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in P2P_VARS:
        monkeypatch.delenv(k, raising=False)
    tr, (ps,) = ce_transport(p2p_protocol="tcp", transfer_timeout_s=120.5)
    assert tr.p2p_available and tr.p2p_reason == "" and tr.p2p_protocol == "tcp"
    assert ps.env_at_init == {
        "MC_FORCE_TCP": "1",
        "PS_P2P_STORE_RDMA_DEVICES": TCP_PLACEHOLDER_DEVICE,
        "MC_TRANSFER_TIMEOUT": "121",
        "MC_TCP_SLICE_SIZE": str(16 << 20),  # rollsafe's default over TCP (Mooncake's: 64 KiB)
        "RANK": "0",
    }
    assert not ps.mooncake_hidden
    assert _env() == dict.fromkeys(P2P_VARS)  # restored: nothing leaks into the process
    tr.register(weights(), 1)
    assert ps.env_at_register[-1]["MC_FORCE_TCP"] == "1"
    target = EngineTarget("g0", (0,), IPCClient("g0"))
    report = tr.update([target], p2p=True)
    assert report.ok, report.results
    assert ps.updates[-1]["ranks"] == [0]  # a real ranks=[...] update in a world of one
    assert ps.updates[-1]["env"]["MC_FORCE_TCP"] == "1"
    assert tr.last_plan is not None and tr.last_plan.mode == "p2p"
    assert _env() == dict.fromkeys(P2P_VARS)
    report = tr.update([target])  # every rank and no p2p=True: a broadcast
    assert report.ok and ps.updates[-1]["ranks"] is None
    tr.close()


def test_ambient_placeholder_is_kept_and_rdma_clears_forced_tcp(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PS_P2P_STORE_RDMA_DEVICES", "erdma_0")
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    tr, (ps,) = ce_transport(p2p_protocol="tcp")
    assert ps.env_at_init["PS_P2P_STORE_RDMA_DEVICES"] == "erdma_0"
    tr.close()
    tr, (ps,) = ce_transport(p2p_protocol="rdma", rdma_devices=["mlx5_0"])
    assert ps.env_at_init["MC_FORCE_TCP"] is None  # RDMA asked for: never silently TCP
    assert ps.env_at_init["PS_P2P_STORE_RDMA_DEVICES"] == "mlx5_0"
    assert os.environ["MC_FORCE_TCP"] == "1"  # the ambient value is back
    tr.close()
    assert p2p_environment(None) == {}
    with pytest.raises(ValueError, match="rdma_devices"):
        ce_transport(p2p_protocol="rdma")


def test_tcp_slice_defaults_to_16_mib_and_never_overrides_the_environment(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in P2P_VARS:
        monkeypatch.delenv(k, raising=False)
    assert CheckpointEngineSettings().tcp_slice_bytes == DEFAULT_TCP_SLICE_BYTES == 16 << 20
    tr, (ps,) = ce_transport(p2p_protocol="tcp", tcp_slice_bytes=4 << 20)
    assert ps.env_at_init["MC_TCP_SLICE_SIZE"] == str(4 << 20)
    tr.register(weights(), 1)  # Mooncake reads it at its first transfer: inside the scope
    assert ps.env_at_register[-1]["MC_TCP_SLICE_SIZE"] == str(4 << 20)
    tr.update([EngineTarget("g0", (0,), IPCClient("g0"))], p2p=True)
    assert ps.updates[-1]["env"]["MC_TCP_SLICE_SIZE"] == str(4 << 20)
    assert os.environ.get("MC_TCP_SLICE_SIZE") is None  # scoped: restored after each call
    tr.close()
    tr, (ps,) = ce_transport(p2p_protocol="tcp", tcp_slice_bytes=None)
    assert ps.env_at_init["MC_TCP_SLICE_SIZE"] is None  # None: Mooncake's own default
    tr.close()
    tr, (ps,) = ce_transport(p2p_protocol="rdma", rdma_devices=["mlx5_0"])
    assert ps.env_at_init["MC_TCP_SLICE_SIZE"] is None  # RDMA: no TCP slice
    tr.close()
    tr, (ps,) = ce_transport()  # no P2P: nothing set
    assert ps.env_at_init["MC_TCP_SLICE_SIZE"] is None
    tr.close()
    # a value the user set in the environment wins over the default and over the argument
    monkeypatch.setenv("MC_TCP_SLICE_SIZE", "1048576")
    tr, (ps,) = ce_transport(p2p_protocol="tcp", tcp_slice_bytes=4 << 20)
    assert ps.env_at_init["MC_TCP_SLICE_SIZE"] == "1048576"
    assert "MC_TCP_SLICE_SIZE" not in tr.p2p_env
    tr.close()
    assert os.environ["MC_TCP_SLICE_SIZE"] == "1048576"
    assert "MC_TCP_SLICE_SIZE" not in p2p_environment("tcp", environ={"MC_TCP_SLICE_SIZE": "7"})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument) as info:
            p2p_environment("tcp", tcp_slice_bytes=bad, environ={})  # type: ignore[arg-type]
        assert info.value.key == "tcp_slice_bytes"


def test_without_p2p_a_targeted_push_is_refused_with_the_reason(world_of_one: None) -> None:
    tr, (ps,) = ce_transport()
    assert ps.mooncake_hidden  # not configured: Mooncake is hidden, no device auto-detection
    assert not tr.p2p_available and "not configured" in tr.p2p_reason
    tr.register(weights(), 1)
    fleet_tr = CheckpointEngineFleetTransport(2, transport=tr)
    fleet_tr.register(weights(), 2)
    client = IPCClient("g1")
    with pytest.raises(P2PUnavailable) as info:
        fleet_tr.targeted_update([EngineTarget("g1", (1,), client)])
    assert "not configured" in str(info.value) and "refusing to broadcast" in str(info.value)
    assert ps.updates == [] and client.ipc_calls == []  # nothing moved
    assert fleet_tr.registration.state == "registered" and tr.registration.state == "registered"
    tr.close()


def test_mooncake_that_fails_to_start_leaves_p2p_off_with_its_error(world_of_one: None) -> None:
    tr, made = ce_transport(
        p2p_protocol="tcp", fake_p2p_error=RuntimeError("no rdma devices found")
    )
    assert len(made) == 1 and made[0].mooncake_hidden  # started again, without Mooncake
    assert not tr.p2p_available
    assert "failed to start with Mooncake" in tr.p2p_reason
    assert "no rdma devices found" in tr.p2p_reason
    tr.close()


# ====================================================================== fleet transport
def test_groups_sharing_a_gpu_sync_in_broadcast_waves_and_push_by_p2p(world_of_one: None) -> None:
    tr, (ps,) = ce_transport(p2p_protocol="tcp")
    fleet_tr = CheckpointEngineFleetTransport(2, transport=tr)
    a, b = IPCClient("g0"), IPCClient("g1")
    targets = [EngineTarget("g0", (0,), a), EngineTarget("g1", (1,), b)]
    assert [
        [t.name for t in w]
        for w in split_waves([EngineTarget(t.name, (0,), t.client) for t in targets])
    ] == [["g0"], ["g1"]]
    fleet_tr.register(weights(), 1)
    assert fleet_tr.registration.published == ("checkpoint_engine-v1", 1)
    report = fleet_tr.update(targets)
    assert report.ok and sorted(report.results) == ["g0", "g1"]
    assert [u["ranks"] for u in ps.updates] == [None, None]  # one broadcast per engine
    assert len(a.ipc_calls) == 1 and len(b.ipc_calls) == 1
    assert [(p.mode, p.targets, p.targeted) for p in fleet_tr.pushes] == [
        ("broadcast", ("g0",), False),
        ("broadcast", ("g1",), False),
    ]
    report = fleet_tr.targeted_update([targets[1]])
    assert report.ok
    assert ps.updates[-1]["ranks"] == [0]
    push = fleet_tr.last_push()
    assert push is not None
    assert (push.mode, push.ps_ranks, push.targets, push.fleet_ranks, push.targeted) == (
        "p2p",
        (0,),
        ("g1",),
        ((1,),),
        True,
    )
    assert len(a.ipc_calls) == 1 and len(b.ipc_calls) == 2  # g0 got nothing more
    assert b.ipc_calls[-1]["weight_version"] == "1"
    # the fleet-facing machine names fleet ranks
    assert fleet_tr.registration.history[-2].as_dict()["inputs"]["targets"] == [[1]]
    tr.close()


# ====================================================================== recovery through it
def ce_fleet(
    **fake: Any,
) -> tuple[
    FleetRegistry, dict[str, IPCClient], CheckpointEngineFleetTransport, FakeParameterServer
]:
    reg, _ = make_fleet((1, 1), version=0, bind=False)
    clients = {gid: IPCClient(gid) for gid in ("g0", "g1")}
    for gid, client in clients.items():
        group = reg.get(gid)
        reg.rebind_clients(gid, (client,), (client.url,))
        assert group.client is client
    fake_kw = {f"fake_{k}": v for k, v in fake.items()}
    tr, (ps,) = ce_transport(p2p_protocol="tcp", **fake_kw)
    return reg, clients, CheckpointEngineFleetTransport(2, transport=tr), ps


def fail(reg: FleetRegistry, client: SimEngineClient, gid: str) -> None:
    from rollsafe.adapters.engines import EngineUnavailable

    client.health_error = EngineUnavailable(client.url, "/health", "SIGKILL")
    for r in reg.get(gid).ranks:
        reg.report_member(gid, r, healthy=False)
    reg.send(gid, "fail")


def test_recovery_restarts_on_dummy_weights_then_p2p_pushes_to_that_group_only(
    world_of_one: None,
) -> None:
    reg, clients, fleet_tr, ps = ce_fleet()
    ps.on_update = lambda: {g.group_id: g.state for g in reg.groups()}
    sync = SyncCoordinator(reg, fleet_tr)
    report = sync.sync(weights(1), 1)
    assert report.ok and sorted(report.updated) == ["g0", "g1"]
    report = sync.sync(weights(2), 2)
    assert report.ok and reg.fleet_version == 2
    updates_before = len(ps.updates)
    calls_g0 = len(clients["g0"].ipc_calls)
    assert [u["ranks"] for u in ps.updates] == [None] * 4  # syncs broadcast

    handles = {gid: Handle(c) for gid, c in clients.items()}
    rc = RecoveryCoordinator(
        reg,
        launcher_for=handles.__getitem__,
        transport=fleet_tr,
        settings=RecoverySettings(retry_delay_s=0.0),
    )
    try:
        fail(reg, clients["g1"], "g1")
        result = rc.submit("g1").result(WAIT_S)
    finally:
        rc.close(timeout=5.0)
    assert result.status == "active" and result.strategy == "targeted_push", result.as_dict()
    assert handles["g1"].calls == [{"model_path": None, "skip_load_weights": True}]  # dummy
    assert handles["g0"].calls == []
    (push,) = ps.updates[updates_before:]
    assert push["ranks"] == [0]  # P2P, ranks=[that group's ranks], not a broadcast
    assert push["env"]["MC_FORCE_TCP"] == "1"
    assert push["seen"] == {"g0": "active", "g1": "pending_weights"}  # pushed while pending
    assert clients["g1"].ipc_calls[-1]["weight_version"] == "2"  # the registered version
    assert len(clients["g0"].ipc_calls) == calls_g0  # the other group received nothing
    record = fleet_tr.last_push()
    assert record is not None and record.mode == "p2p" and record.targeted
    assert record.targets == ("g1",) and record.fleet_ranks == ((1,),)
    events = [t.event for t in reg.get("g1").recent_transitions()]
    assert events[-3:] == ["claim", "restarted", "weights_loaded"]
    assert [t.target for t in reg.get("g1").recent_transitions()][-2:] == [
        "pending_weights",
        "active",
    ]
    assert all(m.weights_version == 2 for m in reg.get("g1").machine.members.values())
    assert reg.get("g0").state == "active"
    step = next(s for s in result.steps if s.name == "push")
    assert step.ok and "p2p ranks=[0]" in step.detail and "g1" in step.detail
    begin = [
        r.as_dict()["inputs"]["targets"]
        for r in fleet_tr.registration.history
        if r.event == "begin_update"
    ]
    assert begin[-1] == [[1]]


def test_without_usable_p2p_the_restarted_group_waits_for_the_next_sync(
    world_of_one: None,
) -> None:
    reg, clients, fleet_tr, ps = ce_fleet(p2p=False)  # Mooncake "missing"
    assert not fleet_tr.p2p_available
    sync = SyncCoordinator(reg, fleet_tr)
    assert sync.sync(weights(1), 1).ok
    n = len(ps.updates)
    handles = {gid: Handle(c) for gid, c in clients.items()}
    rc = RecoveryCoordinator(
        reg,
        launcher_for=handles.__getitem__,
        transport=fleet_tr,
        settings=RecoverySettings(retry_delay_s=0.0),
    )
    try:
        fail(reg, clients["g1"], "g1")
        result = rc.submit("g1").result(WAIT_S)
    finally:
        rc.close(timeout=5.0)
    assert result.status == "pending_weights" and result.strategy == "deferred"
    assert "P2PUnavailable" in result.reason and "refusing to broadcast" in result.reason
    assert len(ps.updates) == n  # no silent broadcast
    assert reg.get("g1").state == "pending_weights" and reg.get("g0").state == "active"
    report = sync.sync(weights(2), 2)  # the next sync brings it back (broadcast waves)
    assert report.ok and report.weights_loaded == ["g1"] and reg.get("g1").state == "active"


def test_a_failed_register_publishes_nothing_and_pushes_nothing(world_of_one: None) -> None:
    reg, clients, fleet_tr, ps = ce_fleet()
    sync = SyncCoordinator(reg, fleet_tr)
    assert sync.sync(weights(1), 1).ok
    ps.fail_register = True
    report = sync.sync(weights(2), 2)
    assert not report.ok and "register of v2 failed" in (report.error or "")
    assert reg.fleet_version == 1
    assert fleet_tr.registration.published is None and fleet_tr.inner.registration.published is None
    with pytest.raises(RegisterError):
        fleet_tr.register(weights(3), 3)
    n = len(ps.updates)
    handles = {gid: Handle(c) for gid, c in clients.items()}
    rc = RecoveryCoordinator(
        reg,
        launcher_for=handles.__getitem__,
        transport=fleet_tr,
        settings=RecoverySettings(retry_delay_s=0.0),
    )
    try:
        fail(reg, clients["g1"], "g1")
        result = rc.submit("g1").result(WAIT_S)
    finally:
        rc.close(timeout=5.0)
    assert result.status == "pending_weights" and "no registered checkpoint" in result.reason
    assert len(ps.updates) == n and reg.get("g1").state == "pending_weights"


def test_a_sync_and_a_push_never_overlap(world_of_one: None) -> None:
    """The recovery's push waits for the sync's update (one lock per transport)."""
    reg, clients, fleet_tr, ps = ce_fleet()
    sync = SyncCoordinator(reg, fleet_tr)
    assert sync.sync(weights(1), 1).ok
    inside = threading.Event()
    release = threading.Event()
    active = [0]
    peak = [0]

    def on_update() -> None:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        inside.set()
        release.wait(5.0)
        active[0] -= 1

    ps.on_update = on_update
    handles = {gid: Handle(c) for gid, c in clients.items()}
    rc = RecoveryCoordinator(
        reg,
        launcher_for=handles.__getitem__,
        transport=fleet_tr,
        settings=RecoverySettings(retry_delay_s=0.0),
    )
    try:
        t = threading.Thread(target=lambda: sync.sync(weights(2), 2))
        fail(reg, clients["g1"], "g1")
        t.start()
        assert inside.wait(WAIT_S)
        future = rc.submit("g1")
        time.sleep(0.2)
        release.set()
        t.join(WAIT_S)
        result = future.result(WAIT_S)
    finally:
        release.set()
        rc.close(timeout=5.0)
    assert peak[0] == 1
    assert result.status == "active"
