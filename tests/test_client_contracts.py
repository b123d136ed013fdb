"""Every request SGLangClient and VLLMClient send validates against the pinned upstream contracts.

The clients talk to an in-process ``httpx.MockTransport`` that records each request (method,
route, query, JSON body) and answers with upstream's response shapes; every recorded request is
then checked with :meth:`EngineContract.check_request` against
``rollsafe/adapters/engines/contracts/{sglang-0.5.23,vllm-0.32.0,vllm-0.33.0}.json`` (generated
from the released wheels by ``tools/upstream_contract.py``). Route, query keys, body keys,
nested keys and value domains all count; a request to a route upstream does not serve fails
the test. ``VLLMClient`` asks the server its version (``GET /version``) and speaks that
release's dialect, so every vLLM call is checked against both vLLM contracts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from rollsafe.adapters.engines import SGLangClient, VLLMClient
from rollsafe.adapters.engines.contract import load_contract
from rollsafe.adapters.engines.errors import (
    EngineAsleep,
    EngineNotSupported,
    EngineRequestError,
    NoWeightChecker,
)
from rollsafe.errors import InvalidArgument

Recorded = tuple[str, str, dict[str, Any], Any]


def _answer(path: str, body: Any) -> Any:
    """Upstream-shaped answers (what the clients parse)."""
    if path == "/generate":
        return {
            "text": "hi",
            "output_ids": [1, 2],
            "meta_info": {
                "finish_reason": {"type": "length"},
                "weight_version": "v1",
                "weight_versions": [{"version": "v1", "start": 0, "end": 2}],
            },
        }
    if path == "/v1/completions":
        return {
            "choices": [
                {
                    "text": "hi",
                    "token_ids": [1, 2],
                    "finish_reason": "length",
                    "weight_versions": [{"version": "v1", "start": 0, "end": 2}],
                }
            ]
        }
    if path == "/weights_checker":
        rank = {
            "checksums": {"w": "00000000000000ff"},
            "per_gpu_checksum": "a" * 64,
            "parallelism_info": {
                "role": "target",
                "tp_rank": 0,
                "tp_size": 1,
                "dp_rank": 0,
                "dp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": 0,
                "size": 1,
            },
        }
        return {"success": True, "message": "", "ranks": [rank], "per_engine_checksum": "b" * 64}
    if path == "/weight_checker":
        return {"checksums": {"dp0:pp0:pcp0:tp0:w": "c" * 64}}
    if path in ("/model_info", "/get_model_info", "/weight_info"):
        return {"weight_version": "v1", "model_path": "/m"}
    if path == "/is_sleeping":
        return {"is_sleeping": False}
    if path == "/collective_rpc":
        return {"results": [None]}
    if path == "/get_weights_by_name":
        return [0.0, 1.0]
    return {"success": True, "message": "ok"}


VLLM_VERSIONS = ("0.26.0", "0.32.0", "0.33.0")
#: routes vLLM 0.26.0 does not serve (a real one answers 404)
ABSENT_IN_0_26 = {
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
    "/shutdown_weight_transfer_engine",
}


class Recorder:
    """Records every request; answers as a vLLM ``version`` would (``/version``; no
    ``weight_versions`` in 0.32 completions)."""

    def __init__(self, version: str = "0.33.0", sglang: str | None = None) -> None:
        self.requests: list[Recorded] = []
        self.version = version
        self.sglang = sglang  # the SGLang release /server_info reports (None: no version)

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info" and self.sglang is not None:
            self.requests.append((request.method, "/server_info", {}, None))
            return httpx.Response(200, json={"version": self.sglang, "tp_size": 1})
        if request.url.path == "/version":
            self.requests.append((request.method, "/version", {}, None))
            return httpx.Response(200, json={"version": self.version})
        if self.version.startswith("0.26") and request.url.path in ABSENT_IN_0_26:
            self.requests.append((request.method, request.url.path, {}, None))
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/v1/completions" and self.version[:4] in ("0.26", "0.32"):
            answer = _answer("/v1/completions", None)
            for choice in answer["choices"]:
                del choice["weight_versions"]
            raw = request.content
            self.requests.append(("POST", "/v1/completions", {}, json.loads(raw)))
            if json.loads(raw).get("stream"):
                events = [json.dumps(answer), "[DONE]"]
                sse = "".join(f"data: {e}\n\n" for e in events)
                return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
            return httpx.Response(200, json=answer)
        raw = request.content
        body = json.loads(raw) if raw else None
        query: dict[str, Any] = {}
        for key, value in request.url.params.multi_items():
            query.setdefault(key, []).append(value)
        flat = {k: v if len(v) > 1 else v[0] for k, v in query.items()}
        self.requests.append((request.method, request.url.path, flat, body))
        if isinstance(body, dict) and body.get("stream"):
            events = [_answer(request.url.path, body), "[DONE]"]
            sse = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=_answer(request.url.path, body))


def _check(
    engine: str, requests: list[Recorded], backend: str = "nccl", version: str | None = None
) -> None:
    contract = load_contract(engine, version)  # type: ignore[arg-type]
    assert requests, "the call sent no request"
    for method, path, query, body in requests:
        problems = contract.check_request(method, path, query=query, body=body, backend=backend)
        assert not problems, f"{method} {path} {body!r}: {[str(p) for p in problems]}"


SGLANG_CALLS: dict[str, Callable[[SGLangClient], object]] = {
    "health": lambda c: c.health(),
    "health_generate": lambda c: c.health_generate(),
    "generate_ids": lambda c: c.generate([1, 2, 3], sampling_params={"max_new_tokens": 4}),
    "generate_text": lambda c: c.generate(
        text="hi", sampling_params={"temperature": 0.0, "sampling_seed": 3, "top_k": 5}
    ),
    "generate_stream": lambda c: list(
        c.generate_stream([1, 2, 3], sampling_params={"max_new_tokens": 4, "sampling_seed": 7})
    ),
    "pause_abort": lambda c: c.pause_generation("abort"),
    "pause_retract": lambda c: c.pause_generation("retract"),
    "pause_in_place": lambda c: c.pause_generation("in_place"),
    "continue": lambda c: c.continue_generation(),
    "flush_cache": lambda c: c.flush_cache(),
    "release_all": lambda c: c.release_memory_occupation(),
    "release_weights": lambda c: c.release_memory_occupation(["weights"]),
    "resume_kv": lambda c: c.resume_memory_occupation(["kv_cache"]),
    "disk": lambda c: c.update_weights_from_disk("/m", weight_version="3"),
    "disk_abort": lambda c: c.update_weights_from_disk(
        "/m", load_format="safetensors", abort_all_requests=True
    ),
    "tensor_bucket": lambda c: c.update_weights_from_tensor(
        ["AAAA"], load_format="flattened_bucket", weight_version="3"
    ),
    "tensor_plain": lambda c: c.update_weights_from_tensor(["AAAA", "BBBB"], flush_cache=False),
    "init_group": lambda c: c.init_weights_update_group("127.0.0.1", 29500, 1, 2, backend="gloo"),
    "dist_flat": lambda c: c.update_weights_from_distributed(
        ["w"], ["bfloat16"], [[2, 3]], load_format="flattened_bucket", weight_version="3"
    ),
    "dist_plain": lambda c: c.update_weights_from_distributed(["w"], ["float32"], [[4]]),
    "destroy_group": lambda c: c.destroy_weights_update_group(),
    "ipc": lambda c: c.update_weights_from_ipc({"GPU-0": "ipc:///tmp/s"}, weight_version="3"),
    "get_by_name": lambda c: c.get_weights_by_name("w"),
    "checksum": lambda c: c.weights_checksum(),
    "weight_version": lambda c: c.weight_version(),
}

VLLM_CALLS: dict[str, Callable[[VLLMClient], object]] = {
    "health": lambda c: c.health(),
    "generate_ids": lambda c: c.generate(
        [1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 0.0, "sampling_seed": 1}
    ),
    "generate_text": lambda c: c.generate(text="hi", sampling_params={"min_new_tokens": 1}),
    "generate_stream": lambda c: list(
        c.generate_stream(
            [1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 0.0, "seed": 2}
        )
    ),
    "pause_abort": lambda c: c.pause_generation("abort"),
    "pause_retract": lambda c: c.pause_generation("retract"),
    "pause_in_place": lambda c: c.pause_generation("in_place"),
    "continue": lambda c: c.continue_generation(),
    "flush_cache": lambda c: c.flush_cache(),
    "is_sleeping": lambda c: c.is_sleeping(),
    "release": lambda c: c.release_memory_occupation(),
    "resume": lambda c: c.resume_memory_occupation(),
    "resume_weights": lambda c: c.resume_memory_occupation(["weights"]),
    "disk": lambda c: c.update_weights_from_disk("/m", weight_version="3"),
    "disk_abort": lambda c: c.update_weights_from_disk("/m", abort_all_requests=True),
    "init_group": lambda c: c.init_weights_update_group(
        "127.0.0.1", 29500, 1, 2, packed_buffer_size_bytes=1 << 20
    ),
    "init_unpacked": lambda c: c.init_weights_update_group("127.0.0.1", 29500, 1, 2, packed=False),
    "dist_one_call": lambda c: c.update_weights_from_distributed(
        ["w"], ["bfloat16"], [[2, 3]], weight_version="3"
    ),
    "destroy_group": lambda c: c.destroy_weights_update_group(),
    "ipc": lambda c: c.update_weights_from_ipc({"GPU-0": "ipc:///tmp/s"}, weight_version="3"),
    "version": lambda c: c.update_weight_version("4"),
    "checksum": lambda c: c.weights_checksum(),
    "weight_version": lambda c: c.weight_version(),
}


SGLANG_VERSIONS = ("0.5.16", "0.5.23")


@pytest.mark.parametrize("version", SGLANG_VERSIONS)
@pytest.mark.parametrize("name", sorted(SGLANG_CALLS))
def test_sglang_client_requests_match_each_sglang_release(name: str, version: str) -> None:
    rec = Recorder(sglang=version)
    with SGLangClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
        SGLANG_CALLS[name](client)
        if name.startswith("generate"):
            assert client.server_dialect().version == version
    _check("sglang", rec.requests, version=version)


def test_sglang_0_5_16_unknown_sampling_keys_are_refused_by_the_client() -> None:
    """SGLang 0.5.16 has no contract gate: an unknown sampling key is a TypeError its
    ``/generate`` does not catch (a 500, which the router would count against the engine). The
    client refuses it with the 400 that 0.5.23 answers, nothing sent; 0.5.23 gets the request
    and answers for itself."""
    for version, refused in (("0.5.16", True), ("0.5.23", False)):
        rec = Recorder(sglang=version)
        with SGLangClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
            bad = {"max_new_tokens": 2, "temprature": 0.5}
            for call in (
                lambda c=client, b=bad: c.generate([1, 2], sampling_params=b),
                lambda c=client, b=bad: list(c.generate_stream([1, 2], sampling_params=b)),
            ):
                if refused:
                    with pytest.raises(EngineRequestError) as info:
                        call()
                    assert info.value.status_code == 400 and "'temprature'" in info.value.message
                else:
                    call()  # the recorder answers 200; a real 0.5.23 answers 400 itself
            sent = [p for _, p, _, _ in rec.requests if p == "/generate"]
        assert len(sent) == (0 if refused else 2), version
        dialect = client.server_dialect()
        assert dialect.version == version and dialect.weight_version_spans is (not refused)


def test_sglang_dialect_comes_from_server_info_once() -> None:
    """``/server_info`` reports the release; a server without it (404) is asked
    ``/get_server_info``; no version at all speaks the pinned 0.5.23; a release no contract
    speaks is named; a pin asks nothing."""
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path == "/server_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"version": "0.5.16.post1"})
        return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": {}})

    with SGLangClient("http://engine", transport=httpx.MockTransport(handler)) as client:
        for _ in range(3):
            client.generate([1], sampling_params={"max_new_tokens": 1})
        assert client.server_dialect().version == "0.5.16"
    assert paths.count("/server_info") == paths.count("/get_server_info") == 1
    rec = Recorder(sglang="0.5.19")
    with (
        SGLangClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client,
        pytest.raises(EngineNotSupported, match="no supported release"),
    ):
        client.server_dialect()
    rec = Recorder(sglang="0.5.16")
    with SGLangClient(
        "http://engine", transport=httpx.MockTransport(rec.handler), server_version="0.5.23"
    ) as client:
        client.generate([1], sampling_params={"max_new_tokens": 1, "temprature": 1.0})
    assert [p for _, p, _, _ in rec.requests] == ["/generate"]


@pytest.mark.parametrize("version", VLLM_VERSIONS)
@pytest.mark.parametrize("name", sorted(VLLM_CALLS))
def test_vllm_client_requests_match_each_vllm_release(name: str, version: str) -> None:
    rec = Recorder(version)
    with VLLMClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
        if version == "0.26.0" and name == "checksum":  # no checker: the probe's job
            with pytest.raises(NoWeightChecker, match=r"rollsafe\.probe"):
                VLLM_CALLS[name](client)
        else:
            VLLM_CALLS[name](client)
    assert not ABSENT_IN_0_26 & {p for _, p, _, _ in rec.requests} or version != "0.26.0"
    _check("vllm", rec.requests, version=version)


def test_vllm_update_lifecycle_is_one_start_many_updates_one_finish() -> None:
    """The nccl transport sends one call per bucket, the version with the last: the client
    maps that onto vLLM's start -> update x N -> finish(version) -> reset_prefix_cache."""
    rec = Recorder()
    with VLLMClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
        client.init_weights_update_group("127.0.0.1", 29500, 1, 2)
        for i in range(3):
            client.update_weights_from_distributed(
                [f"w{i}"], ["float32"], [[4]], weight_version="7" if i == 2 else None
            )
        client.update_weights_from_distributed(["w0"], ["float32"], [[4]], weight_version="8")
    paths = [p for _, p, _, _ in rec.requests if p != "/version"]  # the dialect, asked once
    assert paths == [
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/update_weights",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
    ]
    finishes = [b for _, p, _, b in rec.requests if p == "/finish_weight_update"]
    assert finishes == [{"weight_version": "7"}, {"weight_version": "8"}]
    bodies = [b for _, p, _, b in rec.requests if p != "/version"]
    init = bodies[0]["init_info"]
    assert init["packed"] is True and "packed" not in bodies[2]["update_info"]
    _check("vllm", rec.requests)


