"""The behavioural weights probe: greedy tokens (and logprobs) of fixed prompts, compared.

Digests cannot settle every case (vLLM on CPU reports no data for its linear weights,
:mod:`rollsafe.digest_check`), so after a sync the fleet can also ask what the weights *do*:
the greedy continuation of a few fixed prompts, with the logprob of every chosen token where the
engine reports it (vLLM's ``logprobs``, SGLang's ``output_token_logprobs``). On the tiny model a
synced engine and a fresh engine on the same weights agree bit for bit (observed on real vLLM
0.32 on CPU), so the comparison is exact; pass ``logprob_tolerance`` for engines or models where
kernels are not deterministic.

Usage (the fleet, after a sync to version ``v``)::

    reference = record_answers(fresh_client)          # a fresh engine on v's weights, once
    verdicts = probe_engines({gid: client, ...}, reference)
    bad = {gid: v.summary() for gid, v in verdicts.items() if not v.ok}

:func:`record_answers` asks one engine; :func:`compare_answers` compares two recordings;
:func:`probe_engines` does both for many engines and never raises for an engine that fails
(its verdict carries the error). Engines are anything with the
:class:`~rollsafe.ports.EngineClient` ``generate`` and ``dialect``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollsafe.errors import InvalidArgument, RollsafeError
from rollsafe.ports import GenerateResult

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PROMPTS",
    "ProbeAnswer",
    "ProbeAnswers",
    "ProbeEngine",
    "ProbeMismatch",
    "ProbeVerdict",
    "compare_answers",
    "probe_engines",
    "probe_sampling",
    "record_answers",
]

#: Token-id prompts (valid in any vocabulary of 64 ids or more).
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4),
    (7, 11, 13, 17, 19, 23),
    (42,),
    (60, 5, 33, 8, 21, 2, 9, 50),
)
DEFAULT_MAX_NEW_TOKENS = 8


class ProbeEngine(Protocol):
    """What the probe needs from an engine client (``EngineClient`` has it)."""

    @property
    def url(self) -> str: ...

    @property
    def dialect(self) -> str: ...

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult: ...


@dataclass(frozen=True)
class ProbeAnswer:
    """One prompt's greedy continuation and the logprob of each chosen token (None: the
    engine reported none)."""

    prompt: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None


@dataclass(frozen=True)
class ProbeAnswers:
    """An engine's answers to the probe prompts, in prompt order."""

    answers: tuple[ProbeAnswer, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class ProbeMismatch:
    """Where one prompt's answer differs: the prompt, the first differing token position
    (None: the lengths differ only), both token ids there, and the logprobs there."""

    prompt_index: int
    prompt: tuple[int, ...]
    position: int | None
    reason: str
    want_token: int | None = None
    got_token: int | None = None
    want_logprob: float | None = None
    got_logprob: float | None = None

    def __str__(self) -> str:
        return f"prompt {self.prompt_index} {list(self.prompt)}: {self.reason}"


@dataclass(frozen=True)
class ProbeVerdict:
    """One engine's probe result: ``ok`` when every prompt's tokens (and logprobs, where both
    sides have them: ``logprobs_compared``) equal the reference's; ``error`` when it did not
    answer (then ``ok`` is False)."""

    engine: str
    mismatches: tuple[ProbeMismatch, ...] = ()
    logprobs_compared: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.mismatches

    def summary(self) -> str:
        if self.error is not None:
            return f"{self.engine}: no answer ({self.error})"
        if not self.mismatches:
            what = "tokens and logprobs" if self.logprobs_compared else "tokens"
            return f"{self.engine}: {what} equal"
        return f"{self.engine}: " + "; ".join(str(m) for m in self.mismatches)


def probe_sampling(dialect: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> dict[str, Any]:
    """Greedy, fixed-length sampling parameters; vLLM also returns each token's logprob."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidArgument(
            "max_new_tokens", f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}"
        )
    params: dict[str, Any] = {
        "temperature": 0.0,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": True,
    }
    if dialect == "vllm":
        params["logprobs"] = 0  # the chosen token's logprob only
    return params


def _logprobs(result: GenerateResult) -> tuple[float, ...] | None:
    meta = result.meta_info
    lp = meta.get("logprobs")
    if isinstance(lp, Mapping) and isinstance(lp.get("token_logprobs"), list):
        return tuple(float(x) for x in lp["token_logprobs"])
    sg = meta.get("output_token_logprobs")
    if isinstance(sg, list) and all(isinstance(x, list | tuple) and x for x in sg):
        return tuple(float(x[0]) for x in sg)
    return None


def record_answers(
    engine: ProbeEngine,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    timeout: float | None = None,
) -> ProbeAnswers:
    """Ask ``engine`` for the greedy continuation of each prompt (one request at a time).

    Raises whatever the client raises (an ``EngineError``); ``ValueError`` for no prompts or an
    empty one.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidArgument(
            "prompts", "record_answers: prompts must hold at least one prompt and no empty one"
        )
    sampling = probe_sampling(engine.dialect, max_new_tokens)
    out = []
    for prompt in prompts:
        ids = tuple(int(t) for t in prompt)
        result = engine.generate(list(ids), sampling_params=sampling, timeout=timeout)
        out.append(ProbeAnswer(ids, tuple(result.output_ids), _logprobs(result)))
    return ProbeAnswers(tuple(out), max_new_tokens)


def _same_logprob(a: float, b: float, tolerance: float) -> bool:
    if tolerance == 0.0:
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= tolerance


def compare_answers(
    reference: ProbeAnswers,
    got: ProbeAnswers,
    *,
    engine: str = "",
    logprob_tolerance: float = 0.0,
) -> ProbeVerdict:
    """Compare an engine's answers with the reference's, prompt by prompt: tokens exactly,
    logprobs within ``logprob_tolerance`` (0: bit-exact) where both sides report them."""
    if [a.prompt for a in reference.answers] != [a.prompt for a in got.answers]:
        raise InvalidArgument(
            "prompts", "compare_answers: the two recordings are of different prompts"
        )
    mismatches: list[ProbeMismatch] = []
    compared = True
    for i, (want, have) in enumerate(zip(reference.answers, got.answers, strict=True)):
        for pos, (w, g) in enumerate(zip(want.output_ids, have.output_ids, strict=False)):
            if w != g:
                mismatches.append(
                    ProbeMismatch(
                        i,
                        want.prompt,
                        pos,
                        f"token {pos}: {g}, reference {w}",
                        w,
                        g,
                        _at(want.logprobs, pos),
                        _at(have.logprobs, pos),
                    )
                )
                break
        else:
            if len(want.output_ids) != len(have.output_ids):
                mismatches.append(
                    ProbeMismatch(
                        i,
                        want.prompt,
                        None,
                        f"{len(have.output_ids)} tokens, reference {len(want.output_ids)}",
                    )
                )
                continue
            if want.logprobs is None or have.logprobs is None:
                compared = False
                continue
            for pos, (w_lp, g_lp) in enumerate(zip(want.logprobs, have.logprobs, strict=False)):
                if not _same_logprob(w_lp, g_lp, logprob_tolerance):
                    tok = want.output_ids[pos] if pos < len(want.output_ids) else None
                    mismatches.append(
                        ProbeMismatch(
                            i,
                            want.prompt,
                            pos,
                            f"logprob of token {pos} ({tok}): {g_lp!r}, reference {w_lp!r}",
                            tok,
                            tok,
                            w_lp,
                            g_lp,
                        )
                    )
                    break
    return ProbeVerdict(engine, tuple(mismatches), logprobs_compared=compared)


def _at(values: tuple[float, ...] | None, pos: int) -> float | None:
    return values[pos] if values is not None and pos < len(values) else None


def probe_engines(
    engines: Mapping[str, ProbeEngine],
    reference: ProbeAnswers,
    *,
    timeout: float | None = None,
    logprob_tolerance: float = 0.0,
) -> dict[str, ProbeVerdict]:
    """Probe every engine (one after the other) against ``reference``; one verdict each, by the
    ``engines`` key. An engine that fails to answer gets a verdict with ``error`` set."""
    prompts = [a.prompt for a in reference.answers]
    out: dict[str, ProbeVerdict] = {}
    for name, engine in engines.items():
        try:
            got = record_answers(
                engine, prompts, max_new_tokens=reference.max_new_tokens, timeout=timeout
            )
        except (RollsafeError, OSError) as exc:
            out[name] = ProbeVerdict(name, error=f"{type(exc).__name__}: {exc}")
            continue
        out[name] = compare_answers(
            reference, got, engine=name, logprob_tolerance=logprob_tolerance
        )
    return out
