"""``rollsafe.gateway.router_sync`` against the REAL routers: sglang-router 0.3.2 and
vllm-router 0.1.17 from ``.venv-routers`` (``make routers``), each in front of stub engines
(``benchmarks/gateway/stub_engine.py``, whose counters say which engine got each request), and
a real :class:`~rollsafe.registry.FleetRegistry` whose :class:`WorkerGroupLifecycle` machines
are driven through their events.

Without ``.venv-routers`` the router tests skip with the reason; under ``CI=true`` they fail
instead once :data:`ROUTERS_REQUIRED_IN_CI` is True (set it when ``make test`` installs the
routers). Waits have deadlines only to catch a hang; nothing here is timed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.errors import InvalidArgument
from rollsafe.gateway import ExternalRouter
from rollsafe.gateway.router_sync import RouterSync
from rollsafe.registry import FleetRegistry
from rollsafe.statemachines.events import GroupEvent

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gateway"))

import fronts  # noqa: E402
import stub_engine  # noqa: E402

#: True: ``make test`` installs ``.venv-routers`` (``make routers``), so under ``CI=true`` a missing
#: venv fails the router tests (elsewhere it skips them, naming ``make routers``).
ROUTERS_REQUIRED_IN_CI = True
KINDS = ("sglang-router", "vllm-router")
#: deadline of every wait (a hang detector, not a timing assertion)
WAIT_S = 60.0
#: a sync that retries fast (these tests take routers down on purpose)
FAST: dict[str, Any] = {"timeout_s": 2.0, "retry_initial_s": 0.05, "retry_max_s": 0.5}


def _require_routers() -> None:
    if fronts.ROUTERS_PYTHON.exists():
        return
    reason = (
        f"{fronts.ROUTERS_PYTHON} missing: `make routers` installs sglang-router 0.3.2 and "
        "vllm-router 0.1.17"
    )
    if ROUTERS_REQUIRED_IN_CI and os.environ.get("CI") == "true":
        pytest.fail(reason + " (required under CI=true)")
    pytest.skip(reason)


def until(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- engines, routers


class Stub:
    def __init__(self, tmp: Path, tag: str) -> None:
        self.counters = tmp / f"{tag}.counters"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gateway" / "stub_engine.py")]
        self.proc, ready = fronts.spawn(
            [*cmd, "--counters", str(self.counters)], tmp / f"{tag}.log", stub_engine.READY_PREFIX
        )
        self.url: str = ready["url"]

    def served(self) -> int:
        c = stub_engine.read_counters(self.counters)
        return int(c["generate"] + c["completions"])

    def stop(self) -> None:
        fronts.kill_group(self.proc)


class Router:
    """One real router process on a fixed port (so it can be restarted where it was)."""

    def __init__(
        self,
        kind: str,
        tmp: Path,
        extra: tuple[str, ...] = (),
        headers: dict[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.tmp = tmp
        self.extra = extra
        self.headers = dict(headers or {})
        self.front: fronts.Router = (
            fronts.SGLangRouter(tmp) if kind == "sglang-router" else fronts.VLLMRouter(tmp)
        )
        self.port = fronts.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.front.url = self.url
        self.proc: Any = None

    def start(self, workers: list[str], wait: bool = True) -> Router:
        """Launch the router with ``workers``; with ``wait``, until it lists them all healthy."""
        cmd = self.front.command(self.port, workers) + list(self.extra)
        self.proc, _ = fronts.spawn(cmd, self.tmp / f"{self.kind}-{self.port}.log", None)
        if wait:
            until(lambda: sorted(self.healthy()) == sorted(workers), f"{self.kind} up: {workers}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            fronts.kill_group(self.proc)
            self.proc = None

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, str]:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("content-type", "application/json")
        for k, v in self.headers.items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def workers(self) -> list[dict[str, Any]]:
        status, text = self._call("GET", "/workers")
        return list(json.loads(text).get("workers", [])) if status == 200 else []

    def healthy(self) -> list[str]:
        return [w["url"] for w in self.workers() if w.get("is_healthy")]

    def listed(self) -> set[str]:
        return {w["url"] for w in self.workers()}

    def add_behind_our_back(self, url: str) -> None:
        if self.kind == "sglang-router":
            status, _ = self._call("POST", "/workers", {"url": url})
        else:
            status, _ = self._call("POST", "/add_worker?" + urllib.parse.urlencode({"url": url}))
        assert status in (200, 202)
        until(lambda: url in self.listed(), f"{url} added by hand")

    def remove_behind_our_back(self, url: str) -> None:
        if self.kind == "sglang-router":
            (wid,) = [w["id"] for w in self.workers() if w["url"] == url]
            status, _ = self._call("DELETE", f"/workers/{wid}")
        else:
            q = urllib.parse.urlencode({"url": url})
            status, _ = self._call("POST", f"/remove_worker?{q}")
        assert status in (200, 202)
        until(lambda: url not in self.listed(), f"{url} removed by hand")

    def send(self, n: int) -> None:
        """``n`` generation requests through the router (its own API), each answered 200."""
        body: dict[str, Any]
        for _ in range(n):
            if self.kind == "sglang-router":
                body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
                status, text = self._call("POST", "/generate", body)
            else:
                body = {"model": "stub-model", "prompt": [1, 2], "max_tokens": 2}
                status, text = self._call("POST", "/v1/completions", body)
            assert status == 200, text


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Stub]]:
    tmp = tmp_path_factory.mktemp("router-sync-stubs")
    made: list[Stub] = []
    try:
        for i in range(3):
            made.append(Stub(tmp, f"s{i}"))
        yield made
    finally:
        for s in made:
            s.stop()


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[Callable[..., Router]]:
    _require_routers()
    made: list[Router] = []

    def make(
        kind: str,
        workers: list[str],
        extra: tuple[str, ...] = (),
        headers: dict[str, str] | None = None,
    ) -> Router:
        r = Router(kind, tmp_path, extra, headers).start(workers)
        made.append(r)
        return r

    yield make
    for r in made:
        if r.proc is not None:
            os.kill(r.proc.pid, signal.SIGCONT)  # a test that failed while it was stopped
        r.stop()


@pytest.fixture
def syncs() -> Iterator[list[RouterSync]]:
    made: list[RouterSync] = []
    yield made
    for s in made:
        s.close()


def fleet(urls: list[str]) -> FleetRegistry:
    """One single-rank group per URL (``g0``, ``g1``, ...), each ``active`` at version 0."""
    reg = FleetRegistry()
    for i, url in enumerate(urls):
        reg.add_group(f"g{i}", [i], clients=[SGLangClient(url)], restart_budget=100)
        activate(reg, f"g{i}", GroupEvent.LAUNCHED)
    return reg


def activate(reg: FleetRegistry, gid: str, event: GroupEvent) -> None:
    for r in reg.get(gid).ranks:
        reg.report_member(gid, r, healthy=True, weights_version=reg.fleet_version)
    reg.send(gid, event)
    assert reg.get(gid).state == "active"


def restart(reg: FleetRegistry, gid: str, new_url: str | None = None) -> None:
    """``fail`` -> ``claim`` -> (a new client) -> ``restarted``: the recovery's path."""
    if reg.get(gid).state == "active":
        reg.send(gid, GroupEvent.FAIL)
    reg.send(gid, GroupEvent.CLAIM)
    if new_url is not None:
        reg.rebind_clients(gid, [SGLangClient(new_url)])
    activate(reg, gid, GroupEvent.RESTARTED)