def test_vllm_failed_update_leaves_update_mode_without_a_version() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "peer gone"})
        return httpx.Response(200, json={"message": "ok"})

    with VLLMClient("http://engine", transport=httpx.MockTransport(handler), retry=None) as c:
        with pytest.raises(Exception, match="500"):
            c.update_weights_from_distributed(["w"], ["float32"], [[4]], weight_version="9")
        assert [c for c in calls if c != "/version"] == [
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
        ]


def test_vllm_group_calls_take_only_the_fixed_group_name() -> None:
    """vLLM's group has no name (init_info carries none), so its ranks join rollsafe's
    rendezvous under VLLM_WEIGHT_TRANSFER_GROUP: a call naming another group (a trainer that
    joined under its own name, which would wait out the rendezvous timeout) is refused before
    anything is sent; the fixed name (the default) is not sent either."""
    from rollsafe.wire.group_names import VLLM_WEIGHT_TRANSFER_GROUP, join_name

    assert join_name("vllm", "rollsafe-1") == VLLM_WEIGHT_TRANSFER_GROUP
    assert join_name("sglang", "rollsafe-1") == "rollsafe-1"
    rec = Recorder()
    with VLLMClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
        for call in (
            lambda: client.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g"),
            lambda: client.update_weights_from_distributed(
                ["w"], ["float32"], [[4]], group_name="weight_update_group"
            ),
            lambda: client.destroy_weights_update_group("g"),
        ):
            with pytest.raises(EngineNotSupported, match=VLLM_WEIGHT_TRANSFER_GROUP):
                call()
        assert rec.requests == []
        client.init_weights_update_group(
            "127.0.0.1", 29500, 1, 2, group_name=VLLM_WEIGHT_TRANSFER_GROUP
        )
    assert [p for _, p, _, _ in rec.requests] == ["/version", "/init_weight_transfer_engine"]
    assert VLLM_WEIGHT_TRANSFER_GROUP not in json.dumps(rec.requests[1][3])
    _check("vllm", rec.requests)


