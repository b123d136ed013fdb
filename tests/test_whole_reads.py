"""Short requests read whole (``Router.whole_up_to``): which requests, what a whole answer
becomes on the continuation's path (:func:`rollsafe.fleet.continuation.whole_delta`), and an
answer during which the fleet recorded a new version for its group (a sync that paused the
engine without aborting the request, SGLang's ``retract``) keeps none of its tokens.

Engines are in-process fakes behind the data plane's threaded companion: what is checked is
the data plane's decision and bookkeeping, not an engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fleet_sim import bring_up

from rollsafe.adapters.engines.streaming import StreamDelta, WeightSpan
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.continuation import whole_delta
from rollsafe.fleet.dataplane import DataPlane
from rollsafe.fleet.router import Router
from rollsafe.ports import GenerateResult
from rollsafe.registry import FleetRegistry


def test_a_whole_answer_becomes_one_finished_delta() -> None:
    """Tokens, text, version, finish and logprobs carried over; vLLM 0.33's spans become
    spans; logprobs that do not match the tokens are dropped rather than misaligned."""
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}]
    result = GenerateResult(
        "abcd", [1, 2, 3, 4], "4", "length", {"weight_versions": spans}, (-0.1, -0.2, None, -0.4)
    )
    delta = whole_delta(result)
    assert delta.token_ids == (1, 2, 3, 4) and delta.text == "abcd" and delta.finished
    assert delta.weight_version == "4" and delta.finish_reason == "length"
    assert delta.spans == (WeightSpan("3", 0, 2), WeightSpan("4", 2, 4))
    assert delta.logprobs == (-0.1, -0.2, None, -0.4)
    assert "weight_version_exact" not in delta.meta
    short = GenerateResult("ab", [1, 2], "4", "length", {}, (-0.1,))
    assert whole_delta(short).logprobs == ()
    bad_spans = GenerateResult("ab", [1, 2], "4", "length", {"weight_versions": [{"v": 1}]})
    assert whole_delta(bad_spans).spans == ()


def test_an_answer_made_across_a_recorded_sync_is_inexact_unless_aborted_or_spanned() -> None:
    """``synced``: only an answer that names no per-token versions and was not aborted is
    marked ``weight_version_exact: False``."""
    plain = GenerateResult("ab", [1, 2], "5", "length", {})
    assert whole_delta(plain, synced=True).meta["weight_version_exact"] is False
    aborted = GenerateResult("a", [1], "4", "abort", {})
    assert "weight_version_exact" not in whole_delta(aborted, synced=True).meta
    spanned = GenerateResult(
        "ab", [1, 2], "5", "length", {"weight_versions": [{"version": "5", "start": 0, "end": 2}]}
    )
    assert "weight_version_exact" not in whole_delta(spanned, synced=True).meta


def test_which_requests_are_read_whole() -> None:
    """A request asking 1 to ``whole_up_to`` new tokens (SGLang's or OpenAI's name); not one
    without a budget, above it, or with ``whole_up_to = 0``; a negative bound is refused."""
    reg = FleetRegistry(fleet_version=1)
    router = Router(reg)
    plane = DataPlane(router)
    try:
        assert router.whole_up_to == 64
        assert plane.reads_whole({"max_new_tokens": 64})
        assert plane.reads_whole({"max_tokens": 1})
        assert not plane.reads_whole({"max_new_tokens": 65})
        assert not plane.reads_whole({"max_new_tokens": 0})
        assert not plane.reads_whole({"max_new_tokens": True})
        assert not plane.reads_whole({"temperature": 0.0})
        assert not plane.reads_whole(None)
        router.whole_up_to = 0
        assert not plane.reads_whole({"max_new_tokens": 8})
    finally:
        plane.close()
        router.close()
    with pytest.raises(InvalidArgument, match="whole_up_to"):
        Router(FleetRegistry(), whole_up_to=-1)


class SyncedUnder:
    """A client whose first answer is made while the fleet syncs its group (the registry
    records version 2 for it before the answer returns, as a ``retract`` sync does before it
    resumes generation): that answer's tokens (5) are from both versions; later answers (6)
    from version 2 alone. It streams too (the data plane's continuation needs both)."""

    url = "http://synced-under"

    def __init__(self, registry: FleetRegistry) -> None:
        self.registry = registry
        self.prompts: list[list[int]] = []

    def generate(
        self,
        input_ids: list[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        self.prompts.append(list(input_ids or []))
        n = (sampling_params or {})["max_new_tokens"]
        if len(self.prompts) == 1:
            with self.registry.recording():
                self.registry.report_member("g0", 0, healthy=True, weights_version=2)
                self.registry.set_fleet_version(2)
            return GenerateResult("", [5] * n, "2", "length", {})
        return GenerateResult("", [6] * n, "2", "length", {})

    def generate_stream(
        self,
        input_ids: list[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamDelta]:
        raise AssertionError("a short request read whole is never streamed")


def test_an_answer_made_while_its_group_synced_keeps_none_of_its_tokens() -> None:
    """Which of its tokens the old weights made cannot be told: none is kept, the request is
    sent again from its prompt (``unattributed``), and the tokens that come back are all
    credited to version 2."""
    reg = FleetRegistry(fleet_version=1)
    client = SyncedUnder(reg)
    reg.add_group("g0", [0], clients=[client])
    bring_up(reg, "g0")
    router = Router(reg)
    plane = DataPlane(router)
    try:
        out = plane.generate([1, 2, 3], sampling_params={"max_new_tokens": 4})
        stats = router.stats()["continuation"]
    finally:
        plane.close()
        router.close()
    assert out.output_ids == [6] * 4
    assert client.prompts == [[1, 2, 3], [1, 2, 3]]
    assert [(s.weights_version, s.token_range, s.ended) for s in out.segments] == [
        ("2", (0, 4), "finished")
    ]
    assert stats["whole"] == 1 and stats["unattributed"] == 1 and stats["whole_lost"] == 0
