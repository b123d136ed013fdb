"""The rollout gateway in front of a real fleet (two reference-engine groups, each dialect):
the clients RL frameworks use, unchanged, across a SIGKILL of the serving engine and a weight
sync mid-stream: 0 failed requests, tokens equal to an uncut greedy run, every token's version.

Clients: the ``openai`` SDK (sync, async, streaming; completions and chat), ``httpx`` posting
SGLang's ``/generate`` as slime's rollout does, ``requests`` posting it whole as AReaL does, and
a multi-turn agent loop (chat turns with tool messages, one session).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import requests
from engine_helpers import tiny_model_dir  # noqa: F401

from rollsafe import FleetConfig, GroupSpec, RolloutFleet
from rollsafe.adapters.engines import EngineSpec
from rollsafe.gateway import GatewaySettings

KEY = "rollsafe-test-key"
PROMPT = [1, 2, 3, 4]
TOKENS = 96
KILL_AT = 24
GREEDY = {"temperature": 0.0, "max_tokens": TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def fleet(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RolloutFleet]:
    dialect = request.param
    config = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path_factory.mktemp(f"gw-{dialect}") / "exports",
        groups=[GroupSpec(1), GroupSpec(1)],
        engine=EngineSpec(model_path=str(tiny_model_dir), dialect=dialect),
        transport="nccl" if dialect == "vllm" else "ipc",
        request_timeout_s=60.0,
        gateway=GatewaySettings(api_key=KEY, wait_for_routable_s=120.0),
    )
    with RolloutFleet(config) as running:
        yield running


#: engines a test killed: (group, its rank pids then); the next test waits for them back
KILLED: list[tuple[str, tuple[int, ...]]] = []


@pytest.fixture
def ready(fleet: RolloutFleet) -> Iterator[RolloutFleet]:
    """The module's fleet with every group active at the fleet's version on a live engine (a
    group a test killed is detected, restarted and, when it came back behind the fleet's
    version, synced), no crash hook left behind."""
    _settle(fleet)
    yield fleet
    fleet.router.on_progress = None


def _settle(fleet: RolloutFleet, timeout: float = 240.0) -> None:
    while KILLED:
        gid, pids = KILLED.pop()
        _until(lambda gid=gid, pids=pids: _pids(fleet, gid) not in ((), pids), timeout)
    assert fleet.wait_recoveries(timeout=timeout)
    _until(
        lambda: all(g.state in ("active", "pending_weights") for g in fleet.registry.groups()),
        timeout,
    )
    if any(g.state == "pending_weights" for g in fleet.registry.groups()):
        # restarted from no export (none before the first sync): the next sync brings it in
        fleet.sync_weights(_weights(fleet), fleet.registry.fleet_version + 1)
    _until(lambda: all(g.state == "active" for g in fleet.registry.groups()), timeout)


def _pids(fleet: RolloutFleet, gid: str) -> tuple[int, ...]:
    """The group's engine's rank pids, () while it is stopped (being restarted)."""
    try:
        return tuple(fleet.launcher(gid).rank_pids)
    except RuntimeError:
        return ()


def _until(done: Callable[[], bool], timeout: float) -> None:
    for _ in range(int(timeout / 0.1)):
        if done():
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"not reached in {timeout} s")


def _weights(fleet: RolloutFleet) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fleet.config.model_path))
    return {n: p.detach() for n, p in model.named_parameters()}


def _sdk(fleet: RolloutFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key=KEY, max_retries=0)


def _kill_when(fleet: RolloutFleet, at: int = KILL_AT) -> dict[str, int]:
    """SIGKILL the engine of the group serving the next request once it streamed ``at``
    tokens; the returned dict names the victim."""
    killed: dict[str, int] = {}

    def progress(gid: str, n: int) -> None:
        if n >= at and not killed:
            killed[gid] = n
            pids = tuple(fleet.launcher(gid).rank_pids)
            KILLED.append((gid, pids))
            for pid in pids:
                os.kill(pid, signal.SIGKILL)

    fleet.router.on_progress = progress
    return killed


def _reference(fleet: RolloutFleet) -> list[int]:
    """The uncut greedy run's tokens (same weights), straight through the fleet."""
    out = fleet.generate(
        PROMPT, sampling_params={"max_new_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
    )
    assert len(out.output_ids) == TOKENS
    return out.output_ids


def _segments_cover(segments: list[dict[str, Any]], n: int) -> None:
    """Every token's version is reported: contiguous segments over [0, n), each versioned."""
    assert segments[0]["token_range"][0] == 0 and segments[-1]["token_range"][1] == n
    for a, b in itertools.pairwise(segments):
        assert a["token_range"][1] == b["token_range"][0]
    assert all(s["weights_version"] is not None for s in segments)


# -- each client across a SIGKILL of the engine serving it ------------------------------------
def _sdk_completion_stream(fleet: RolloutFleet) -> tuple[list[int], list[dict[str, Any]]]:
    stream = _sdk(fleet).completions.create(
        model="m", prompt=PROMPT, stream=True, **_with_token_ids(GREEDY)
    )
    ids: list[int] = []
    segments: list[dict[str, Any]] = []
    for chunk in stream:
        choice = chunk.choices[0]
        extra = choice.model_extra or {}
        ids += extra.get("token_ids") or []
        if choice.finish_reason is not None:
            segments = extra["rollsafe"]["segments"]
            assert choice.finish_reason == "length"
    return ids, segments


def _sdk_chat_stream(fleet: RolloutFleet) -> tuple[list[int], list[dict[str, Any]]]:
    stream = _sdk(fleet).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "The rollout engine"}],
        stream=True,
        **_with_token_ids(GREEDY),
    )
    ids: list[int] = []
    segments: list[dict[str, Any]] = []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        extra = choice.model_extra or {}
        ids += extra.get("token_ids") or []
        if choice.finish_reason is not None:
            segments = extra["rollsafe"]["segments"]
    return ids, segments


