"""``VLLMClient`` picks its dialect from the server's version and makes 0.26/0.32 look like 0.33.

An in-process ``httpx.MockTransport`` plays the server (requests recorded and checked against
the contract of the release it plays); a handler may act through the client in the middle of
a request, as another thread of the fleet (a sync) would. Against a real vLLM 0.32 server:
``tests/test_vllm_behaviour.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from rollsafe.adapters.engines import EngineNotSupported, EngineRequestError, VLLMClient
from rollsafe.adapters.engines.contract import UnsupportedVersion, load_contract
from rollsafe.adapters.engines.vllm_dialect import Mark, PauseLedger, read_version_holds

Hook = Callable[[VLLMClient], None]


class Server:
    """A vLLM ``version`` (None: no ``/version`` route, as the reference engine)."""

    def __init__(self, version: str | None, finish: str = "length") -> None:
        self.version = version
        self.finish = finish
        self.weight_version = "v1"
        self.paths: list[str] = []
        self.bodies: list[tuple[str, Any]] = []
        self.during_completion: Hook | None = None
        self.during_version_read: Hook | None = None
        self.client: VLLMClient | None = None

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(path)
        body = json.loads(request.content) if request.content else None
        self.bodies.append((path, body))
        if self.version is not None:
            query = dict(request.url.params)
            problems = load_contract("vllm", _contract(self.version)).check_request(
                request.method, path, query=query, body=body
            )
            assert not problems, [str(p) for p in problems]
        if path == "/version":
            if self.version is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"version": self.version})
        if path == "/weight_info":
            hook, self.during_version_read = self.during_version_read, None
            if hook is not None and self.client is not None:
                hook(self.client)
            return httpx.Response(200, json={"weight_version": self.weight_version})
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
        if path == "/finish_weight_update" and body and body.get("weight_version"):
            self.weight_version = body["weight_version"]
        if path == "/v1/completions":
            hook, self.during_completion = self.during_completion, None
            if hook is not None and self.client is not None:
                hook(self.client)
            choice: dict[str, Any] = {
                "index": 0,
                "text": "ab",
                "token_ids": [3, 4],
                "finish_reason": self.finish,
            }
            if body.get("return_weight_versions"):
                choice["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": 2}]
            if body.get("stream"):
                first = {"index": 0, "text": "a", "token_ids": [3], "finish_reason": None}
                events = [
                    {"choices": [first]},
                    {"choices": [{**choice, "text": "b", "token_ids": [4]}]},
                ]
                sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
            return httpx.Response(200, json={"id": "c", "choices": [choice]})
        return httpx.Response(200, json={"status": "ok"})

    def client_for(self, **kwargs: Any) -> VLLMClient:
        self.client = VLLMClient(
            "http://engine", transport=httpx.MockTransport(self.handler), **kwargs
        )
        return self.client


def _contract(version: str) -> str:
    for release in ("0.26.0", "0.32.0"):
        if version.startswith(release[:4]):
            return release
    return "0.33.0"


def completion_bodies(server: Server) -> list[Any]:
    return [b for p, b in server.bodies if p == "/v1/completions"]


# ---- which dialect ------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", None])
def test_the_dialect_comes_from_the_servers_version_asked_once(version: str | None) -> None:
    server = Server(version)
    with server.client_for() as client:
        for _ in range(3):
            result = client.generate([1, 2], sampling_params={"max_new_tokens": 2})
            assert result.weight_version == "v1"
        dialect = client.server_dialect()
    old = version is not None and version.startswith("0.32")
    assert dialect.version == ("0.32.0" if old else "0.33.0")
    assert dialect.server_version == version
    assert server.paths.count("/version") == 1  # cached per client
    for body in completion_bodies(server):
        assert ("return_weight_versions" in body) is not old
        assert body["skip_special_tokens"] is True  # the same text on every release
    # 0.32: one /weight_info read, remembered while the ledger is steady; 0.33: the
    # completion reports the version
    assert server.paths.count("/weight_info") == (1 if old else 0)


def test_a_pinned_server_version_is_not_asked_and_bad_ones_are_named() -> None:
    server = Server("0.33.0")  # answers as 0.33: the pin wins
    with server.client_for(server_version="0.32.0") as client:
        client.generate([1], sampling_params={"max_new_tokens": 2})
    assert "/version" not in server.paths and "return_weight_versions" not in server.bodies[-1][1]
    with pytest.raises(UnsupportedVersion, match=r"server_version=.*older than every supported"):
        VLLMClient("http://engine", server_version="0.25.1")
    with pytest.raises(UnsupportedVersion, match=r"server_version=.*no supported release"):
        VLLMClient("http://engine", server_version="0.30.1")  # between 0.26 and 0.32
    old = Server("0.31.0")
    with old.client_for() as client, pytest.raises(EngineNotSupported, match=r"0\.31\.0"):
        client.server_dialect()
    assert old.paths == ["/version"]


# ---- pause semantics ------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0"])
@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_paused_0_32_engine_refuses_like_0_33_does(mode: str, version: str) -> None:
    """0.26 and 0.32 would queue the request until /resume (a paused engine looks hung); the
    client refuses it with the 503 0.33 answers, sending nothing, until it resumes the engine."""
    server = Server(version)
    with server.client_for() as client:
        client.pause_generation(mode)  # type: ignore[arg-type]
        for call in (
            lambda: client.generate([1], sampling_params={"max_new_tokens": 2}),
            lambda: list(client.generate_stream([1], sampling_params={"max_new_tokens": 2})),
        ):
            with pytest.raises(EngineRequestError) as info:
                call()
            assert info.value.status_code == 503 and "paused" in info.value.message
        assert "/v1/completions" not in server.paths
        client.continue_generation()
        assert client.generate([1], sampling_params={"max_new_tokens": 2}).output_ids == [3, 4]


def test_in_place_pause_and_0_33_engines_are_not_refused_locally() -> None:
    """``in_place`` (vLLM ``keep``) queues on both releases; 0.33 answers its own 503."""
    old = Server("0.32.0")
    with old.client_for() as client:
        client.pause_generation("in_place")
        client.generate([1], sampling_params={"max_new_tokens": 2})
    new = Server("0.33.0")
    with new.client_for() as client:
        client.pause_generation("abort")
        client.generate([1], sampling_params={"max_new_tokens": 2})
    assert old.paths.count("/v1/completions") == new.paths.count("/v1/completions") == 1


def test_a_failed_pause_does_not_leave_the_client_refusing() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause":
            return httpx.Response(500, json={"error": "boom"})
        return Server("0.32.0").handler(request)

    with VLLMClient(
        "http://engine", transport=httpx.MockTransport(handler), server_version="0.32.0"
    ) as client:
        with pytest.raises(EngineRequestError):
            client.pause_generation("abort")
        assert client.generate([1], sampling_params={"max_new_tokens": 2}).output_ids


# ---- which version produced a 0.32 completion ---------------------------------------------


def sync_to(version: str) -> Hook:
    """What a fleet sync does through the group's client: pause, new weights, resume."""

    def hook(client: VLLMClient) -> None:
        client.pause_generation("abort")
        client.update_weight_version(version)
        client.continue_generation()

    return hook


