"""The gateway's limits against hostile or unlucky clients, over stub engines (zero-work
servers: benchmarks/gateway/stub_engine.py) so the limits, not the model, are what is tested:
requests in flight capped with 503 + Retry-After, a client that disconnects cancels its engine
request, a body past the limit is refused unread, a request waits (bounded) while no group is
routable, and a gateway failure is the request's, never the fleet's."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from stub_helpers import Stub, stub_router

from rollsafe.errors import InvalidArgument
from rollsafe.fleet.dataplane import DataPlane
from rollsafe.gateway.app import Gateway
from rollsafe.gateway.settings import GatewaySettings
from rollsafe.registry import FleetRegistry


@dataclass
class StubFleet:
    """What the gateway needs of a fleet (``GatewayFleet``), over stub engines."""

    data_plane: DataPlane
    registry: FleetRegistry
    metrics: Any = None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gw-limits-model"))


@pytest.fixture
def served(
    tmp_path: Path, model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Gateway, list[Stub], StubFleet]]:
    """A gateway (settings from the test's ``param``) over two stub engines that wait 100 ms
    per token."""
    settings = getattr(request, "param", GatewaySettings())
    stubs = [Stub(tmp_path, 100.0), Stub(tmp_path, 100.0)]
    router = stub_router(stubs, request_timeout_s=30.0)
    plane = DataPlane(router)
    fleet = StubFleet(plane, router.registry)
    gateway = Gateway(fleet, settings, model_path=model_dir)
    gc.unfreeze()  # what GatewaySettings.gc_freeze does is this gateway's alone
    plane.loop_thread.run(gateway.start())
    try:
        yield gateway, stubs, fleet
    finally:
        gc.unfreeze()
        plane.loop_thread.run(gateway.close(1.0))
        plane.close()
        router.close()
        for stub in stubs:
            stub.stop()


def _body(tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": tokens}, "stream": stream}


@pytest.mark.parametrize("served", [GatewaySettings(max_in_flight=4)], indirect=True)
def test_requests_past_the_cap_get_503_with_retry_after(
    served: tuple[Gateway, list[Stub], StubFleet],
) -> None:
    gateway, stubs, _ = served

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(client.post(f"{gateway.url}/generate", json=_body(10)) for _ in range(12))
            )

    answers = asyncio.run(burst())
    codes = sorted(r.status_code for r in answers)
    assert codes.count(200) >= 4 and codes.count(503) >= 1 and set(codes) == {200, 503}
    refused = next(r for r in answers if r.status_code == 503)
    assert refused.headers["retry-after"] == "1"
    served_by_stubs = sum(s.stats()["generate"] for s in stubs)
    assert served_by_stubs == codes.count(200)  # a refused request reached no engine


def test_a_client_that_disconnects_cancels_its_engine_request(
    served: tuple[Gateway, list[Stub], StubFleet],
) -> None:
    gateway, stubs, fleet = served
    with httpx.stream(
        "POST", f"{gateway.url}/generate", json=_body(200, stream=True), timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first event, then the client goes away
    for _ in range(200):
        cut = sum(s.stats()["streams_cut"] for s in stubs)
        outstanding = sum(g.outstanding for g in fleet.registry.groups())
        if cut == 1 and outstanding == 0:
            break
        threading.Event().wait(0.05)
    assert sum(s.stats()["streams_cut"] for s in stubs) == 1
    assert sum(s.stats()["streams_finished"] for s in stubs) == 0
    assert sum(g.outstanding for g in fleet.registry.groups()) == 0


@pytest.mark.parametrize("served", [GatewaySettings(max_body_bytes=4096)], indirect=True)
def test_a_body_past_the_limit_is_refused_unread(
    served: tuple[Gateway, list[Stub], StubFleet],
) -> None:
    gateway, stubs, _ = served
    r = httpx.post(
        f"{gateway.url}/generate",
        json={"input_ids": list(range(1, 3000)), "sampling_params": {}},
        timeout=30,
    )
    assert r.status_code == 413
    assert r.json()["error"]["param"] == "max_body_bytes"
    assert sum(s.stats()["requests"] for s in stubs) == 0


@pytest.mark.parametrize("served", [GatewaySettings(idle_body_timeout_s=0.5)], indirect=True)
def test_a_client_that_stops_mid_body_is_cut(
    served: tuple[Gateway, list[Stub], StubFleet],
) -> None:
    gateway, _, _ = served
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"input_ids":'
        )
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("served", [GatewaySettings(wait_for_routable_s=0.5)], indirect=True)
def test_no_routable_group_waits_then_503_and_health_says_so(
    served: tuple[Gateway, list[Stub], StubFleet],
) -> None:
    gateway, stubs, fleet = served
    for gid in ("g0", "g1"):
        fleet.registry.send(gid, "fail")
    assert httpx.get(f"{gateway.url}/health").status_code == 503
    r = httpx.post(f"{gateway.url}/generate", json=_body(), timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "no routable worker group" in r.json()["error"]["message"]
    assert sum(s.stats()["requests"] for s in stubs) == 0


def test_a_request_waits_for_a_group_that_comes_back(
    served: tuple[Gateway, list[Stub], StubFleet],
) -> None:
    gateway, _, fleet = served
    reg = fleet.registry
    for gid in ("g0", "g1"):
        reg.send(gid, "fail")
    box: dict[str, httpx.Response] = {}
    client = threading.Thread(
        target=lambda: box.setdefault(
            "r", httpx.post(f"{gateway.url}/generate", json=_body(2), timeout=60)
        )
    )
    client.start()
    threading.Event().wait(0.5)
    assert "r" not in box  # waiting, not failed
    reg.send("g0", "claim")
    reg.report_member("g0", 0, healthy=True, weights_version=reg.fleet_version)
    reg.send("g0", "restarted")
    client.join(30)
    assert box["r"].status_code == 200 and box["r"].headers["x-rollsafe-group"] == "g0"


def test_a_handler_failure_is_the_requests_never_the_fleets(
    served: tuple[Gateway, list[Stub], StubFleet],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway, _, fleet = served
    from rollsafe.gateway import sglang_api

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("a bug in one route")

    monkeypatch.setattr(sglang_api, "parse_generate", boom)
    r = httpx.post(f"{gateway.url}/generate", json=_body(), timeout=30)
    assert r.status_code == 500 and "a bug in one route" in r.text
    monkeypatch.undo()
    ok = httpx.post(f"{gateway.url}/generate", json=_body(), timeout=30)
    assert ok.status_code == 200
    assert all(g.state == "active" for g in fleet.registry.groups())


@pytest.mark.parametrize(
    "served",
    [GatewaySettings(gc_freeze=False), GatewaySettings()],
    indirect=True,
    ids=["gc_freeze-off", "gc_freeze-on"],
)
def test_gc_freeze_moves_the_heap_out_of_the_collector_at_start(
    served: tuple[Gateway, list[Stub], StubFleet],
) -> None:
    gateway = served[0]
    frozen = gc.get_freeze_count()
    if gateway.settings.gc_freeze:
        assert frozen > 1000  # the interpreter's, the tokenizer's, the test's objects
    else:
        assert frozen == 0
    r = httpx.post(gateway.url + "/generate", json=_body(tokens=2), timeout=30)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    with pytest.raises(InvalidArgument) as info:
        GatewaySettings(gc_freeze=1)  # type: ignore[arg-type]
    assert info.value.key == "gateway.gc_freeze"
