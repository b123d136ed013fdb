"""The ``nccl`` transport (gloo on CPU) against vLLM-dialect reference engines, end to end.

The engines imitate vLLM 0.32.0 (the reference engine's default). vLLM's weight transfer has
one group per engine and no group names: ``init_info`` carries none. rollsafe's rendezvous
prefixes its store keys with a group name, so the reference engine's ranks join under the fixed
``VLLM_WEIGHT_TRANSFER_GROUP`` and the trainer must too; the transport once joined under a
per-target name of its own and the first update waited out the rendezvous timeout (both sides
waiting under different names).

Engines for the module: a 1-rank and a 2-rank vLLM-dialect engine (model A) and a 1-rank
SGLang one; the trainer holds model B. Checks: every engine's checksum equals the trainer's
(``rollsafe.checksum`` with the engine's algorithm) and greedy output the trainer's; the
version is set by ``/finish_weight_update``; the HTTP lifecycle is vLLM's (init once per kept
group, start -> update x N -> finish -> reset_prefix_cache per version); a group the engine
lost is formed again, and unkept groups are shut down after each update; SGLang and vLLM
targets form their groups in one update; a ``RolloutFleet`` of vLLM-dialect groups syncs twice
over ``nccl``. The recorded requests go over real sockets; the
recorder only notes them.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import (
    EngineProcess,
    assert_vllm_digests,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
    wait_for,
)
from transport_helpers import PROMPT, Trainer, assert_serves, target, transport_threads

from rollsafe.adapters.engines import EngineNotSupported, EngineSpec, VLLMClient
from rollsafe.engine_layout import vllm_cpu_emptied
from rollsafe.fleet import FleetConfig, GroupSpec, NcclSettings, RolloutFleet
from rollsafe.ports import EngineTarget
from rollsafe.transports import NCCLTransport
from rollsafe.wire.group_names import VLLM_WEIGHT_TRANSFER_GROUP

SMALL_BUCKET = 96 << 10
TIMEOUT = 60.0
GREEDY_TOKENS = 8


class Recording(httpx.BaseTransport):
    """A real HTTP transport that notes each request's path and JSON body."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self._lock = threading.Lock()
        self.requests: list[tuple[str, Any]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        if request.url.path != "/version":  # the client's dialect, asked once: not a call
            with self._lock:
                self.requests.append((request.url.path, body))
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()

    def paths(self) -> list[str]:
        with self._lock:
            return [p for p, _ in self.requests]

    def take(self) -> list[tuple[str, Any]]:
        with self._lock:
            out, self.requests = self.requests, []
        return out


@pytest.fixture(scope="module")
def one(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=1, extra_args=["--dialect", "vllm"])


@pytest.fixture(scope="module")
def two(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2, extra_args=["--dialect", "vllm"])


@pytest.fixture(scope="module")
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


def vllm_target(
    name: str, eng: EngineProcess, ranks: tuple[int, ...]
) -> tuple[EngineTarget, Recording]:
    """A target whose client records its requests (and the recorder)."""
    rec = Recording()
    client = VLLMClient(eng.url, transport=rec)
    return EngineTarget(name, ranks, client, tp_size=len(ranks)), rec


def assert_serves_vllm(eng: EngineProcess, trainer: Trainer, version: int) -> None:
    """The engine holds exactly the trainer's weights at ``version`` and decodes like it."""
    got = eng.checksum()
    assert_vllm_digests(got, trainer.weights())  # the linear weights: the greedy check below
    assert got["weight_version"] == str(version)
    # vLLM 0.32.0 (the engines here) reports the version only on GET /weight_info
    assert eng.get("/weight_info").json() == {"weight_version": str(version)}
    body = {
        "prompt": PROMPT,
        "max_tokens": GREEDY_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = eng.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == trainer.greedy(PROMPT, GREEDY_TOKENS)


def assert_one_version(calls: list[tuple[str, Any]], version: int, buckets: int) -> None:
    """vLLM's lifecycle for one version: start -> update x buckets -> finish(version) -> reset;
    the version travels only on finish, nothing else sets it."""
    assert [p for p, _ in calls] == [
        "/start_weight_update",
        *["/update_weights"] * buckets,
        "/finish_weight_update",
        "/reset_prefix_cache",
    ]
    assert calls[-2][1] == {"weight_version": str(version)}
    assert all(
        set(b["update_info"]) == {"names", "dtype_names", "shapes"}
        for p, b in calls
        if p == "/update_weights"
    )


def test_push_to_one_and_two_rank_vllm_engines_twice(
    one: EngineProcess, two: EngineProcess, trainer: Trainer
) -> None:
    trainer.perturb(seed=21)
    tr = NCCLTransport(3, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT)
    assert tr.resolved_backend() == "gloo"
    (t1, r1), (t2, r2) = vllm_target("one", one, (0,)), vllm_target("two", two, (1, 2))
    targets, recs = [t1, t2], [r1, r2]
    tr.register(trainer.weights(), 1)
    buckets = len(tr.plans)
    assert buckets > 1
    report = tr.update(targets)
    assert report.ok, report.results
    for t, rec, eng in zip(targets, recs, (one, two), strict=True):
        assert_serves_vllm(eng, trainer, 1)
        calls = rec.take()
        path, body = calls[0]
        assert path == "/init_weight_transfer_engine"
        info = body["init_info"]
        assert info["rank_offset"] == 1 and info["world_size"] == 1 + t.tp_size
        assert info["packed"] is True and info["packed_buffer_size_bytes"] == SMALL_BUCKET
        assert_one_version(calls[1:], 1, buckets)
    # both groups kept, each under vLLM's fixed name (their own store ports keep them apart)
    assert tr.kept_groups == {"one": VLLM_WEIGHT_TRANSFER_GROUP, "two": VLLM_WEIGHT_TRANSFER_GROUP}

    # the next version reuses the kept groups: no new init, start -> ... -> finish(2)
    trainer.perturb(seed=22)
    tr.register(trainer.weights(), 2)
    report = tr.update(targets)
    assert report.ok, report.results
    for rec, eng in zip(recs, (one, two), strict=True):
        assert_serves_vllm(eng, trainer, 2)
        assert_one_version(rec.take(), 2, buckets)

    tr.close_groups(targets)
    for rec in recs:
        assert rec.paths() == ["/shutdown_weight_transfer_engine"]
    assert tr.kept_groups == {}
    assert wait_for(lambda: transport_threads() == [], 10)


def test_a_lost_vllm_group_is_re_formed_and_unkept_groups_are_shut_down(
    one: EngineProcess, trainer: Trainer
) -> None:
    t, rec = vllm_target("one", one, (0,))
    tr = NCCLTransport(1, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT)
    trainer.perturb(seed=40)
    tr.register(trainer.weights(), 40)
    assert tr.update([t]).ok
    buckets = len(tr.plans)
    # the engine lost its group (as after a restart on the same address): vLLM opens the
    # update without a group (/start_weight_update moves every layer to the meta device) and
    # the kept group's first /update_weights fails inside it (500): the engine is poisoned.
    # The group is formed again once, and the complete update on it restores every layer
    assert one.post("/shutdown_weight_transfer_engine").status_code == 200
    rec.take()
    trainer.perturb(seed=41)
    tr.register(trainer.weights(), 41)
    report = tr.update([t])
    assert report.ok, report.results
    assert one.get("/get_server_info").json()["poisoned"] is None
    assert_serves_vllm(one, trainer, 41)  # generates: a poisoned engine would die here
    calls = rec.take()
    paths = [p for p, _ in calls]
    assert paths.count("/init_weight_transfer_engine") == 1
    first = paths.index("/init_weight_transfer_engine")
    assert paths[:first].count("/update_weights") == 1
    assert_one_version(calls[first + 1 :], 41, buckets)
    assert tr.kept_groups == {"one": VLLM_WEIGHT_TRANSFER_GROUP}
    tr.close_groups([t])
    rec.take()

    # keep_groups=False: every update forms the group and shuts it down afterwards
    tr = NCCLTransport(1, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT, keep_groups=False)
    trainer.perturb(seed=42)
    tr.register(trainer.weights(), 42)
    assert tr.update([t]).ok
    assert_serves_vllm(one, trainer, 42)
    calls = rec.take()
    assert calls[0][0] == "/init_weight_transfer_engine"
    assert calls[-1][0] == "/shutdown_weight_transfer_engine"
    assert_one_version(calls[1:-1], 42, buckets)
    assert tr.kept_groups == {}
    assert wait_for(lambda: transport_threads() == [], 30)


def test_vllm_and_sglang_targets_meet_their_engines_in_one_update(
    one: EngineProcess,
    trainer: Trainer,
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """The root cause pinned: each dialect's group is joined under the name its engine joins
    (SGLang: the name sent in the request, fresh per group; vLLM: the fixed one), so both form
    at once in one update instead of one side waiting out the rendezvous timeout."""
    sglang = module_engine(request, tiny_model_dir, ranks=1)
    trainer.perturb(seed=23)
    tr = NCCLTransport(2, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT)
    tr.register(trainer.weights(), 3)
    targets = [vllm_target("v", one, (0,))[0], target("s", sglang, (1,))]
    report = tr.update(targets)
    assert report.ok, report.results
    assert_serves_vllm(one, trainer, 3)
    assert_serves(sglang, trainer, 3)
    kept = tr.kept_groups
    assert kept["v"] == VLLM_WEIGHT_TRANSFER_GROUP
    assert kept["s"].startswith("rollsafe-") and kept["s"] != VLLM_WEIGHT_TRANSFER_GROUP
    tr.close_groups(targets)

    # a name the vLLM engine cannot join under is refused by the client, nothing sent
    client = VLLMClient(one.url, transport=(rec := Recording()))
    with pytest.raises(EngineNotSupported, match=VLLM_WEIGHT_TRANSFER_GROUP):
        client.init_weights_update_group("127.0.0.1", 1, 1, 2, group_name="rollsafe-x")
    assert rec.paths() == []
    client.close()


def test_vllm_fleet_syncs_twice_over_nccl(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    trainer = Trainer(tiny_model_dir_b)
    config = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1), GroupSpec(2)],
        engine=EngineSpec(model_path=str(tiny_model_dir), **{"dialect": "vllm"}),
        transport=NcclSettings(bucket_bytes=SMALL_BUCKET, group_timeout_s=TIMEOUT),
    )
    with RolloutFleet(config) as fleet:
        tr = fleet.transport
        assert isinstance(tr, NCCLTransport)
        for version in (1, 2):
            trainer.perturb(seed=30 + version)
            weights = trainer.weights()
            report = fleet.sync_weights(weights, version)
            assert report.ok, report
            for group in fleet.registry.groups():
                assert group.client is not None and group.client.dialect == "vllm"
                assert group.client.weight_version() == str(version)
            checks = fleet.check_weights(weights)
            for gid, check in checks.items():
                # CPU: the linear weights carry no data; everything else equal, nothing differs
                assert check is not None and check.verdict == "unverified", (gid, check)
                assert not check.names("differs") and not check.names("missing"), check
                assert all(vllm_cpu_emptied(n.split(":")[-1]) for n in check.names("no_data"))
                assert check.names("equal") and check.names("no_data")
            sums = fleet.checksums()
            assert set(sums) == {"g0", "g1"} and None not in sums.values()
            assert set(tr.kept_groups.values()) == {VLLM_WEIGHT_TRANSFER_GROUP}
            out = fleet.generate(PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0})
            assert out.result.weight_version == str(version)
            assert out.result.output_ids == trainer.greedy(PROMPT, 4)