def test_no_pause_during_the_request_the_version_read_before_is_exact() -> None:
    server = Server("0.32.0")
    with server.client_for() as client:
        result = client.generate([1], sampling_params={"max_new_tokens": 2})
    assert result.weight_version == "v1"
    assert result.meta_info["weight_version_source"] == "weight_info"
    assert result.meta_info["weight_version_exact"] is True
    assert server.paths == ["/version", "/weight_info", "/v1/completions"]


def test_answered_while_still_paused_the_version_read_before_is_exact() -> None:
    """A pause (and a weight change) arrived while the request ran, but the answer came
    before the resume: a paused 0.32 engine runs nothing new, so the request ran before it."""
    server = Server("0.32.0", finish="abort")

    def pause_and_change(client: VLLMClient) -> None:
        client.pause_generation("abort")
        client.update_weight_version("v2")

    server.during_completion = pause_and_change
    with server.client_for() as client:
        result = client.generate([1], sampling_params={"max_new_tokens": 2})
        assert result.weight_version == "v1" and result.meta_info["weight_version_exact"]
        assert server.paths.count("/weight_info") == 1  # no second read needed
        client.continue_generation()
        assert client.generate([1], sampling_params={"max_new_tokens": 2}).weight_version == "v2"


@pytest.mark.parametrize("finish", ["length", "abort"])
def test_a_sync_overlapping_the_request_is_marked_inexact(finish: str) -> None:
    """A whole pause -> update -> resume overlapped the request: the version is read again;
    an aborted request ran before the pause (v1), a finished one most likely after it (v2),
    and neither can be proven without 0.33's spans."""
    server = Server("0.32.0", finish=finish)
    server.during_completion = sync_to("v2")
    with server.client_for() as client:
        result = client.generate([1], sampling_params={"max_new_tokens": 2})
    assert result.weight_version == ("v1" if finish == "abort" else "v2")
    assert result.meta_info["weight_version_exact"] is False
    assert server.paths.count("/weight_info") == 2


