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
import time
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
        engine=EngineSpec(model_path=str(tiny_model_dir), dialect=dialect, fault_injection=True),
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
    version, synced), no crash hook or stall left behind."""
    _settle(fleet)
    _stall(fleet, None)
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


def _stall(fleet: RolloutFleet, after_tokens: int | None) -> None:
    """Arm (``None``: disarm) the reference engines' one-shot stall on every group (``POST
    /fault/stall``): the next generation to reach ``after_tokens`` tokens makes no more until
    it is aborted or its engine dies. The tiny engine makes a whole answer in a fraction of a
    second, and a loaded test process reads it in bursts far behind: without the stall a sync
    started when the reader saw ``KILL_AT`` tokens can find the generation over."""
    for group in fleet.registry.groups():
        r = httpx.post(
            f"{fleet.launcher(group.group_id).url}/fault/stall",
            json={"after_tokens": after_tokens},
            timeout=30,
        )
        assert r.status_code == 200, r.text


def _sdk(fleet: RolloutFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key=KEY, max_retries=0)


def _kill_when(fleet: RolloutFleet, at: int = KILL_AT) -> dict[str, int]:
    """SIGKILL the engine of the group serving the next request once it streamed ``at``
    tokens (its engine held at ``at + 1``: :func:`_stall`, disarmed before the kill so the
    continuation runs free); the returned dict names the victim."""
    killed: dict[str, int] = {}

    def progress(gid: str, n: int) -> None:
        if n >= at and not killed:
            killed[gid] = n
            _stall(fleet, None)
            pids = tuple(fleet.launcher(gid).rank_pids)
            KILLED.append((gid, pids))
            for pid in pids:
                os.kill(pid, signal.SIGKILL)

    _stall(fleet, at + 1)
    fleet.router.on_progress = progress
    return killed


def _kill_on_dispatch(fleet: RolloutFleet, at: int) -> tuple[dict[str, int], threading.Thread]:
    """SIGKILL the engine of the group that takes the next request, while it holds it: every
    engine is armed to stall at ``at`` tokens (so the request cannot finish first), the other
    engines are disarmed once the group is seen with the request (the request sent again runs
    free). For requests read whole (``Router.whole_up_to``): no progress comes before the
    answer. The returned dict names the victim once it is killed."""
    killed: dict[str, int] = {}
    _stall(fleet, at)

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            busy = [g.group_id for g in fleet.registry.groups() if g.outstanding > 0]
            if busy:
                victim = busy[0]
                for group in fleet.registry.groups():
                    if group.group_id != victim:
                        httpx.post(
                            f"{fleet.launcher(group.group_id).url}/fault/stall",
                            json={"after_tokens": None},
                            timeout=30,
                        ).raise_for_status()
                pids = tuple(fleet.launcher(victim).rank_pids)
                KILLED.append((victim, pids))
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed[victim] = at
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, name="kill-on-dispatch", daemon=True)
    watcher.start()
    return killed, watcher


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
    # the serving engine holds the stream at KILL_AT + 1 tokens (its newest is sent with the
    # next event, so the reader sees KILL_AT): the sync's pause finds it mid-generation
    _stall(fleet, KILL_AT + 1)
    try:
        worker.start()
        assert reached.wait(120)
    finally:
        _stall(fleet, None)  # the continuation runs free; the stalled generation stays held
    report = fleet.sync_weights(weights, version, pause_mode="abort")
    worker.join(120)
    fleet.router.on_progress = None
    assert report.ok
    ids, segments = box["out"]
    assert ids == uncut
    assert segments[0]["token_range"] == [0, KILL_AT + 1] and segments[0]["ended"] == "aborted"
    versions = [s["weights_version"] for s in segments]
    assert versions[0] == str(version - 1) and versions[-1] == str(version)
    _segments_cover(segments, TOKENS)


def _stalled(fleet: RolloutFleet) -> int:
    """Generations the reference engines' stall holds or held so far (``GET /fault/stall``)."""
    total = 0
    for group in fleet.registry.groups():
        r = httpx.get(f"{fleet.launcher(group.group_id).url}/fault/stall", timeout=30)
        assert r.status_code == 200, r.text
        total += int(r.json()["stalled"])
    return total


def test_a_sync_during_a_short_answer_read_whole_continues_from_its_aborted_tokens(
    ready: RolloutFleet,
) -> None:
    """A short ``/generate`` (24 tokens: read from its engine whole, ``Router.whole_up_to``)
    held by its engine at 10 tokens when a sync pauses it in ``abort`` mode: the aborted
    answer carries those 10 tokens and the request goes on from them on the new version (the
    same values, so greedy tokens are the uncut run's), its segments naming which tokens were
    the old version's."""
    fleet = ready
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    uncut = fleet.generate(PROMPT, sampling_params=params).output_ids
    weights = _weights(fleet)
    version = fleet.registry.fleet_version + 1
    whole_before = fleet.router.stats()["continuation"]["whole"]
    stalled_before = _stalled(fleet)
    box: dict[str, Any] = {}
    body = {"input_ids": PROMPT, "sampling_params": params}
    headers = {"Authorization": f"Bearer {KEY}"}
    worker = threading.Thread(
        target=lambda: box.setdefault(
            "r",
            requests.post(f"{fleet.gateway_url}/generate", json=body, headers=headers, timeout=120),
        )
    )
    _stall(fleet, 10)
    try:
        worker.start()
        deadline = time.monotonic() + 120
        while _stalled(fleet) == stalled_before:  # the engine holds it at 10 tokens
            assert time.monotonic() < deadline, "no generation reached the stall"
            time.sleep(0.02)
    finally:
        _stall(fleet, None)  # the continuation runs free; the stalled generation stays held
    report = fleet.sync_weights(weights, version, pause_mode="abort")
    worker.join(120)
    assert report.ok
    r = box["r"]
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == uncut
    segments = out["meta_info"]["rollsafe"]["segments"]
    assert segments[0]["token_range"] == [0, 10] and segments[0]["ended"] == "aborted"
    versions = [s["weights_version"] for s in segments]
    assert versions[0] == str(version - 1) and versions[-1] == str(version)
    _segments_cover(segments, 24)
    assert fleet.router.stats()["continuation"]["whole"] == whole_before + 1


def test_an_agent_loop_keeps_its_tokens_across_turns_and_a_crash(ready: RolloutFleet) -> None:
    """Three chat turns with tool messages in one session: each turn's prompt begins with the
    previous turn's prompt and output ids exactly as served (nothing re-tokenized), the
    session stays on one group until that group is killed mid-turn, and no turn fails. A
    turn of 24 tokens is read from its engine whole (``Router.whole_up_to``, 64): the killed
    turn is sent again whole to the other group (``whole_lost``), its output still 24 tokens
    and served ids."""
    fleet = ready
    lost_before = fleet.router.stats()["continuation"]["whole_lost"]
    watcher: threading.Thread | None = None
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
            killed, watcher = _kill_on_dispatch(fleet, at=9)
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
            assert watcher is not None
            watcher.join(5)
            assert killed, "turn 2 finished before the kill"
    assert fleet.router.stats()["continuation"]["whole_lost"] == lost_before + 1
    assert fleet.gateway is not None
    assert fleet.gateway.counters.session_reused == 2
    assert fleet.gateway.counters.session_retokenized == 0
    (victim,) = killed
    # the session stayed on its group (turn 2 went there: it was killed holding it)...
    assert groups[0] == victim
    # ...until that group was killed: turn 2's answer, read whole, came from the other group
    # (the header names the group that served the first token) and turn 3 stayed there
    assert groups[1] == groups[2] != victim


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