def test_vllm_0_26_fleet_syncs_over_nccl_with_client_labels_and_the_probe(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """A fleet whose engines imitate vLLM 0.26.0 (the release the GPU image's torch runs):
    packing travels in each ``update_info``, the version is each client's label (0.26 has
    none), ``checksums`` has no checker to ask (None), and the behavioural probe against a
    fresh engine on the trainer's weights is what says the weights are right."""
    from rollsafe.adapters.engines import NoWeightChecker
    from rollsafe.probe import probe_engines, record_answers

    trainer = Trainer(tiny_model_dir_b)
    config = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1), GroupSpec(2)],
        engine=EngineSpec(
            model_path=str(tiny_model_dir), dialect="vllm", extra_args=["--vllm-version", "0.26.0"]
        ),
        transport=NcclSettings(bucket_bytes=SMALL_BUCKET, group_timeout_s=TIMEOUT),
    )
    fresh = module_engine(
        request, tiny_model_dir_b, extra_args=["--dialect", "vllm", "--vllm-version", "0.26.0"]
    )
    with RolloutFleet(config) as fleet, VLLMClient(fresh.url) as fresh_client:
        reference = record_answers(fresh_client)  # model B as loaded: the trainer's weights
        weights = trainer.weights()
        report = fleet.sync_weights(weights, 1)
        assert report.ok, report
        clients = {g.group_id: g.client for g in fleet.registry.groups()}
        for client in clients.values():
            assert isinstance(client, VLLMClient)
            assert client.server_dialect().version == "0.26.0"
            assert client.weight_version() == "1"  # the client's label
            with pytest.raises(NoWeightChecker):
                client.weights_checksum()
        assert set(fleet.checksums().values()) == {None}  # no checker answers
        verdicts = probe_engines(clients, reference)  # type: ignore[arg-type]
        assert all(v.ok for v in verdicts.values()), {g: v.summary() for g, v in verdicts.items()}
        out = fleet.generate(PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out.result.weight_version == "1"
        assert out.result.meta_info["weight_version_source"] == "client"
        assert out.result.output_ids == trainer.greedy(PROMPT, 4)
        trainer.perturb(seed=61)
        assert fleet.sync_weights(trainer.weights(), 2).ok
        out = fleet.generate(PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out.result.weight_version == "2"
        assert out.result.output_ids == trainer.greedy(PROMPT, 4)
        # the old fresh engine (version 1's weights) now disagrees: the probe sees it
        verdicts = probe_engines(clients, reference)  # type: ignore[arg-type]
        assert not any(v.ok for v in verdicts.values())