def test_a_sync_that_did_not_change_the_version_stays_exact() -> None:
    server = Server("0.32.0")
    server.during_completion = sync_to("v1")
    with server.client_for() as client:
        result = client.generate([1], sampling_params={"max_new_tokens": 2})
    assert result.weight_version == "v1" and result.meta_info["weight_version_exact"] is True


def test_a_sync_during_the_version_read_makes_the_client_read_again() -> None:
    server = Server("0.32.0")
    server.during_version_read = sync_to("v2")
    with server.client_for() as client:
        result = client.generate([1], sampling_params={"max_new_tokens": 2})
    assert result.weight_version == "v2" and result.meta_info["weight_version_exact"] is True
    assert server.paths.count("/weight_info") == 2


def test_a_0_32_stream_ends_with_the_version_and_one_span() -> None:
    server = Server("0.32.0")
    with server.client_for() as client:
        deltas = list(client.generate_stream([1], sampling_params={"max_new_tokens": 2}))
        server.during_completion = sync_to("v2")
        cut = list(client.generate_stream([1], sampling_params={"max_new_tokens": 2}))
    assert [d.token_ids for d in deltas] == [(3,), (4,)]
    # a delta read while the version read before still holds is labelled with it
    assert deltas[0].weight_version == "v1" and deltas[-1].weight_version == "v1"
    assert "weight_version_exact" not in deltas[0].meta
    assert [(s.version, s.start, s.end) for s in deltas[-1].spans] == [("v1", 0, 2)]
    assert deltas[-1].meta["weight_version_exact"] is True
    # read after a whole pause -> update -> resume: which weights produced it cannot be told
    assert cut[0].weight_version is None and cut[0].meta["weight_version_exact"] is False
    assert cut[-1].weight_version == "v2" and cut[-1].spans == ()  # inexact: no span claimed
    assert cut[-1].meta["weight_version_exact"] is False


# ---- remembered versions (0.32): a read stands for the ledger's steady stretch --------------


def _reads(server: Server) -> int:
    return server.paths.count("/weight_info")


def _generate(client: VLLMClient) -> Any:
    return client.generate([1], sampling_params={"max_new_tokens": 2})


def test_one_read_serves_the_steady_stretch_and_each_sync_starts_a_new_one() -> None:
    server = Server("0.32.0")
    with server.client_for() as client:
        first = [_generate(client) for _ in range(3)]
        streamed = list(client.generate_stream([1], sampling_params={"max_new_tokens": 2}))
        assert _reads(server) == 1
        sync_to("v2")(client)  # pause, relabel, resume: the stretch ends
        second = [_generate(client) for _ in range(3)]
        assert _reads(server) == 2
    for result in first:
        assert result.weight_version == "v1" and result.meta_info["weight_version_exact"] is True
        assert result.meta_info["weight_version_source"] == "weight_info"
    assert streamed[-1].weight_version == "v1" and streamed[-1].meta["weight_version_exact"]
    assert [r.weight_version for r in second] == ["v2"] * 3
    assert all(r.meta_info["weight_version_exact"] is True for r in second)


def test_an_unpaused_relabel_ends_the_stretch() -> None:
    server = Server("0.32.0")
    with server.client_for() as client:
        assert _generate(client).weight_version == "v1"
        client.update_weight_version("v2")  # no pause: the mark moves, the stretch ends
        assert _generate(client).weight_version == "v2"
        assert _generate(client).weight_version == "v2"
    assert _reads(server) == 2


def test_a_read_the_ledger_moved_under_is_not_remembered() -> None:
    """A sync during the read: the client reads again (as before) and remembers only the
    read that held, so the next request reads nothing and reports the new version."""
    server = Server("0.32.0")
    server.during_version_read = sync_to("v2")
    with server.client_for() as client:
        assert _generate(client).weight_version == "v2"
        assert _reads(server) == 2
        assert _generate(client).weight_version == "v2"
        assert _reads(server) == 2