def start_sync(
    syncs: list[RouterSync], reg: FleetRegistry, router: Router, **settings: Any
) -> RouterSync:
    kind: Any = router.kind
    sync = RouterSync(reg, ExternalRouter(router.url, kind, **{**FAST, **settings}))
    syncs.append(sync.start())
    assert sync.wait_synced(WAIT_S), sync.stats()
    return sync


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"url": "127.0.0.1:30000"}, "url"),
        ({"url": "ftp://h:1"}, "url"),
        ({"url": "http://h:notaport"}, "url"),
        ({"url": "http://h:1/?x=1"}, "url"),
        ({"url": 30000}, "url"),
        ({"kind": "nginx"}, "kind"),
        ({"api_key": ""}, "api_key"),
        ({"api_key": "a b"}, "api_key"),
        ({"api_key": "x\r\nX-Evil: 1"}, "api_key"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"add_timeout_s": -1}, "add_timeout_s"),
        ({"confirm_timeout_s": float("nan")}, "confirm_timeout_s"),
        ({"reconcile_interval_s": "30"}, "reconcile_interval_s"),
        ({"retry_initial_s": True}, "retry_initial_s"),
        ({"retry_initial_s": 2.0, "retry_max_s": 1.0}, "retry_max_s"),
        ({"remove_unknown": "yes"}, "remove_unknown"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(settings: dict[str, Any], key: str) -> None:
    base: dict[str, Any] = {"url": "http://127.0.0.1:30000", "kind": "sglang-router", **settings}
    with pytest.raises(InvalidArgument) as info:
        ExternalRouter(**base)
    assert info.value.key == key and key in str(info.value)


def test_settings_defaults_normal_url_and_hidden_key() -> None:
    r = ExternalRouter("http://127.0.0.1:30000/", "vllm-router", api_key="sekret")
    assert r.url == "http://127.0.0.1:30000" and r.remove_unknown is True
    assert "sekret" not in repr(r)
    assert [r.backoff_s(n) for n in (1, 2, 3, 10)] == [0.25, 0.5, 1.0, 10.0]
    with pytest.raises(InvalidArgument) as info:
        RouterSync(FleetRegistry(), r, max_calls=0)
    assert info.value.key == "max_calls"


# --------------------------------------------------------------------------- against the routers


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_leaving_active_is_removed_and_added_back_when_it_returns(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1 = stubs[0], stubs[1]
    router = routers(kind, [s0.url, s1.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router)
    assert sync.stats()["adds"] == sync.stats()["removes"] == 0  # the list was already right

    reg.send("g0", GroupEvent.FAIL)
    until(lambda: router.listed() == {s1.url}, "g0's engine removed")
    before = (s0.served(), s1.served())
    router.send(6)
    assert (s0.served(), s1.served()) == (before[0], before[1] + 6)  # none reached g0's engine
    assert sync.wait_synced(WAIT_S)  # the router acts before the sync has its confirmation
    stats = sync.stats()
    assert (stats["removes"], stats["failures"], stats["removals_timed"]) == (1, 0, 1)
    assert stats["last_removal_lag_s"] is not None and stats["last_removal_lag_s"] >= 0

    restart(reg, "g0")
    until(lambda: router.listed() == {s0.url, s1.url}, "g0's engine added back")
    until(lambda: set(router.healthy()) == {s0.url, s1.url}, "both healthy in the router")
    before = (s0.served(), s1.served())
    router.send(8)
    assert s0.served() > before[0] and s1.served() > before[1]  # round robin over both again
    assert sync.wait_synced(WAIT_S)
    assert sync.stats()["adds"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_restart_on_a_new_url_replaces_the_url(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1, s2 = stubs
    router = routers(kind, [s0.url, s1.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router)

    restart(reg, "g0", new_url=s2.url)  # the restarted engine listens elsewhere
    until(lambda: router.listed() == {s2.url, s1.url}, "g0 now at its new URL only")
    until(lambda: set(router.healthy()) == {s2.url, s1.url}, "the new URL healthy")
    before = (s0.served(), s2.served())
    router.send(8)
    assert s0.served() == before[0]  # the old engine, still up, gets nothing
    assert s2.served() > before[1]
    assert sync.wait_synced(WAIT_S)
    assert sync.stats()["routable_urls"] == sorted([s1.url, s2.url])


@pytest.mark.parametrize("kind", KINDS)
def test_reconcile_fixes_a_router_changed_behind_rollsafes_back(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1, s2 = stubs
    router = routers(kind, [s0.url, s1.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router, reconcile_interval_s=3600.0)  # only when asked

    router.remove_behind_our_back(s0.url)  # a routable engine taken out by hand
    router.add_behind_our_back(s2.url)  # an engine the fleet does not know
    assert router.listed() == {s1.url, s2.url}
    result = sync.reconcile_now(WAIT_S)
    assert result is not None and result["error"] is None
    assert (result["to_add"], result["to_remove"]) == ([s0.url], [s2.url])
    until(lambda: router.listed() == {s0.url, s1.url}, "the router's list is the routable set")
    assert sync.wait_synced(WAIT_S)
    stats = sync.stats()
    assert (stats["adds"], stats["removes"], stats["failures"]) == (1, 1, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_workers_are_left_alone_when_remove_unknown_is_false(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1, s2 = stubs  # s2 is a worker of the router's that rollsafe does not manage
    router = routers(kind, [s0.url, s1.url, s2.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router, remove_unknown=False)
    reg.send("g0", GroupEvent.FAIL)
    until(lambda: router.listed() == {s1.url, s2.url}, "g0 out, the unknown worker kept")
    result = sync.reconcile_now(WAIT_S)
    assert result is not None and (result["to_add"], result["to_remove"]) == ([], [])
    assert router.listed() == {s1.url, s2.url}


@pytest.mark.parametrize("kind", KINDS)
def test_a_reconcile_during_a_removal_in_flight_reports_what_the_router_lists(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    """The removal has reached the router (sglang-router's job done) but its call has not come
    back (the confirming poll): the reconcile's summary says what its list showed, nothing to
    remove (a CI run saw the in-flight URL reported under ``to_remove``)."""
    s0, s1 = stubs[0], stubs[1]
    router = routers(kind, [s0.url, s1.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router, reconcile_interval_s=3600.0)
    release, reached = threading.Event(), threading.Event()
    real_remove = sync._api.remove

    def held_remove(url: str) -> None:
        real_remove(url)
        reached.set()
        assert release.wait(WAIT_S)

    sync._api.remove = held_remove  # type: ignore[method-assign]
    try:
        reg.send("g0", GroupEvent.FAIL)
        assert reached.wait(WAIT_S)
        assert router.listed() == {s1.url}
        assert sync.stats()["in_flight"] == 1
        result = sync.reconcile_now(WAIT_S)
        assert result is not None and result["error"] is None
        assert (result["to_add"], result["to_remove"], result["listed"]) == ([], [], 1)
    finally:
        release.set()
    assert sync.wait_synced(WAIT_S)
    assert (sync.stats()["removes"], router.listed()) == (1, {s1.url})


@pytest.mark.parametrize("kind", KINDS)
def test_a_router_that_is_down_never_holds_up_the_fleet_and_is_caught_up(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1 = stubs[0], stubs[1]
    router = routers(kind, [s0.url, s1.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router, reconcile_interval_s=1.0)

    # frozen: the router accepts connections and answers nothing
    os.kill(router.proc.pid, signal.SIGSTOP)
    try:
        reg.send("g0", GroupEvent.FAIL)  # returns while no call to the router can complete
        assert reg.get("g0").state == "inactive"
        stats = sync.stats()
        assert stats["removes"] == 0 and stats["pending"] == 1
    finally:
        os.kill(router.proc.pid, signal.SIGCONT)
    until(lambda: router.listed() == {s1.url}, "g0 removed once the router runs again")

    # killed: connections refused; the fleet goes on; a new router (its own startup list, on
    # the same port) is brought to the fleet's routable set
    router.stop()
    restart(reg, "g0")
    reg.send("g1", GroupEvent.FAIL)
    assert [g.state for g in reg.groups()] == ["active", "inactive"]
    until(lambda: sync.stats()["failures"] >= 2, "the failed calls counted")
    assert sync.stats()["router_failing"] >= 1 and sync.stats()["last_error"]
    router.start([s0.url, s1.url], wait=False)
    until(lambda: router.listed() == {s0.url}, "caught up: only g0 listed")
    assert sync.wait_synced(WAIT_S)
    assert sync.stats()["router_failing"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_flapping_is_coalesced_and_the_last_state_wins(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1 = stubs[0], stubs[1]
    router = routers(kind, [s0.url, s1.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router, timeout_s=30.0)
    os.kill(router.proc.pid, signal.SIGSTOP)  # at most one call per URL waits on it
    try:
        for _ in range(10):
            restart(reg, "g0")  # out and back in, 10 times
        reg.send("g1", GroupEvent.FAIL)
        for _ in range(5):
            restart(reg, "g1")
            reg.send("g1", GroupEvent.FAIL)  # ... and g1 ends out
    finally:
        os.kill(router.proc.pid, signal.SIGCONT)
    until(lambda: router.listed() == {s0.url}, "the last state of each group")
    assert sync.wait_synced(WAIT_S)
    stats = sync.stats()
    # 42 transitions in and out of active; each URL's calls wait for its previous one, so at
    # most one remove and one add of g0's URL, and one remove of g1's
    assert stats["failures"] == 0 and stats["adds"] + stats["removes"] <= 3, stats


def test_the_api_key_opens_sglang_routers_control_plane(
    stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1 = stubs[0], stubs[1]
    router = routers(
        "sglang-router",
        [s0.url, s1.url],
        extra=("--control-plane-api-keys", "k1:rollsafe:admin:sekret"),
        headers={"authorization": "Bearer sekret"},  # the test's own calls
    )
    reg = fleet([s0.url, s1.url])
    keyless = RouterSync(reg, ExternalRouter(router.url, "sglang-router", **FAST))
    syncs.append(keyless.start())
    result = keyless.reconcile_now(WAIT_S)
    assert result is not None and "401" in result["error"] and "api_key" in result["error"]
    keyless.close()

    sync = start_sync(syncs, reg, router, api_key="sekret")
    reg.send("g1", GroupEvent.FAIL)
    until(lambda: router.listed() == {s0.url}, "removed with the admin key")
    assert sync.stats()["failures"] == 0


@pytest.mark.parametrize("kind", KINDS[:1])
def test_close_stops_the_threads_and_a_restart_catches_up(
    kind: str, stubs: list[Stub], routers: Callable[..., Router], syncs: list[RouterSync]
) -> None:
    s0, s1 = stubs[0], stubs[1]
    router = routers(kind, [s0.url, s1.url])
    reg = fleet([s0.url, s1.url])
    sync = start_sync(syncs, reg, router)
    assert sync.close() is True
    assert not [t for t in threading.enumerate() if t.name.startswith(sync.name)]
    assert sync.stats()["running"] is False and sync.reconcile_now(1.0) is None
    reg.send("g1", GroupEvent.FAIL)  # not listened to any more
    assert sync.stats()["pending"] == 0 and router.listed() == {s0.url, s1.url}
    assert sync.close() is True  # twice is fine

    sync.start()  # a new start reads the router again
    until(lambda: router.listed() == {s0.url}, "the restarted sync's reconcile removed g1")
    assert sync.wait_synced(WAIT_S)


def test_a_fleet_keeps_a_real_routers_workers_equal_to_its_routable_set(tmp_path: Path) -> None:
    """``FleetConfig(external_routers=...)``: a real fleet (two reference-engine groups) fills an
    empty sglang-router with its engines, takes a SIGKILLed engine out of it at once, and puts
    the group's new URL in when the group is back at the fleet's version."""
    from transformers import AutoModelForCausalLM

    from rollsafe import FleetConfig, GroupSpec, RolloutFleet
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    _require_routers()
    router = Router("sglang-router", tmp_path)
    router.start([], wait=False)
    until(lambda: router._call("GET", "/workers")[0] == 200, "sglang-router answers")
    try:
        model = make_tiny_model(tmp_path / "model")
        config = FleetConfig(
            model_path=model,
            export_root=tmp_path / "exports",
            groups=[GroupSpec(1), GroupSpec(1)],
            engine=EngineSpec(model_path=str(model)),
            external_routers=(ExternalRouter(url=router.url, kind="sglang-router", **FAST),),
        )
        with RolloutFleet(config) as running:
            urls = lambda: {g.client.url for g in running.registry.routable()}  # noqa: E731
            until(lambda: router.listed() == urls(), "the router lists the fleet's engines")
            assert len(router.listed()) == 2
            victim = running.registry.get("g1")
            old = victim.client.url
            for pid in running.launcher("g1").rank_pids:
                os.kill(pid, signal.SIGKILL)
            until(lambda: old not in router.listed(), "the dead engine leaves the router")
            assert running.wait_recoveries(timeout=120)
            hf = AutoModelForCausalLM.from_pretrained(str(model))
            running.sync_weights({n: p.detach() for n, p in hf.named_parameters()}, 1)
            until(lambda: victim.state == "active", "g1 back at version 1")
            until(lambda: router.listed() == urls(), "the router lists the new URL")
            assert old not in router.listed() and victim.client.url in router.listed()
            # the router lists a URL as soon as its background job ran; the sync counts the add
            # when its own GET /workers confirms it, a moment later: wait for that
            (sync,) = running.router_syncs
            assert sync.wait_synced(WAIT_S)
            (stats,) = running.snapshot()["external_routers"]
            assert stats["removes"] >= 1 and stats["adds"] >= 3, stats
    finally:
        router.stop()
