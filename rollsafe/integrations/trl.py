"""TRL's ``GRPOTrainer`` generating through a :class:`~rollsafe.fleet.RolloutFleet`.

Owns :class:`FleetGeneration`, a drop-in for TRL's ``trl.generation.VLLMGeneration`` (the object
``GRPOTrainer`` calls ``generate`` and ``sync_weights`` on) backed by a fleet, and the two ways
to put it into a trainer: :class:`RollsafeGRPOTrainer` (``GRPOTrainer`` plus ``fleet=``) and
:func:`attach_fleet` (an existing trainer). ``GRPOTrainer``'s own code paths stay unchanged:

* **generate**: TRL gathers the prompts of every process, generates ``num_generations``
  completions per unique prompt on the main process and scatters them back; so does
  :meth:`FleetGeneration.generate`, each completion one :meth:`RolloutFleet.generate` request
  (token ids in, token ids and the sampled tokens' logprobs out), run concurrently. It returns
  TRL's tuple ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)``, shapes as
  ``VLLMGeneration.generate`` (``logprobs[i][t] == [logprob of the sampled token]``).
* **logprobs**: the engines' own (``return_logprob``), never recomputed here; the reference
  engine reports them after temperature/top-k/top-p like vLLM's
  ``--logprobs-mode processed_logprobs``, which TRL's importance-sampling correction expects
  (start a real vLLM with that flag). A completion without them raises
  :class:`LogprobsUnavailable`; a single token the engine sent null for is None, which TRL
  treats as "no correction" for that token.
* **sync**: TRL calls ``sync_weights()`` before the first generation of each optimizer step
  (``_last_loaded_step`` skips the gradient-accumulation and ``steps_per_generation``
  repeats); :meth:`FleetGeneration.sync_weights` pushes a copy of the model's parameters
  (gathered and named the way TRL's own backend does it: DeepSpeed ZeRO-3, FSDP, PEFT merged) with
  ``fleet.sync_weights(..., version=trainer.state.global_step)``. The fleet's current version
  is not pushed again (at step 0 the engines already serve the checkpoint they started from).
  A sync whose registration failed raises :class:`FleetSyncFailed`; a version older than the
  fleet's raises the fleet's ``SyncVersionError``; per-group failures are the fleet's to
  recover (the group leaves routing until it is back at the current version).
* **provenance**: every completion gets a :class:`CompletionProvenance` (group, attempts,
  rollsafe's segments per weights version); :attr:`FleetGeneration.last_provenance` holds this
  process's completions of the last generation in TRL's order, :attr:`FleetGeneration.history`
  one :class:`GenerationRecord` per generation, and the trainer logs
  ``rollsafe/continued`` and ``rollsafe/off_policy_tokens`` with its other metrics.

No vLLM in the trainer's environment: the trainer is built with ``use_vllm=False`` (which
imports nothing of vLLM) and switched to the fleet afterwards (``use_vllm`` set, ``vllm_mode``
``"server"``), which is what :class:`RollsafeGRPOTrainer` does; images (VLMs) are refused with
:class:`UnsupportedByFleet`. Supported TRL: ``>=1.16.0,<1.17`` (private names used here:
``GRPOTrainer._last_loaded_step``, which TRL reads and :func:`attach_fleet` sets, and
``VLLMGeneration._iter_named_params``, checked at attach time).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.grpo_trainer import GRPOTrainer

from rollsafe.errors import RollsafeError
from rollsafe.fleet.provenance import Segment, off_policy, version_number, versions_used

if TYPE_CHECKING:
    import torch

    from rollsafe.fleet import RolloutFleet, RoutedResult, SyncReport

__all__ = [
    "SUPPORTED_TRL",
    "CompletionProvenance",
    "FleetGeneration",
    "FleetSyncFailed",
    "GenerationRecord",
    "LogprobsUnavailable",
    "RollsafeGRPOTrainer",
    "TRLIntegrationError",
    "UnsupportedByFleet",
    "attach_fleet",
]

#: The TRL releases this module is tested with (``pip install 'rollsafe[trl]'``).
SUPPORTED_TRL = ">=1.16.0,<1.17"


class TRLIntegrationError(RollsafeError):
    """Base class of the TRL integration's errors."""


class LogprobsUnavailable(TRLIntegrationError, RuntimeError):
    """An engine returned a completion without the sampled tokens' logprobs, which TRL's loss
    needs (an engine or client that ignores ``return_logprob``)."""