def test_nothing_is_remembered_while_paused_in_place_or_between_an_updates_calls() -> None:
    """``in_place`` queues on 0.32 (the client sends), but a paused engine's stretch is not
    steady: each request reads. Between the calls of one weight update (the update open),
    neither; after its last call, one read is remembered again."""
    server = Server("0.32.0")
    with server.client_for() as client:
        client.pause_generation("in_place")
        _generate(client)
        _generate(client)
        assert _reads(server) == 2
        client.continue_generation()
        _generate(client)
        _generate(client)
        assert _reads(server) == 3
        client.update_weights_from_distributed(["w"], ["float32"], [[2]])  # opened, no version
        _generate(client)
        _generate(client)
        assert _reads(server) == 5
        client.update_weights_from_distributed(
            ["w"], ["float32"], [[2]], weight_version="v2", flush_cache=False
        )
        assert [_generate(client).weight_version for _ in range(2)] == ["v2", "v2"]
        assert _reads(server) == 6


def test_a_relabel_behind_the_clients_back_is_seen_after_forget_version() -> None:
    """Documented: the label is this client's to change; one changed by another process is
    not seen until the client's next pause, resume or weight change, or ``forget_version``."""
    server = Server("0.32.0")
    with server.client_for() as client:
        assert _generate(client).weight_version == "v1"
        server.weight_version = "v9"  # another process relabelled the engine
        assert _generate(client).weight_version == "v1"
        client.forget_version()
        assert _generate(client).weight_version == "v9"
    assert _reads(server) == 2


def test_the_ledger_remembers_only_within_one_steady_stretch() -> None:
    ledger = PauseLedger()
    start = ledger.start()
    assert start.steady is not None and not start.known
    ledger.learned(start.steady, "v1")
    assert (ledger.start().known, ledger.start().version) == (True, "v1")
    with ledger.changing_weights():
        inside = ledger.start()
        assert inside.steady is None and not inside.known  # a change in flight
        ledger.learned(inside.steady, "v2")  # nothing to remember against
        ledger.learned(start.steady, "v1")  # that stretch is over
    after = ledger.start()
    assert after.steady not in (None, start.steady) and not after.known
    ledger.learned(after.steady, None)  # an engine that reports no version: remembered too
    assert (ledger.start().known, ledger.start().version) == (True, None)
    ledger.pausing("keep")
    assert ledger.start().steady is None and not ledger.start().known
    ledger.resumed()
    assert not ledger.start().known
    ledger.learned(ledger.start().steady, "v3")
    ledger.forget()
    assert not ledger.start().known


# ---- vLLM 0.26: the version is the client's label ------------------------------------------


def test_a_0_26_completion_reports_the_clients_label_and_asks_nothing_for_it() -> None:
    """0.26 has neither ``/weight_info`` nor ``/update_weight_version``: the label this
    client set is the version of its completions (None while unknown), with the same
    exactness rules as 0.32's read."""
    server = Server("0.26.0")
    with server.client_for() as client:
        first = client.generate([1], sampling_params={"max_new_tokens": 2})
        assert first.weight_version is None  # nothing set yet
        client.update_weight_version("v1")
        second = client.generate([1], sampling_params={"max_new_tokens": 2})
        server.during_completion = sync_to("v2")
        overlapped = client.generate([1], sampling_params={"max_new_tokens": 2})
        stream = list(client.generate_stream([1], sampling_params={"max_new_tokens": 2}))
    assert second.weight_version == "v1" and second.meta_info["weight_version_exact"] is True
    assert second.meta_info["weight_version_source"] == "client"
    assert (
        overlapped.weight_version == "v2" and overlapped.meta_info["weight_version_exact"] is False
    )
    assert (
        stream[-1].weight_version == "v2" and stream[-1].meta["weight_version_source"] == "client"
    )
    assert [(s.version, s.start, s.end) for s in stream[-1].spans] == [("v2", 0, 2)]
    assert "/weight_info" not in server.paths and "/update_weight_version" not in server.paths
    assert all("return_weight_versions" not in b for b in completion_bodies(server))


def test_read_version_holds_table() -> None:
    start = Mark(pauses=1, resumes=1, unpaused_changes=0, paused=False)
    assert read_version_holds(start, start)
    paused = Mark(2, 1, 0, True)
    assert read_version_holds(start, paused)  # answered before the resume
    assert not read_version_holds(start, Mark(2, 2, 0, False))  # a whole pause/resume
    assert not read_version_holds(start, Mark(1, 1, 1, False))  # a change without a pause
    assert not read_version_holds(start, Mark(2, 1, 1, True))  # changed, then paused
