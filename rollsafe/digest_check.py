"""Comparing an engine's reported digests with the expected ones, tensor by tensor.

An engine's weight checker can report a digest that carries no data: vLLM on CPU empties its
linear weights after prepacking and reports the SHA-256 of empty bytes for them; a checker can
also leave a tensor out. A check that only compares what both sides list, or the model
digests, would then say "equal" without having compared the weights. This module never does:

| per-tensor verdict | meaning |
|---|---|
| ``equal`` | both digests present, equal, and carrying data |
| ``differs`` | both present and different: the engine holds other weights |
| ``no_data`` | the engine reported an empty-bytes digest (:data:`EMPTY_DIGESTS`): no data |
| ``missing`` | expected, the engine did not report it |
| ``unexpected`` | the engine reported it, nothing was expected (a layout mismatch) |

The overall :attr:`DigestCheck.verdict`: ``"differs"`` if any tensor differs, else ``"equal"``
only when every tensor is ``equal`` (and there is at least one), else ``"unverified"``.
Torch-free: it compares hex strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "EMPTY_DIGESTS",
    "CheckVerdict",
    "DigestCheck",
    "TensorCheck",
    "TensorVerdict",
    "compare_digests",
    "compare_ranks",
]

TensorVerdict = Literal["equal", "differs", "no_data", "missing", "unexpected"]
CheckVerdict = Literal["equal", "differs", "unverified"]

_EMPTY = hashlib.sha256(b"").hexdigest()
#: Digests of zero bytes: vLLM's SHA-256 (64 hex), SGLang's host hash (its first 16 hex) and
#: SGLang's GPU hash of an empty tensor (0).
EMPTY_DIGESTS: frozenset[str] = frozenset({_EMPTY, _EMPTY[:16], "0" * 16})


@dataclass(frozen=True)
class TensorCheck:
    """One tensor's verdict with both digests (None where a side has none)."""

    name: str
    verdict: TensorVerdict
    engine: str | None
    expected: str | None


@dataclass(frozen=True)
class DigestCheck:
    """Per-tensor verdicts (:class:`TensorCheck` by name) and the overall :attr:`verdict`."""

    tensors: Mapping[str, TensorCheck] = field(default_factory=dict)

    @property
    def verdict(self) -> CheckVerdict:
        """``"differs"`` if any tensor differs; ``"equal"`` only if every tensor (at least one)
        is equal; ``"unverified"`` otherwise (some had no data, were missing or unexpected)."""
        verdicts = {c.verdict for c in self.tensors.values()}
        if "differs" in verdicts:
            return "differs"
        if verdicts == {"equal"}:
            return "equal"
        return "unverified"

    @property
    def equal(self) -> bool:
        """True only for the verdict ``"equal"`` (every tensor compared, all equal)."""
        return self.verdict == "equal"

    def names(self, verdict: TensorVerdict) -> list[str]:
        """The sorted names with this per-tensor verdict."""
        return sorted(n for n, c in self.tensors.items() if c.verdict == verdict)

    def counts(self) -> dict[str, int]:
        """``{per-tensor verdict: how many}`` (only verdicts that occur)."""
        out: dict[str, int] = {}
        for c in self.tensors.values():
            out[c.verdict] = out.get(c.verdict, 0) + 1
        return dict(sorted(out.items()))

    def summary(self, limit: int = 3) -> str:
        """``"unverified: 6 equal, 8 no_data (model.layers.0.mlp.gate_up_proj.weight, ...)"``."""
        parts = []
        for verdict, n in self.counts().items():
            text = f"{n} {verdict}"
            if verdict != "equal":
                names = self.names(verdict)  # type: ignore[arg-type]
                more = ", ..." if len(names) > limit else ""
                text += f" ({', '.join(names[:limit])}{more})"
            parts.append(text)
        return f"{self.verdict}: {', '.join(parts) or 'no tensors'}"


def compare_digests(engine: Mapping[str, str], expected: Mapping[str, str]) -> DigestCheck:
    """Compare the digests an engine reported with the expected ones, name by name."""
    out: dict[str, TensorCheck] = {}
    for name in sorted(engine.keys() | expected.keys()):
        got, want = engine.get(name), expected.get(name)
        verdict: TensorVerdict
        if got is None:
            verdict = "missing"
        elif want is None:
            verdict = "unexpected"
        elif got in EMPTY_DIGESTS:
            verdict = "no_data"
        elif got == want:
            verdict = "equal"
        else:
            verdict = "differs"
        out[name] = TensorCheck(name, verdict, got, want)
    return DigestCheck(out)


def compare_ranks(
    engine: Sequence[Mapping[str, str]], expected: Sequence[Mapping[str, str]]
) -> DigestCheck:
    """:func:`compare_digests` per TP rank; with more than one rank on either side, names are
    ``"tp<r>:<name>"`` and a rank only one side has makes its tensors missing/unexpected."""
    if len(engine) <= 1 and len(expected) <= 1:
        return compare_digests(engine[0] if engine else {}, expected[0] if expected else {})

    def flat(ranks: Sequence[Mapping[str, str]]) -> dict[str, str]:
        return {f"tp{r}:{n}": d for r, digests in enumerate(ranks) for n, d in digests.items()}

    return compare_digests(flat(engine), flat(expected))