def test_vllm_has_no_update_weights_from_tensor() -> None:
    rec = Recorder()
    with VLLMClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
        with pytest.raises(EngineNotSupported, match="nccl"):
            client.update_weights_from_tensor(["AAAA"])
        with pytest.raises(EngineNotSupported, match="load format"):
            client.update_weights_from_disk("/m", load_format="safetensors")
    assert rec.requests == []


def test_vllm_0_26_update_lifecycle_packs_every_call_and_keeps_the_version() -> None:
    """vLLM 0.26.0: packing travels in every ``update_info`` (its ``init_info`` has none),
    ``/finish_weight_update`` takes no body, and the version is the client's label (no
    ``/update_weight_version``, no ``/weight_info``): completions report it."""
    rec = Recorder("0.26.0")
    with VLLMClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
        assert client.weight_version() is None  # nothing known yet, nothing asked
        client.init_weights_update_group("127.0.0.1", 29500, 1, 2, packed_buffer_size_bytes=64)
        for i in range(2):
            client.update_weights_from_distributed(
                [f"w{i}"], ["float32"], [[4]], weight_version="7" if i == 1 else None
            )
        assert client.weight_version() == "7"
        result = client.generate([1, 2], sampling_params={"max_new_tokens": 2})
        assert result.weight_version == "7"
        assert result.meta_info["weight_version_source"] == "client"
        assert result.meta_info["weight_version_exact"] is True
        client.update_weight_version("8")  # a label: nothing sent
        assert client.weight_version() == "8"
        assert "vLLM 0.26.0" in client.destroy_weights_update_group()  # nothing to send
    paths = [p for _, p, _, _ in rec.requests]
    assert paths == [
        "/version",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/v1/completions",
    ]
    bodies = {p: b for _, p, _, b in rec.requests}
    assert "packed" not in bodies["/init_weight_transfer_engine"]["init_info"]
    updates = [b["update_info"] for _, p, _, b in rec.requests if p == "/update_weights"]
    assert all(u["packed"] is True and u["packed_buffer_size_bytes"] == 64 for u in updates)
    assert bodies["/finish_weight_update"] is None
    assert "return_weight_versions" not in bodies["/v1/completions"]
    _check("vllm", rec.requests, version="0.26.0")