def _slime_generate_stream(fleet: RolloutFleet) -> tuple[list[int], list[dict[str, Any]]]:
    """As slime's rollout posts to its SGLang router: token ids, sampling_params, stream."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    last: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{fleet.gateway_url}/generate", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["x-rollsafe-group"] in ("g0", "g1")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                assert "error" not in last, last
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert len(meta["output_token_logprobs"]) == TOKENS
    return last["output_ids"], meta["rollsafe"]["segments"]


def _areal_generate_whole(fleet: RolloutFleet) -> tuple[list[int], list[dict[str, Any]]]:
    """As AReaL's remote SGLang engine posts: ``/generate`` whole, with a session header."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "frequency_penalty": 0.0,
        },
        "return_logprob": True,
    }
    headers = {"Authorization": f"Bearer {KEY}", "x-session-id": "areal-1"}
    r = requests.post(f"{fleet.gateway_url}/generate", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["rollsafe"]["segments"]


def _with_token_ids(kw: dict[str, Any]) -> dict[str, Any]:
    extra = {**kw["extra_body"], "return_token_ids": True}
    return {**kw, "extra_body": extra}


CLIENTS: dict[str, Callable[[RolloutFleet], tuple[list[int], list[dict[str, Any]]]]] = {
    "openai-completions-stream": _sdk_completion_stream,
    "openai-chat-stream": _sdk_chat_stream,
    "slime-generate-stream": _slime_generate_stream,
    "areal-generate-whole": _areal_generate_whole,
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_request_survives_a_sigkill_of_its_engine(ready: RolloutFleet, client: str) -> None:
    fleet = ready
    call = CLIENTS[client]
    uncut, _ = call(fleet)  # the same client's uncut run
    assert len(uncut) == TOKENS
    killed = _kill_when(fleet)
    ids, segments = call(fleet)
    fleet.router.on_progress = None
    assert killed, "the generation finished before the kill"
    assert ids == uncut  # nothing lost, nothing repeated
    (victim,) = killed
    assert segments[0]["group"] == victim and segments[0]["ended"] == "failed"
    assert segments[-1]["group"] != victim and segments[-1]["ended"] == "finished"
    _segments_cover(segments, TOKENS)


def test_the_openai_sdk_reads_the_same_tokens_as_the_fleet(ready: RolloutFleet) -> None:
    fleet = ready
    uncut = _reference(fleet)
    sdk = _sdk(fleet)
    raw = sdk.completions.with_raw_response.create(
        model="m", prompt=PROMPT, **_with_token_ids(GREEDY)
    )
    assert raw.headers["x-rollsafe-group"] in ("g0", "g1")
    whole = raw.parse()
    assert (whole.choices[0].model_extra or {})["token_ids"] == uncut
    assert whole.usage is not None and whole.usage.completion_tokens == TOKENS

    async def async_client() -> tuple[list[int], str]:
        client = openai.AsyncOpenAI(base_url=f"{fleet.gateway_url}/v1", api_key=KEY)
        try:
            one = await client.completions.create(
                model="m", prompt=PROMPT, **_with_token_ids(GREEDY)
            )
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Hello world!"}],
                stream=True,
                temperature=0.0,
                max_tokens=12,
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        finally:
            await client.close()
        return (one.choices[0].model_extra or {})["token_ids"], text

    ids, streamed_text = asyncio.run(async_client())
    assert ids == uncut
    whole_chat = sdk.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hello world!"}],
        temperature=0.0,
        max_tokens=12,
    )
    assert whole_chat.choices[0].message.content == streamed_text
    models = sdk.models.list()
    assert [m.id for m in models.data] == [Path(fleet.config.model_path or "").name]


def test_a_sync_mid_stream_continues_on_the_new_weights(ready: RolloutFleet) -> None:
    """A sync (abort mode) during a stream: the stream goes on from its last token on version
    1 (the same values, so greedy tokens are the uncut run's) and says which tokens were
    version 0 and which version 1."""
    fleet = ready
    uncut = _reference(fleet)
    weights = _weights(fleet)
    version = fleet.registry.fleet_version + 1
    reached = threading.Event()
    fleet.router.on_progress = lambda gid, n: reached.set() if n >= KILL_AT else None
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", _slime_generate_stream(fleet)))
    worker.start()
    assert reached.wait(120)
    report = fleet.sync_weights(weights, version, pause_mode="abort")
    worker.join(120)
    fleet.router.on_progress = None
    assert report.ok
    ids, segments = box["out"]
    assert ids == uncut
    versions = [s["weights_version"] for s in segments]
    assert versions[0] == str(version - 1) and versions[-1] == str(version)
    _segments_cover(segments, TOKENS)


def test_an_agent_loop_keeps_its_tokens_across_turns_and_a_crash(ready: RolloutFleet) -> None:
    """Three chat turns with tool messages in one session: each turn's prompt begins with the
    previous turn's prompt and output ids exactly as served (nothing re-tokenized), the
    session stays on one group until that group is killed mid-turn, and no turn fails."""
    fleet = ready
    sdk = _sdk(fleet)
    session = {"x-session-id": "agent-1"}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a rollout agent with a calculator tool."},
        {"role": "user", "content": "Add 1 and 2, then 3."},
    ]
    previous: list[int] = []
    groups: list[str] = []
    for turn in range(3):
        if turn == 1:
            killed = _kill_when(fleet, at=8)
        raw = sdk.chat.completions.with_raw_response.create(
            model="m",
            messages=messages,
            temperature=0.0,
            max_tokens=24,
            extra_headers=session,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        answer = raw.parse()
        fleet.router.on_progress = None
        groups.append(raw.headers["x-rollsafe-group"])
        choice = answer.choices[0]
        extra = choice.model_extra or {}
        # vLLM 0.33's chat answer: the prompt's ids at the top level, the output's per choice
        prompt_ids, output_ids = (answer.model_extra or {})["prompt_token_ids"], extra["token_ids"]
        assert len(output_ids) == 24
        if previous:
            assert prompt_ids[: len(previous)] == previous  # earlier turns as served
        previous = prompt_ids + output_ids
        reply = choice.message.content or ""
        messages += [
            {"role": "assistant", "content": reply},
            {
                "role": "tool",
                "content": json.dumps({"result": 3 + 3 * turn}),
                "tool_call_id": f"c{turn}",
            },
            {"role": "user", "content": "And now add 3 more."},
        ]
        if turn == 1:
            assert killed, "turn 2 finished before the kill"
    assert fleet.gateway is not None
    assert fleet.gateway.counters.session_reused == 2
    assert fleet.gateway.counters.session_retokenized == 0
    (victim,) = killed
    assert groups[0] == groups[1] == victim  # the session stayed on its group...
    assert groups[2] != victim  # ...until that group was killed


BAD: list[tuple[str, Any, str]] = [
    ("/v1/completions", b"{not json", "body"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 999}, "n"),
    ("/v1/completions", {"prompt": [1] * 5000, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
    ),
    ("/generate", {"input_ids": [1, -2], "sampling_params": {}}, "input_ids"),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 7}}, "sampling_params.top_p"),
]


@pytest.mark.parametrize(("route", "body", "field"), BAD, ids=[f"{r}:{f}" for r, _, f in BAD])
def test_bad_input_is_a_400_naming_the_field_and_reaches_no_engine(
    ready: RolloutFleet, route: str, body: Any, field: str
) -> None:
    fleet = ready
    before = fleet.registry.dispatch_counts()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{fleet.gateway_url}{route}", content=data, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"]
    if route != "/generate":
        assert error["param"] == field
    assert fleet.registry.dispatch_counts() == before  # nothing was sent to an engine


def test_the_key_health_metrics_and_the_served_group(ready: RolloutFleet) -> None:
    fleet = ready
    url = fleet.gateway_url
    assert httpx.get(f"{url}/v1/models").status_code == 401  # no key
    assert (
        httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    )
    health = httpx.get(f"{url}/health")  # the only route without the key
    assert health.status_code == 200 and sorted(health.json()["routable"]) == ["g0", "g1"]
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert metrics.status_code == 200
    assert 'rollsafe_gateway_requests_total{route="/health",status="200"}' in metrics.text
    assert "rollsafe_" in metrics.text.split("rollsafe_gateway", 1)[0]  # the fleet's own
