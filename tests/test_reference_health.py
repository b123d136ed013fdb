"""The reference engine's SGLang ``/health`` (``health_generate``) as SGLang 0.5.23 answers it:
any token the engine samples after the check began answers 200, its own one-token generation
dropped (upstream reads the scheduler's ``last_receive_tstamp``); an engine that samples nothing
answers 503 at ``SGLANG_HEALTH_CHECK_TIMEOUT``. Found under load: a busy engine's check waited
its turn behind the batch past the fleet's probe bound, and a serving group was failed."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from rollsafe.adapters.reference_engine.server import CTX_KEY
from rollsafe.adapters.reference_engine.sglang_api import health_generate


class _BusyEngine:
    """An engine whose check's own generation never gets its turn; ``tokens_after`` s into the
    check another request's token is sampled (None: never)."""

    def __init__(self, tokens_after: float | None) -> None:
        self.paused: str | None = None
        self.last_output_at: float | None = time.monotonic() - 60.0  # a token long before
        self.tokens_after = tokens_after
        self.checks: list[Future[Any]] = []

    def health(self) -> str | None:
        return None

    def submit_generate(self, prompt: list[int], params: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.checks.append(fut)
        if self.tokens_after is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(self.tokens_after, self._sample)
        return fut

    def _sample(self) -> None:
        self.last_output_at = time.monotonic()


async def _get_health(engine: _BusyEngine) -> tuple[int, float]:
    app = web.Application()
    app[CTX_KEY] = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    app.add_routes([web.get("/health", health_generate)])
    async with TestClient(TestServer(app)) as client:
        t0 = time.monotonic()
        resp = await client.get("/health")
        return resp.status, time.monotonic() - t0


def test_a_busy_engines_health_answers_from_another_requests_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "20")
    engine = _BusyEngine(tokens_after=0.2)
    status, _ = asyncio.run(_get_health(engine))
    assert status == 200  # answered by the token: the check's own generation never runs
    (check,) = engine.checks
    assert check.cancelled()  # the check's own generation is dropped


def test_an_engine_that_samples_nothing_fails_its_health_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
    engine = _BusyEngine(tokens_after=None)  # its last token came before the check began
    status, took = asyncio.run(_get_health(engine))
    assert status == 503 and took >= 0.5
    (check,) = engine.checks
    assert check.cancelled()


def test_the_checks_own_token_answers_an_idle_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "20")
    engine = _BusyEngine(tokens_after=None)

    async def main() -> tuple[int, float]:
        task = asyncio.ensure_future(_get_health(engine))
        while not engine.checks:
            await asyncio.sleep(0.01)
        engine.checks[0].set_result(object())  # the check's own generation is done
        return await task

    status, _ = asyncio.run(main())
    assert status == 200 and not engine.checks[0].cancelled()