def test_vllm_0_26_failed_update_forgets_the_version() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.26.0"})
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "peer gone"})
        return httpx.Response(200, json={"message": "ok"})

    with VLLMClient("http://engine", transport=httpx.MockTransport(handler), retry=None) as c:
        c.update_weight_version("3")
        with pytest.raises(Exception, match="500"):
            c.update_weights_from_distributed(["w"], ["float32"], [[4]], weight_version="4")
        assert c.weight_version() is None  # the weights are unknown now


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_vllm_weight_updates_are_refused_while_the_weights_sleep(version: str) -> None:
    """vLLM 0.26.0 crashes on a weight update while asleep (vllm#57853): the client refuses
    one, whatever the release, from its own ``/sleep`` (level >= 1) until the weights are woken,
    before anything is sent; level 0 (scheduling only) and a woken engine let it through."""
    rec = Recorder(version)
    with VLLMClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client:
        client.release_memory_occupation(level=2)
        sent = len(rec.requests)
        for call in (
            lambda: client.update_weights_from_distributed(["w"], ["float32"], [[4]]),
            lambda: client.update_weights_from_disk("/m", weight_version="3"),
            lambda: client.update_weights_from_ipc({"GPU-0": "ipc:///tmp/s"}),
            lambda: client.collective_rpc("reload_weights", kwargs={"weights_path": "/m"}),
        ):
            with pytest.raises(EngineAsleep, match="level 2"):
                call()
        assert len(rec.requests) == sent and client.asleep_level == 2
        client.resume_memory_occupation(["kv_cache"])  # the weights still sleep
        with pytest.raises(EngineAsleep):
            client.update_weights_from_disk("/m")
        client.resume_memory_occupation(["weights"])
        client.update_weights_from_disk("/m", weight_version="3")
        client.release_memory_occupation(level=0)
        client.update_weights_from_disk("/m", weight_version="4")
        with pytest.raises(InvalidArgument, match="levels"):
            client.release_memory_occupation(level=3)
    sleeps = [q for _, p, q, _ in rec.requests if p == "/sleep"]
    assert sleeps == [{"level": "2"}, {"level": "0"}]
    _check("vllm", rec.requests, version=version)