class FleetSyncFailed(TRLIntegrationError, RuntimeError):
    """``fleet.sync_weights`` did not publish the trainer's version (registration or a hook
    failed); ``report`` is the fleet's :class:`~rollsafe.fleet.SyncReport`."""

    def __init__(self, report: SyncReport) -> None:
        self.report = report
        super().__init__(f"weight sync of version {report.version} failed: {report.error}")


class UnsupportedByFleet(TRLIntegrationError, ValueError):
    """A TRL setting the fleet-backed generation cannot honour (images, top-N logprobs, a
    missing fleet on the main process); the message names it."""


@dataclass(frozen=True)
class CompletionProvenance:
    """Where one completion came from: ``trainer_step`` (``state.global_step``) and
    ``fleet_version`` when it was generated, the ``group_id`` that sent its last token,
    ``attempts`` (tries on groups) and rollsafe's ``segments`` (token ranges per group and
    weights version; more than one when a crash or a sync cut the request and it was continued
    from its last token)."""

    trainer_step: int
    fleet_version: int
    group_id: str
    attempts: int
    segments: tuple[Segment, ...]
    num_tokens: int

    @property
    def weights_versions(self) -> tuple[str | None, ...]:
        """The weights versions that produced tokens, in order of first use."""
        return versions_used(self.segments)

    @property
    def off_policy(self) -> int | None:
        """Newest minus oldest version that produced tokens (0: one version)."""
        return off_policy(self.segments)

    @property
    def continued(self) -> bool:
        """More than one try produced the tokens (the first group failed or was paused)."""
        return len({(s.group_id, s.attempt) for s in self.segments}) > 1

    def token_versions(self) -> list[int | None]:
        """The fleet version that produced each token (None: not a fleet version number)."""
        out: list[int | None] = [None] * self.num_tokens
        for seg in self.segments:
            for i in range(seg.start, min(seg.end, self.num_tokens)):
                out[i] = version_number(seg.weights_version)
        return out

    def stale_tokens(self, version: int | None = None) -> int:
        """Tokens produced by weights other than ``version`` (default: ``fleet_version``)."""
        want = self.fleet_version if version is None else version
        return sum(1 for v in self.token_versions() if v != want)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trainer_step": self.trainer_step,
            "fleet_version": self.fleet_version,
            "group": self.group_id,
            "attempts": self.attempts,
            "segments": [s.as_dict() for s in self.segments],
            "num_tokens": self.num_tokens,
        }


@dataclass(frozen=True)
class GenerationRecord:
    """One :meth:`FleetGeneration.generate` call: the trainer's step, the fleet's version, and
    every completion of this process in TRL's order."""

    trainer_step: int
    fleet_version: int
    completions: tuple[CompletionProvenance, ...]

    @property
    def stale_tokens(self) -> int:
        return sum(c.stale_tokens() for c in self.completions)

    @property
    def continued(self) -> int:
        return sum(1 for c in self.completions if c.continued)


class FleetGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` interface (``generate``, ``sync_weights``, ``mode``) served by a
    :class:`RolloutFleet` (see the module). ``fleet`` is needed on the main process only (the
    other processes of an accelerate run take part in the collectives).

    ``version_of()`` returns the version a sync publishes (:func:`attach_fleet` passes the
    trainer's ``state.global_step``). ``max_concurrency`` bounds the requests in flight;
    ``request_timeout`` bounds each (None: the fleet's); ``pause_mode`` is passed to
    ``fleet.sync_weights`` (None: the fleet's own choice, ``FleetConfig.pause_mode``; no
    request is in flight during TRL's sync anyway);
    ``history_size`` bounds :attr:`history`; ``on_generation(record)`` is called on every
    process after each generation, ``on_sync(report)`` on the main process after each sync
    that published its version (check the engines' weights there: ``fleet.checksums()``);
    ``snapshot_weights`` (default True) pushes a copy of the parameters (see
    :meth:`_named_tensors`).
    """

    def __init__(
        self,
        fleet: RolloutFleet | None,
        *,
        model: Any,
        accelerator: Any,
        processing_class: Any,
        version_of: Callable[[], int],
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        max_completion_length: int = 16,
        logprobs: int | None = 0,
        generation_kwargs: Mapping[str, Any] | None = None,
        max_concurrency: int = 32,
        request_timeout: float | None = None,
        pause_mode: Any = None,
        history_size: int = 10_000,
        on_generation: Callable[[GenerationRecord], None] | None = None,
        on_sync: Callable[[SyncReport], None] | None = None,
        snapshot_weights: bool = True,
    ) -> None:
        from accelerate.utils import broadcast_object_list
        from trl.distributed import DistributedBackend

        if logprobs not in (0, None):
            raise UnsupportedByFleet(
                f"logprobs={logprobs}: the fleet returns the sampled token's logprob only "
                "(logprobs=0, what GRPOTrainer asks for)"
            )
        if max_concurrency < 1:
            raise UnsupportedByFleet(f"max_concurrency must be >= 1, got {max_concurrency}")
        if accelerator.is_main_process and fleet is None:
            raise UnsupportedByFleet("the main process needs the fleet (fleet=None given)")
        # the attributes VLLMGeneration's parameter iteration and TRL's trainer read
        self.model = model
        self.accelerator = accelerator
        self._dist = DistributedBackend(accelerator)  # type: ignore[no-untyped-call]
        self.processing_class = processing_class
        self.mode = "server"
        self.structured_outputs_regex = None
        self.enable_sleep_mode = False
        self.repetition_penalty = repetition_penalty
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k if top_k is not None else 0
        self.min_p = min_p if min_p is not None else 0.0
        self.max_completion_length = max_completion_length
        self.logprobs = logprobs
        self.generation_kwargs = dict(generation_kwargs or {})
        self._weight_metadata = None
        self.fleet = fleet
        self.version_of = version_of
        self.max_concurrency = max_concurrency
        self.request_timeout = request_timeout
        self.pause_mode = pause_mode
        self.on_generation = on_generation
        self.on_sync = on_sync
        self.snapshot_weights = snapshot_weights
        #: one record per generation (this process's completions), oldest first
        self.history: deque[GenerationRecord] = deque(maxlen=history_size)
        #: this process's completions of the last generation, in TRL's order
        self.last_provenance: tuple[CompletionProvenance, ...] = ()
        #: the fleet's report of every sync this object ran (main process only)
        self.sync_reports: list[SyncReport] = []
        # the version the engines serve, known on every process (the skip below must be the
        # same decision everywhere: gathering ZeRO-3 parameters is a collective)
        box = [fleet.registry.fleet_version if fleet is not None else None]
        broadcast_object_list(box, from_process=0)
        self.fleet_version: int = int(box[0])  # type: ignore[arg-type]

    # ------------------------------------------------------------------ sampling
    def sampling_params(self) -> dict[str, Any]:
        """The per-request sampling parameters (rollsafe/SGLang names; the vLLM client
        translates them) for TRL's generation settings."""
        params: dict[str, Any] = {
            "max_new_tokens": int(self.max_completion_length),
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k) if self.top_k else -1,
            "return_logprob": True,
        }
        if self.min_p:
            params["min_p"] = float(self.min_p)
        if self.repetition_penalty != 1.0:
            params["repetition_penalty"] = float(self.repetition_penalty)
        params.update(self.generation_kwargs)
        return params

    # ------------------------------------------------------------------ TRL's interface
    def sync_weights(self) -> None:
        """Push the model's weights as version ``version_of()`` (see the module)."""
        version = int(self.version_of())
        if version == self.fleet_version:
            return  # the engines serve this version already (the start checkpoint at step 0)
        named = self._named_tensors()
        if not self.accelerator.is_main_process:
            for _ in named:  # take part in the gather collectives
                pass
            self.fleet_version = version
            return
        assert self.fleet is not None
        report = self.fleet.sync_weights(named, version=version, pause_mode=self.pause_mode)
        self.sync_reports.append(report)
        if not report.ok:
            raise FleetSyncFailed(report)
        self.fleet_version = version
        if self.on_sync is not None:
            self.on_sync(report)

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters under the names vLLM expects, as TRL's backend walks them
        (ZeRO-3/FSDP gathered, PEFT adapters merged).

        Each tensor is copied unless ``snapshot_weights=False``: ``ipc`` and ``nccl`` read the
        registered tensors again when a recovered group gets a targeted push, and their guard
        against in-place changes reads the version counter, which fused optimizers
        (``torch.optim.AdamW(fused=True)``, the Trainer's ``adamw_torch_fused`` default) do not
        bump: without the copy such a push would send newer weights under this version.
        ``snapshot_weights=False`` (no copy) is for plain models with an optimizer that bumps
        version counters; sharded and PEFT models are always copied (the walk's tensors are
        only valid while it holds them)."""
        from accelerate.utils import is_peft_model

        sharded = self._dist.is_zero3 or self._dist.is_fsdp or is_peft_model(self.model)
        if sharded or self.snapshot_weights:
            for name, tensor in self._iter_named_params():  # type: ignore[no-untyped-call]
                yield name, tensor.detach().clone()
            return
        for name, param in self.model.named_parameters():
            yield self._fix_param_name_to_vllm(name), param.detach()  # shares _version

    def generate(
        self,
        prompts: list[list[int]],
        images: list[list[Any] | None] | None,
        num_generations: int,
        profiler: Any = None,
    ) -> tuple[Any, Any, Any, Any]:
        """``VLLMGeneration.generate`` in server mode, through the fleet (see the module)."""
        from accelerate.utils import broadcast_object_list, gather_object

        if images is not None and any(img is not None for img in images):
            raise UnsupportedByFleet("images: the fleet generates from token ids only")
        profiler = profiler or nullcontext()
        all_prompts = gather_object(prompts)
        step = int(self.version_of())
        payload: Any = None
        if self.accelerator.is_main_process:
            unique = all_prompts[::num_generations]
            with profiler:
                routed = self._generate_all(unique, num_generations)
            payload = self._payload(unique, num_generations, routed, step)
        box = [payload]
        broadcast_object_list(box, from_process=0)
        all_prompt_ids, all_completion_ids, all_logprobs, all_token_ids, all_prov, version = box[0]
        all_prompt_ids = [ids for ids in all_prompt_ids for _ in range(num_generations)]
        part = slice(
            self.accelerator.process_index * len(prompts),
            (self.accelerator.process_index + 1) * len(prompts),
        )
        record = GenerationRecord(step, version, tuple(all_prov[part]))
        self.last_provenance = record.completions
        self.history.append(record)
        if self.on_generation is not None:
            self.on_generation(record)
        return (
            all_prompt_ids[part],
            all_completion_ids[part],
            all_logprobs[part],
            all_token_ids[part],
        )

    # ------------------------------------------------------------------ main process
    def _generate_all(self, unique: Sequence[list[int]], n: int) -> list[RoutedResult]:
        """``n`` fleet requests per prompt, at most ``max_concurrency`` at once, in order."""
        assert self.fleet is not None
        fleet = self.fleet
        base = self.sampling_params()
        jobs: list[tuple[list[int], dict[str, Any]]] = []
        for prompt in unique:
            for _ in range(n):
                params = dict(base)
                # rollsafe's seed key (the vLLM client sends it as ``seed``); request i gets
                # seed + i: n samples, not n copies of one
                seed = params.pop("seed", params.get("sampling_seed"))
                if isinstance(seed, int) and not isinstance(seed, bool):
                    params["sampling_seed"] = seed + len(jobs)
                jobs.append(([int(t) for t in prompt], params))
        workers = min(self.max_concurrency, max(1, len(jobs)))
        with concurrent.futures.ThreadPoolExecutor(workers, "rollsafe-trl") as pool:
            futures = [
                pool.submit(fleet.generate, ids, sampling_params=sp, timeout=self.request_timeout)
                for ids, sp in jobs
            ]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for fut in futures:
                exc = fut.exception() if fut.done() else None
                if exc is not None:  # raised as the fleet raised it; queued requests dropped
                    for other in futures:
                        other.cancel()
                    raise exc
            return [fut.result() for fut in futures]

    def _payload(
        self, unique: Sequence[list[int]], n: int, routed: Sequence[RoutedResult], step: int
    ) -> tuple[Any, ...]:
        completion_ids: list[list[int]] = []
        logprobs: list[list[list[float | None]]] = []
        token_ids: list[list[list[int]]] = []
        provenance: list[CompletionProvenance] = []
        version = self.fleet_version
        for result in routed:
            ids = list(result.output_ids)
            lps = result.output_logprobs
            if lps is None or len(lps) != len(ids):
                raise LogprobsUnavailable(
                    f"group {result.group_id!r} returned {len(ids)} token(s) and "
                    f"{'no' if lps is None else len(lps)} logprob(s); TRL's loss needs the "
                    "sampled tokens' logprobs (an engine that honours return_logprob)"
                )
            completion_ids.append(ids)
            logprobs.append([[lp] for lp in lps])
            token_ids.append([[t] for t in ids])
            segments = result.segments or (
                Segment(result.group_id, result.weight_version, (0, len(ids)), result.attempts),
            )
            provenance.append(
                CompletionProvenance(
                    step, version, result.group_id, result.attempts, tuple(segments), len(ids)
                )
            )
        prompt_ids = [list(p) for p in unique]
        return prompt_ids, completion_ids, logprobs, token_ids, provenance, version


def _check_trainer(trainer: Any) -> None:
    if not isinstance(trainer, GRPOTrainer):
        raise UnsupportedByFleet(f"attach_fleet needs a trl GRPOTrainer, got {type(trainer)!r}")
    for name in ("_metrics", "state", "accelerator", "processing_class"):
        if not hasattr(trainer, name):
            raise UnsupportedByFleet(
                f"this TRL release has no GRPOTrainer.{name}; supported: trl{SUPPORTED_TRL}"
            )
    if not hasattr(VLLMGeneration, "_iter_named_params"):
        raise UnsupportedByFleet(
            f"this TRL release has no VLLMGeneration._iter_named_params; supported: "
            f"trl{SUPPORTED_TRL}"
        )


def attach_fleet(trainer: Any, fleet: RolloutFleet | None, **options: Any) -> FleetGeneration:
    """Make ``trainer`` (a ``GRPOTrainer`` built with ``use_vllm=False``) generate through
    ``fleet`` and sync its weights into it; return the :class:`FleetGeneration` (also
    ``trainer.vllm_generation``). ``options`` go to :class:`FleetGeneration`. Call it on every
    process of an accelerate run (``fleet`` only on the main one) before ``train()``."""
    _check_trainer(trainer)
    if getattr(trainer, "vllm_generation", None) is not None and not isinstance(
        trainer.vllm_generation, FleetGeneration
    ):
        raise UnsupportedByFleet(
            "the trainer already has a vLLM backend (use_vllm=True); build it with "
            "use_vllm=False, or use RollsafeGRPOTrainer"
        )
    if (
        trainer.loss_type == "vespo"
        and trainer.vllm_importance_sampling_correction
        and trainer.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
    ):  # GRPOTrainer's own check, which it skips under use_vllm=False
        raise UnsupportedByFleet(
            "VESPO loss requires vllm_importance_sampling_mode 'token_truncate' or "
            f"'token_mask', got {trainer.vllm_importance_sampling_mode!r}"
        )

    def metrics(record: GenerationRecord) -> None:
        mode = "train" if trainer.model.training else "eval"
        bucket = trainer._metrics[mode]
        bucket["rollsafe/continued"].append(float(record.continued))
        bucket["rollsafe/off_policy_tokens"].append(float(record.stale_tokens))
        user = options_hook
        if user is not None:
            user(record)

    options_hook = options.pop("on_generation", None)
    generation = FleetGeneration(
        fleet,
        model=trainer.model,
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        version_of=lambda: int(trainer.state.global_step),
        repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k,
        min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length,
        logprobs=0,
        generation_kwargs=trainer.args.generation_kwargs,
        on_generation=metrics,
        **options,
    )
    trainer.vllm_generation = generation
    trainer.use_vllm = True
    trainer.vllm_mode = "server"
    trainer._last_loaded_step = -1  # TRL: sync before the first generation of every step
    return generation


class RollsafeGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that generates through ``fleet`` (keyword; the other arguments are
    ``GRPOTrainer``'s). ``args.use_vllm`` may be True or False: the base trainer is built
    without vLLM either way, then :func:`attach_fleet` installs the fleet;
    ``fleet_options`` go to :class:`FleetGeneration`."""

    def __init__(
        self,
        *args: Any,
        fleet: RolloutFleet | None,
        fleet_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        config = kwargs.get("args")
        if config is None and len(args) > 2:
            config = args[2]
        wanted = bool(getattr(config, "use_vllm", False))
        if config is not None:
            config.use_vllm = False  # GRPOTrainer would build vLLM itself
        try:
            super().__init__(*args, **kwargs)
        finally:
            if config is not None:
                config.use_vllm = wanted
        self.fleet = fleet
        self.fleet_generation = attach_fleet(self, fleet, **dict(fleet_options or {}))
