"""The asyncio data plane: thousands of requests on one event loop, no thread per request;
the blocking call is the async path run on the plane's loop; waits hold no thread.

Engines here are the gateway benchmark's stub (benchmarks/gateway/stub_engine.py: a real
HTTP/1.1 server speaking SGLang's ``/generate``, fixed tokens, no model), reached through the
real :class:`~rollsafe.adapters.engines.SGLangClient` and its async companion.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from stub_helpers import STUB_TOKEN, Stub, raise_nofile, stub_router, stubs  # noqa: F401

from rollsafe.adapters.engines.streaming import StreamDelta, WeightSpan
from rollsafe.fleet.dataplane import DataPlane
from rollsafe.fleet.router import NoRoutableGroup, Router
from rollsafe.ports import GenerateResult


@pytest.mark.parametrize("whole_up_to", [0, 64], ids=["streamed", "read-whole"])
@pytest.mark.parametrize("stubs", [500.0], indirect=True)
def test_ten_thousand_requests_in_flight_on_one_loop(
    stubs: list[Stub],  # noqa: F811
    whole_up_to: int,
) -> None:
    """10,000 requests at once on one event loop (each stays open for seconds: the stub waits
    500 ms per token), streamed (``Router.whole_up_to = 0``) or, 8 tokens being within the
    default ``whole_up_to``, read as whole answers: every one served whole, each the way it
    was asked for, no thread per request."""
    raise_nofile()
    n, tokens = 10_000, 8
    router = stub_router(stubs, request_timeout_s=120.0)
    router.whole_up_to = whole_up_to
    plane = DataPlane(router)
    threads_before = threading.active_count()
    peak = {"outstanding": 0, "threads": 0}

    async def main() -> list[Any]:
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                now = sum(g.outstanding for g in router.registry.groups())
                peak["outstanding"] = max(peak["outstanding"], now)
                peak["threads"] = max(peak["threads"], threading.active_count())
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        params = {"max_new_tokens": tokens}
        results = await asyncio.gather(
            *(plane.agenerate([1, 2, i % 500], sampling_params=params) for i in range(n))
        )
        done.set()
        await watcher
        await plane.aclose_loop()
        return results

    try:
        results = asyncio.run(main())
    finally:
        plane.close()
        router.close()
    assert len(results) == n
    assert all(r.output_ids == [STUB_TOKEN] * tokens for r in results)
    assert {r.group_id for r in results} == {"g0", "g1"}
    assert peak["outstanding"] == n  # all of them in flight at once
    assert peak["threads"] <= threads_before + 2  # no thread per request
    streams = sum(s.stats()["streams_finished"] for s in stubs)
    answers = sum(s.stats()["generate"] for s in stubs)
    assert answers == n
    assert streams == (n if whole_up_to == 0 else 0)
    assert router.continuation.as_dict()["whole"] == (0 if whole_up_to == 0 else n)


def test_blocking_generate_runs_the_async_path_on_one_loop_thread(stubs: list[Stub]) -> None:  # noqa: F811
    router = stub_router(stubs)
    plane = DataPlane(router)
    try:
        one = plane.generate([1, 2, 3], sampling_params={"max_new_tokens": 4})
        outs: list[Any] = []
        before = threading.active_count()
        workers = [
            threading.Thread(
                target=lambda: outs.append(
                    plane.generate([1, 2, 3], sampling_params={"max_new_tokens": 4})
                )
            )
            for _ in range(8)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        assert threading.active_count() <= before  # the callers' threads only; they ended
        assert plane.loop_thread.started
    finally:
        plane.close()
        router.close()
    assert one.output_ids == [STUB_TOKEN] * 4 and one.segments and one.segments[0].tokens == 4
    assert len(outs) == 8 and all(o.output_ids == one.output_ids for o in outs)
    assert sum(g.outstanding for g in router.registry.groups()) == 0


@pytest.mark.parametrize("stubs", [200.0], indirect=True)
def test_a_cancelled_stream_ends_its_admission_and_its_engine_request(
    stubs: list[Stub],  # noqa: F811
) -> None:
    router = stub_router(stubs)
    plane = DataPlane(router)

    async def main() -> tuple[int, int]:
        got = asyncio.Event()

        async def consume() -> None:
            async for chunk in plane.astream([1, 2, 3], sampling_params={"max_new_tokens": 50}):
                if chunk.token_ids:
                    got.set()

        task = asyncio.create_task(consume())
        await got.wait()
        during = sum(g.outstanding for g in router.registry.groups())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        after = sum(g.outstanding for g in router.registry.groups())
        await plane.aclose_loop()
        return during, after

    try:
        during, after = asyncio.run(main())
    finally:
        plane.close()
        router.close()
    assert (during, after) == (1, 0)
    for _ in range(100):  # the stub notices the closed connection at its next token
        if sum(s.stats()["streams_cut"] for s in stubs) == 1:
            break
        threading.Event().wait(0.05)
    assert sum(s.stats()["streams_cut"] for s in stubs) == 1
    assert sum(s.stats()["streams_finished"] for s in stubs) == 0


def test_requests_wait_while_a_sync_holds_them(stubs: list[Stub]) -> None:  # noqa: F811
    """While a sync holds requests (abort mode) nothing is dispatched; released, they go."""
    router = stub_router(stubs)
    plane = DataPlane(router)

    async def main() -> tuple[int, list[Any]]:
        router.hold()
        tasks = [
            asyncio.create_task(plane.agenerate([1, 2], sampling_params={"max_new_tokens": 2}))
            for _ in range(4)
        ]
        await asyncio.sleep(0.5)
        dispatched = sum(s.stats()["generate"] for s in stubs)
        router.release()
        results = await asyncio.gather(*tasks)
        await plane.aclose_loop()
        return dispatched, results

    try:
        dispatched, results = asyncio.run(main())
    finally:
        plane.close()
        router.close()
    assert dispatched == 0
    assert [r.output_ids for r in results] == [[STUB_TOKEN] * 2] * 4


def test_a_request_waits_for_a_group_to_become_active_then_gives_up_named(
    stubs: list[Stub],  # noqa: F811
) -> None:
    router = stub_router(stubs)
    reg = router.registry
    for gid in ("g0", "g1"):
        reg.send(gid, "fail")
    plane = DataPlane(router)

    async def main() -> tuple[Any, BaseException | None]:
        waiting = asyncio.create_task(
            plane.agenerate([1], sampling_params={"max_new_tokens": 2}, wait_for_routable_s=30.0)
        )
        await asyncio.sleep(0.3)
        assert not waiting.done()
        reg.send("g1", "claim")  # a recovery takes g1 and restarts it
        reg.report_member("g1", 1, healthy=True, weights_version=reg.fleet_version)
        reg.send("g1", "restarted")
        served = await waiting
        reg.send("g1", "fail")
        try:
            await plane.agenerate(
                [1], sampling_params={"max_new_tokens": 2}, wait_for_routable_s=0.2
            )
        except NoRoutableGroup as exc:
            return served, exc
        finally:
            await plane.aclose_loop()
        return served, None

    try:
        served, refused = asyncio.run(main())
    finally:
        plane.close()
        router.close()
    assert served.group_id == "g1" and served.output_ids == [STUB_TOKEN] * 2
    assert isinstance(refused, NoRoutableGroup)
    assert refused.states == {"g0": "inactive", "g1": "inactive"}


class AcrossASync:
    """A client whose first answer is read across a sync on a vLLM that reports no version
    (0.26, 0.32): its first delta while the version read before the request holds (``"1"``),
    the rest after the sync resumed the engine, so which weights made them cannot be told
    (``weight_version_exact: False``, as :meth:`VLLMClient.read_delta` labels them); every
    later answer comes from ``"2"``."""

    url = "http://across-a-sync"

    def __init__(self) -> None:
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
        exact = len(self.prompts) > 1
        ids = [6 if exact else 5] * n
        return GenerateResult("", ids, "2", "length", {"weight_version_exact": exact})

    def generate_stream(
        self,
        input_ids: list[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamDelta]:
        self.prompts.append(list(input_ids or []))
        n = (sampling_params or {})["max_new_tokens"]
        unknown = {"weight_version_exact": False}
        if len(self.prompts) == 1:
            yield StreamDelta((5,), weight_version="1")
            yield StreamDelta((5,) * (n - 2), meta=unknown)
            yield StreamDelta((5,), weight_version="2", finished=True, finish_reason="length")
            return
        yield StreamDelta((6,) * n, weight_version="2")
        span = WeightSpan("2", 0, n)
        yield StreamDelta(
            (), weight_version="2", finished=True, finish_reason="length", spans=(span,)
        )


def test_tokens_whose_weights_cannot_be_told_are_not_kept() -> None:
    """Tokens read across a sync on a vLLM without versions may have waited in a buffer since
    before the pause or come from the new weights: the streamed request keeps the tokens read
    before (``"1"``), drops the rest and goes on after the sync (a new piece, ``"2"``); a
    whole answer of that kind is sent again. No token is credited to weights that may not
    have made it (the soak's token check found one such answer, seed 342241)."""
    from fleet_sim import bring_up

    from rollsafe.registry import FleetRegistry

    def plane_on(client: AcrossASync) -> tuple[Router, DataPlane]:
        reg = FleetRegistry(fleet_version=1)
        reg.add_group("g0", [0], clients=[client])
        bring_up(reg, "g0")
        router = Router(reg)
        return router, DataPlane(router)

    streamed = AcrossASync()
    router, plane = plane_on(streamed)
    router.whole_up_to = 0  # 8 tokens: streamed, not read whole
    try:
        out = plane.generate([1, 2, 3], sampling_params={"max_new_tokens": 8})
        stats = router.stats()["continuation"]
    finally:
        plane.close()
        router.close()
    assert out.output_ids == [5] + [6] * 7  # the one token read before the sync, then "2"'s
    assert [(s.weights_version, s.token_range, s.ended) for s in out.segments] == [
        ("1", (0, 1), "aborted"),
        ("2", (1, 8), "finished"),
    ]
    assert streamed.prompts == [[1, 2, 3], [1, 2, 3, 5]]  # continued from the kept token
    assert stats["unattributed"] == 1 and stats["after_abort"] == 1

    whole = AcrossASync()
    router, plane = plane_on(whole)
    try:
        answer = plane.generate(text="hello", sampling_params={"max_new_tokens": 4})
        stats = router.stats()["continuation"]
    finally:
        plane.close()
        router.close()
    assert answer.output_ids == [6] * 4 and answer.result.meta_info["weight_version_exact"]
    assert len(whole.prompts) == 2 and answer.attempts == 1 and answer.failed_on == ()
    assert stats["unattributed"] == 1

    # token ids within ``whole_up_to``: read whole, the continuation's path keeps none of the
    # first answer's tokens and sends the request again from its prompt
    ids_whole = AcrossASync()
    router, plane = plane_on(ids_whole)
    try:
        out = plane.generate([1, 2, 3], sampling_params={"max_new_tokens": 4})
        stats = router.stats()["continuation"]
    finally:
        plane.close()
        router.close()
    assert out.output_ids == [6] * 4
    assert ids_whole.prompts == [[1, 2, 3], [1, 2, 3]]
    assert [(s.weights_version, s.token_range, s.ended) for s in out.segments] == [
        ("2", (0, 4), "finished")
    ]
    assert stats["whole"] == 1 and stats["unattributed"] == 1 and stats["after_abort"] == 1