def test_a_server_between_supported_releases_is_refused_by_name() -> None:
    """A 0.28 server (between supported releases) is refused by name, nothing else asked."""
    rec = Recorder("0.28.1")
    with (
        VLLMClient("http://engine", transport=httpx.MockTransport(rec.handler)) as client,
        pytest.raises(EngineNotSupported, match="no supported release"),
    ):
        client.generate([1], sampling_params={"max_new_tokens": 1})
    assert [p for _, p, _, _ in rec.requests] == ["/version"]


def test_contract_check_catches_what_the_old_clients_sent() -> None:
    """The requests rollsafe sent before it was pinned to upstream fail the same check."""
    vllm = load_contract("vllm")
    old_update = {
        "update_info": {
            "names": ["w"],
            "dtype_names": ["float32"],
            "shapes": [[4]],
            "packed": True,
            "weight_version": "3",
        }
    }
    where = {p.where for p in vllm.check_request("POST", "/update_weights", body=old_update)}
    assert {"update_info.packed", "update_info.weight_version"} <= where
    assert vllm.check_request("POST", "/start_weight_update", body={"is_checkpoint_format": True})
    assert vllm.check_request("GET", "/weights_checksum")
    sglang = load_contract("sglang")
    assert sglang.check_request("GET", "/weights_checksum")
    bad = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}}
    assert [p.where for p in sglang.check_request("POST", "/generate", body=bad)] == [
        "sampling_params.temprature"
    ]


@pytest.mark.parametrize(
    ("answer", "serves"),
    [("0.26.0", False), ("0.32.0+cpu", True), ("0.33.0", True), (None, True)],
)
def test_the_launcher_sets_a_start_version_only_where_the_release_keeps_one(
    answer: str | None, serves: bool
) -> None:
    """A real vLLM takes no weight version at start: the launcher posts
    ``/update_weight_version`` once it is ready, except on 0.26.0, which has no such route
    (its ``VLLMClient`` keeps the label instead); a server that does not say which release it
    is gets the post."""
    import time

    from rollsafe.adapters.engines.launch.readiness import _serves_weight_version

    def handler(request: httpx.Request) -> httpx.Response:
        if answer is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json={"version": answer})

    with httpx.Client(base_url="http://engine", transport=httpx.MockTransport(handler)) as http:
        assert _serves_weight_version(http, time.monotonic() + 5) is serves
