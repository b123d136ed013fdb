"""Keep an sglang-router's or vllm-router's worker list equal to the fleet's routable set.

Owns :class:`ExternalRouter` (where a router users already run listens, which one it is, and
how rollsafe talks to it) and :class:`RouterSync` (a :class:`~rollsafe.registry.FleetListener`
that drives that router's own worker API from the fleet's transitions). The facts about both
routers' APIs are in ``docs/routers.md``; in short:

=================  ==========================================  =================================
                   sglang-router 0.3.2                         vllm-router 0.1.17
=================  ==========================================  =================================
list               ``GET /workers`` (``id``, ``url``, ...)     ``GET /list_workers`` (``urls``)
add                ``POST /workers {"url"}``: 202, a           ``POST /add_worker?url=``: 200
                   background job adds it (confirmed here      when added (it waits until the
                   when ``GET /workers`` lists it)             worker is healthy); 400 "already
                                                               exists" counts as done
remove             ``DELETE /workers/{id}`` (the UUID from     ``POST /remove_worker?url=``: 200
                   ``GET /workers``): 202, confirmed here      (also for a URL it never had)
                   when ``GET /workers`` no longer lists it
auth               ``api_key`` is sent as ``Authorization: Bearer``; sglang-router needs an
                   ``admin`` key there when started with ``--control-plane-api-keys``
=================  ==========================================  =================================

What :class:`RouterSync` does:

* **a group leaves** ``active`` (crash detected, a failed sync, drain, removal): every URL of
  the group is removed from the router; **a group enters** ``active``: its serving URL
  (``endpoints[0]``, where requests go; a multi-node group's other endpoints are never added)
  is added, and any URL the group had before (a restart on a new port) is removed;
* **never blocks the fleet**: the listener only records what each URL should be (under a lock
  of its own) and wakes the sync's scheduler thread; the HTTP calls run on a few daemon worker
  threads (``max_calls``), at most one call per URL at a time, in order per URL, removals
  before additions. What a URL should be is a level, not a queue of edges: a group that flaps
  out and back in before its removal was sent costs no call at all (coalescing);
* **retries**: a failed call (connection refused, timeout, an unexpected status, a
  sglang-router job that did not show in the list within ``confirm_timeout_s``) is logged,
  counted and retried for that URL with exponential backoff (``retry_initial_s`` doubling up
  to ``retry_max_s``); after a failure the router's state of that URL counts as unknown, so the
  next call is made whatever the URL should be. Nothing ever raises into the fleet;
* **reconciles** at start, every ``reconcile_interval_s``, at once when a router that failed
  answers again, and on :meth:`RouterSync.reconcile_now`: it lists the router's workers, adds
  the routable URLs it lacks and removes the listed URLs that are the fleet's but not routable
  now (any endpoint of any group, or a URL this sync added once). **Unknown workers** (listed,
  but no URL of the fleet) are removed too when ``ExternalRouter.remove_unknown`` is True (the
  default: the router's list is then exactly the fleet's routable set); with False they are
  left alone (a router shared with engines rollsafe does not manage). A reconcile never undoes
  a transition that arrived while it ran, nor trusts its list for a URL whose call ended after
  the list was taken;
* :meth:`RouterSync.stats` for metrics: adds, removes, failures, the last reconcile, and the
  lag of the last removal from the transition (``GroupTransition.timestamp``) to the router's
  answer confirming it; :meth:`RouterSync.close` stops the threads (the router keeps its list).

What it cannot make a router do (only rollsafe's gateway does these, ``docs/routers.md``):
continue a stream cut by a crash from its last token, report the weights version of each
token, or hold a request while no group is routable. Between a failure and the fleet noticing
it, the router still routes to the failed engine with its own retries.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import math
import queue
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollsafe.errors import InvalidArgument, InvalidArgumentType
from rollsafe.gateway.settings import ExternalRouter, normal_url
from rollsafe.registry import FleetListener, FleetRegistry, GroupTransition, WorkerGroup
from rollsafe.text import bound_text

__all__ = ["RouterSync"]

log = logging.getLogger(__name__)

#: how often a sglang-router background job is looked for in ``GET /workers``
_CONFIRM_POLL_S = 0.02
#: characters of a router's answer kept in an error
_ANSWER_CHARS = 300


# --------------------------------------------------------------------------- the routers' APIs


class _CallFailed(Exception):
    """One call to the router did not do what it should (the message says why)."""


class _RouterAPI:
    """The worker API of one router: ``listed()``, ``add(url)``, ``remove(url)``; each either
    returns with the router confirming it or raises :class:`_CallFailed`."""

    def __init__(self, router: ExternalRouter) -> None:
        self.router = router
        parts = urllib.parse.urlsplit(router.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = None
    ) -> tuple[int, str]:
        """One HTTP call on a fresh connection (they are rare): ``(status, text)``."""
        limit = self.router.timeout_s if timeout is None else timeout
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=limit)
        headers = {"accept": "application/json", "connection": "close"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        if self.router.api_key:
            headers["authorization"] = f"Bearer {self.router.api_key}"
        try:
            conn.request(method, self._prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            raise _CallFailed(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()

    @staticmethod
    def refused(method: str, path: str, status: int, text: str) -> _CallFailed:
        hint = ""
        if status in (401, 403):
            hint = " (the router wants an admin api_key: ExternalRouter.api_key)"
        return _CallFailed(
            f"{method} {path}: {status} {bound_text(text.strip(), _ANSWER_CHARS)}{hint}"
        )

    def json_of(self, path: str) -> Any:
        status, text = self.request("GET", path)
        if status != 200:
            raise self.refused("GET", path, status, text)
        try:
            return json.loads(text)
        except ValueError:
            raise _CallFailed(f"GET {path}: not JSON: {bound_text(text, _ANSWER_CHARS)}") from None

    def listed(self) -> set[str]:
        raise NotImplementedError

    def add(self, url: str) -> None:
        raise NotImplementedError

    def remove(self, url: str) -> None:
        raise NotImplementedError


class _SGLangRouterAPI(_RouterAPI):
    """sglang-router 0.3.2: ``GET /workers``, ``POST /workers``, ``DELETE /workers/{id}``; adds
    and removals are background jobs (202), confirmed by listing."""

    def workers(self) -> list[dict[str, Any]]:
        got = self.json_of("/workers")
        workers = got.get("workers") if isinstance(got, dict) else None
        if not isinstance(workers, list):
            raise _CallFailed(f"GET /workers: no 'workers' list in {bound_text(str(got), 200)}")
        return [w for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]

    def listed(self) -> set[str]:
        return {normal_url(w["url"]) for w in self.workers()}

    def _confirm(self, url: str, present: bool, what: str) -> None:
        deadline = time.monotonic() + self.router.confirm_timeout_s
        while True:
            if (url in self.listed()) == present:
                return
            if time.monotonic() >= deadline:
                raise _CallFailed(
                    f"{what} {url}: answered 202, but GET /workers still "
                    f"{'lacks' if present else 'lists'} it after "
                    f"{self.router.confirm_timeout_s:g} s (the router's background job)"
                )
            time.sleep(_CONFIRM_POLL_S)

    def add(self, url: str) -> None:
        status, text = self.request("POST", "/workers", {"url": url})
        if status not in (200, 201, 202):
            raise self.refused("POST", "/workers", status, text)
        self._confirm(url, True, "POST /workers")

    def remove(self, url: str) -> None:
        ids = [str(w.get("id")) for w in self.workers() if normal_url(w["url"]) == url]
        for worker_id in ids:
            path = "/workers/" + urllib.parse.quote(worker_id, safe="")
            status, text = self.request("DELETE", path)
            if status not in (200, 202, 204, 404):  # 404 WORKER_NOT_FOUND: already gone
                raise self.refused("DELETE", "/workers/{id}", status, text)
        if ids:
            self._confirm(url, False, "DELETE /workers/{id}")


class _VLLMRouterAPI(_RouterAPI):
    """vllm-router 0.1.17: ``GET /list_workers``, ``POST /add_worker?url=`` (answers once the
    worker is healthy and added), ``POST /remove_worker?url=``."""

    def listed(self) -> set[str]:
        got = self.json_of("/list_workers")
        urls = got.get("urls") if isinstance(got, dict) else None
        if not isinstance(urls, list):
            raise _CallFailed(f"GET /list_workers: no 'urls' list in {bound_text(str(got), 200)}")
        return {normal_url(u) for u in urls if isinstance(u, str)}

    def add(self, url: str) -> None:
        path = "/add_worker?" + urllib.parse.urlencode({"url": url})
        status, text = self.request("POST", path, timeout=self.router.add_timeout_s)
        if status == 200 or (status == 400 and "already exists" in text):
            return
        raise self.refused("POST", "/add_worker", status, text)

    def remove(self, url: str) -> None:
        path = "/remove_worker?" + urllib.parse.urlencode({"url": url})
        status, text = self.request("POST", path)
        if status != 200:
            raise self.refused("POST", "/remove_worker", status, text)


def _api_for(router: ExternalRouter) -> _RouterAPI:
    return _SGLangRouterAPI(router) if router.kind == "sglang-router" else _VLLMRouterAPI(router)


# --------------------------------------------------------------------------- the sync


@dataclass
class _Url:
    """What one worker URL should be in the router, and what the router last said it is."""

    url: str
    #: present in the router?
    want: bool = False
    #: the router's state as of our last confirmed call or list (None: not known)
    known: bool | None = None
    #: a URL of the fleet (a group's endpoint, or one this sync added): removable when not
    #: routable; otherwise an unknown worker (removed only with ``remove_unknown``)
    fleet: bool = False
    #: the registry event that last set ``want`` (0: none)
    event_seq: int = 0
    #: wall time of the transition that took the URL out of routing (for the removal's lag)
    left_at: float | None = None
    in_flight: bool = False
    failures: int = 0
    next_try: float = 0.0
    #: monotonic end of its last call
    done_at: float = 0.0

    @property
    def dirty(self) -> bool:
        return self.known is None or self.want != self.known


class RouterSync(FleetListener):
    """Keeps one :class:`ExternalRouter`'s worker list equal to ``registry``'s routable set
    (see the module docstring for what it does and when).

    ``start()`` registers it as a listener of ``registry`` and starts its threads (a first
    reconcile runs at once); ``close()`` undoes both. ``max_calls``: HTTP calls to the router
    in flight at once (one per URL at most). Also a context manager.
    """

    def __init__(
        self,
        registry: FleetRegistry,
        router: ExternalRouter,
        *,
        max_calls: int = 4,
        name: str | None = None,
    ) -> None:
        if not isinstance(router, ExternalRouter):
            raise InvalidArgumentType(
                "router", f"RouterSync needs an ExternalRouter, got {type(router).__name__}"
            )
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise InvalidArgument("max_calls", f"max_calls must be an int >= 1, got {max_calls!r}")
        self.registry = registry
        self.router = router
        self.max_calls = max_calls
        self.name = name or f"rollsafe-router-sync[{router.kind} {router.url}]"
        self._api = _api_for(router)
        self._cond = threading.Condition()
        self._urls: dict[str, _Url] = {}
        self._group_urls: dict[str, str] = {}  # group id -> the serving URL added for it
        self._seq = 0
        self._gen = 0  # one per start(): results of an earlier start's calls are dropped
        self._running = False
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._calls = 0
        # reconciles
        self._reconcile_at = 0.0
        self._reconciling = False
        self._reconcile_asked = 0
        self._reconcile_done = 0
        self._last_reconcile: dict[str, Any] | None = None
        self._reconciles = 0
        self._reconciled_ok = 0
        # counters
        self._adds = 0
        self._removes = 0
        self._failures = 0
        self._router_failures = 0  # consecutive, any call
        self._last_error: str | None = None
        self._last_lag: float | None = None
        self._max_lag: float | None = None
        self._lags = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RouterSync:
        """Listen to the registry and start the threads (idempotent); a reconcile runs first."""
        with self._cond:
            if self._running:
                return self
            self._running, self._closing = True, False
            self._gen += 1
            self._calls, self._reconciling, self._reconcile_at = 0, False, 0.0
            for st in self._urls.values():  # what the router has is read again
                st.in_flight, st.known, st.next_try = False, None, 0.0
            self._jobs = queue.SimpleQueue()
            self._threads = [
                threading.Thread(target=self._schedule, name=self.name, daemon=True),
                *(
                    threading.Thread(
                        target=self._work,
                        args=(self._jobs,),
                        name=f"{self.name}-call{i}",
                        daemon=True,
                    )
                    for i in range(self.max_calls)
                ),
            ]
        self.registry.add_listener(self)
        for t in self._threads:
            t.start()
        return self

    def close(self, timeout: float = 5.0) -> bool:
        """Stop listening and stop the threads; True when all joined within ``timeout`` (a
        call stuck in a hung router stays on its daemon thread until its own timeout)."""
        self.registry.remove_listener(self)
        with self._cond:
            if not self._running:
                return True
            self._closing = True
            self._cond.notify_all()
            threads, jobs = list(self._threads), self._jobs
        for _ in range(self.max_calls):
            jobs.put(None)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        clean = not any(t.is_alive() for t in threads)
        if not clean:
            log.warning("%s: a call to the router is still running at close", self.name)
        with self._cond:
            self._running = False
            self._cond.notify_all()
        return clean

    def __enter__(self) -> RouterSync:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._running and not self._closing

    # ------------------------------------------------------------------ listener
    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        """Record what the group's URLs should be and wake the scheduler (no I/O here)."""
        if record.left_routing:
            self._group_out(group, record)
        elif record.target == "active" and record.source != "active":
            self._group_in(group, record)

    def _entry(self, url: str) -> _Url:
        st = self._urls.get(url)
        if st is None:
            st = self._urls[url] = _Url(url)
        return st

    def _set(self, url: str, want: bool, seq: int, at: float | None) -> None:
        st = self._entry(url)
        st.fleet = True
        if st.want and not want:
            st.left_at = at
        elif want:
            st.left_at = None
        st.want = want
        st.event_seq = seq
        if st.dirty:
            st.next_try = 0.0  # a new decision is tried at once, whatever the backoff was

    def _group_out(self, group: WorkerGroup, record: GroupTransition) -> None:
        with self._cond:
            self._seq += 1
            urls = {normal_url(u) for u in group.endpoints}
            serving = self._group_urls.pop(group.group_id, None)
            if serving is not None:
                urls.add(serving)
            for url in urls:
                self._set(url, False, self._seq, record.timestamp)
            self._cond.notify_all()

    def _group_in(self, group: WorkerGroup, record: GroupTransition) -> None:
        with self._cond:
            self._seq += 1
            serving = normal_url(group.endpoints[0]) if group.endpoints else None
            old = self._group_urls.pop(group.group_id, None)
            if old is not None and old != serving:
                self._set(old, False, self._seq, record.timestamp)
            if serving is not None:
                self._set(serving, True, self._seq, None)
                self._group_urls[group.group_id] = serving
            self._cond.notify_all()

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> None:
        with self._cond:
            gen = self._gen
            while not self._closing and gen == self._gen:
                now = time.monotonic()
                wake = math.inf
                if not self._reconciling:
                    asked = self._reconcile_asked > self._reconcile_done
                    if now < self._reconcile_at and not asked:
                        wake = self._reconcile_at
                    elif self._calls < self.max_calls:
                        self._reconciling = True
                        self._calls += 1
                        self._jobs.put(functools.partial(self._reconcile, gen))
                due = sorted(
                    (st for st in self._urls.values() if st.dirty and not st.in_flight),
                    key=lambda st: (st.want, st.event_seq),
                )
                for st in due:
                    if st.next_try > now:
                        wake = min(wake, st.next_try)
                    elif self._calls < self.max_calls:  # else: woken when a call ends
                        st.in_flight = True
                        self._calls += 1
                        self._jobs.put(functools.partial(self._call, gen, st.url, st.want))
                self._cond.wait(min(max(0.0, wake - now), 60.0))

    def _work(self, jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a bug here must not kill the worker thread
                log.exception("%s: a router call raised", self.name)

    def _call(self, gen: int, url: str, want: bool) -> None:
        error: str | None = None
        try:
            if want:
                self._api.add(url)
            else:
                self._api.remove(url)
        except _CallFailed as exc:
            error = str(exc)
        except Exception as exc:  # never into the fleet; counted like any failure
            error = f"{type(exc).__name__}: {exc}"
        answered = time.time()
        with self._cond:
            if gen != self._gen:
                return  # a call of an earlier start(): its state was reset since
            self._calls -= 1
            st = self._entry(url)
            st.in_flight = False
            st.done_at = time.monotonic()
            if error is None:
                st.known, st.failures = want, 0
                if want:
                    self._adds += 1
                else:
                    self._removes += 1
                    if st.left_at is not None and not st.want:
                        self._note_lag(answered - st.left_at)
                        st.left_at = None
                self._router_ok()
            else:
                st.known = None  # the router may or may not have done it
                st.failures += 1
                st.next_try = time.monotonic() + self.router.backoff_s(st.failures)
                self._router_failed(f"{'add' if want else 'remove'} {url}: {error}")
            self._cond.notify_all()

    def _note_lag(self, lag: float) -> None:
        self._last_lag = lag
        self._max_lag = lag if self._max_lag is None else max(self._max_lag, lag)
        self._lags += 1

    def _router_ok(self) -> None:
        if self._router_failures:
            log.info(
                "%s: the router answers again after %d failed call(s); reconciling",
                self.name,
                self._router_failures,
            )
            self._router_failures = 0
            self._reconcile_at = 0.0

    def _router_failed(self, error: str) -> None:
        self._failures += 1
        self._router_failures += 1
        self._last_error = bound_text(error, 1000)
        level = logging.WARNING if self._router_failures == 1 else logging.DEBUG
        log.log(level, "%s: %s (retrying with backoff)", self.name, self._last_error)

    # ------------------------------------------------------------------ reconcile
    def _reconcile(self, gen: int) -> None:
        with self._cond:
            seq, asked, began = self._seq, self._reconcile_asked, time.monotonic()
        desired: dict[str, str] = {}
        fleet: set[str] = set()
        for group in self.registry.groups():
            eps = [normal_url(u) for u in group.endpoints]
            fleet.update(eps)
            if eps and group.is_routable:
                desired[eps[0]] = group.group_id
        error: str | None = None
        listed: set[str] = set()
        try:
            listed = self._api.listed()
        except _CallFailed as exc:
            error = str(exc)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            if gen != self._gen:
                return
            self._calls -= 1
            self._reconciling = False
            self._reconcile_done = asked
            self._reconciles += 1
            now = time.monotonic()
            result: dict[str, Any] = {"at": time.time(), "error": error}
            if error is None:
                self._apply_list(listed, desired, fleet, seq, began)
                self._reconciled_ok += 1
                self._reconcile_at = now + self.router.reconcile_interval_s
                self._router_ok()
                # what this list showed to differ, not what is pending: a call in flight whose
                # effect the list already shows (sglang-router's job done, its confirming poll
                # not yet back) is not work this reconcile found
                urls = self._urls
                result.update(
                    listed=len(listed),
                    routable=len(desired),
                    to_add=sorted(u for u, st in urls.items() if st.want and u not in listed),
                    to_remove=sorted(u for u, st in urls.items() if not st.want and u in listed),
                )
            else:
                self._router_failed(f"reconcile: {error}")
                self._reconcile_at = now + min(
                    self.router.reconcile_interval_s, self.router.backoff_s(self._router_failures)
                )
            self._last_reconcile = result
            self._cond.notify_all()

    def _apply_list(
        self, listed: set[str], desired: dict[str, str], fleet: set[str], seq: int, began: float
    ) -> None:
        for url in listed | set(desired) | fleet | set(self._urls):
            st = self._entry(url)
            if not st.in_flight and st.done_at <= began:
                st.known = url in listed  # the list is newer than any call's answer
            if st.event_seq > seq:
                continue  # a transition arrived while listing: it decides
            if url in desired:
                st.want, st.fleet = True, True
                self._group_urls.setdefault(desired[url], url)
            elif url in fleet or st.fleet:
                st.want, st.fleet = False, True
            elif self.router.remove_unknown:
                st.want = False
            else:
                st.want = url in listed  # an unknown worker, left as it is
            if st.dirty:
                st.next_try = min(st.next_try, time.monotonic())
        for url in [
            u
            for u, st in self._urls.items()
            if not st.want
            and st.known is False
            and not st.in_flight
            and st.event_seq <= seq
            and u not in fleet
        ]:
            del self._urls[url]  # gone from the router and from the fleet: forget it

    def reconcile_now(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """Run a reconcile now (one that starts after this call) and return its summary, or
        None when none finished within ``timeout`` (or the sync is not running)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self.running:
                return None
            self._reconcile_asked += 1
            target = self._reconcile_asked
            self._cond.notify_all()
            while self._reconcile_done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self.running:
                    return None
                self._cond.wait(left)
            return dict(self._last_reconcile or {})

    def wait_synced(self, timeout: float = 30.0) -> bool:
        """Wait until every URL is as it should be in the router, as far as its answers said
        (no call in flight or pending); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._reconciled_ok and not any(
                    st.dirty or st.in_flight for st in self._urls.values()
                ):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, Any]:
        """Counters for metrics (JSON-friendly): confirmed ``adds`` and ``removes``, failed
        calls (``failures``; ``router_failing``: consecutive ones now), ``pending`` URLs not yet
        as they should be, ``reconciles`` and the ``last_reconcile``, and the removal lag
        (``last_removal_lag_s``, ``max_removal_lag_s``: from the transition that took a group
        out of ``active`` to the router's answer confirming the removal)."""
        with self._cond:
            return {
                "router": self.router.url,
                "kind": self.router.kind,
                "running": self.running,
                "adds": self._adds,
                "removes": self._removes,
                "failures": self._failures,
                "router_failing": self._router_failures,
                "last_error": self._last_error,
                "pending": sum(1 for st in self._urls.values() if st.dirty or st.in_flight),
                "in_flight": sum(1 for st in self._urls.values() if st.in_flight),
                "routable_urls": sorted(u for u, st in self._urls.items() if st.want),
                "reconciles": self._reconciles,
                "last_reconcile": dict(self._last_reconcile) if self._last_reconcile else None,
                "removals_timed": self._lags,
                "last_removal_lag_s": self._last_lag,
                "max_removal_lag_s": self._max_lag,
            }
