"""When a starting engine counts as ready, and the error that says why it never did.

Owns the waits of one start (:class:`StartAttempt`): the reference engine is ready once it
printed its ``ROLLSAFE_READY`` line (:func:`wait_for_ready_line`) and then passed a health
check (:func:`wait_for_health`); a real SGLang / vLLM server prints no such line and is ready
once ``/health`` and an info endpoint (:data:`READINESS_PATHS`) answered 200
(:func:`wait_for_http_ready`; a vLLM spec's ``weight_version`` is then set by
``POST /update_weight_version``). Every wait watches the process for an early exit and for a
``stop()`` of the launcher, and fails with :class:`EngineStartError` (the output tail, exit code
and command, the secrets masked) or :class:`EngineStartTimeout`, the engine killed.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from rollsafe.adapters.engines.errors import EngineStartError
from rollsafe.adapters.engines.launch.fork_server import EXIT_UNKNOWN, Proc
from rollsafe.adapters.engines.launch.output import OutputPump, redact
from rollsafe.adapters.engines.launch.process_group import signal_group
from rollsafe.adapters.engines.launch.spec import EngineSpec
from rollsafe.adapters.engines.launch.standby import StandbyLost
from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.adapters.engines.vllm import VLLMClient

__all__ = [
    "READINESS_PATHS",
    "READY_POLL_INTERVAL",
    "EngineStartTimeout",
    "StartAttempt",
    "engine_client",
    "wait_for_health",
    "wait_for_http_ready",
    "wait_for_ready_line",
]

#: What a real engine must answer 200 on, in order, before it counts as ready: ``/health``,
#: then an info endpoint (the first of the list that does not answer 404). SGLang 0.5.23 has
#: ``/model_info`` (``/get_server_info`` is its deprecated alias of ``/server_info``, and what
#: the reference engine serves); vLLM 0.33.0 ``/v1/models``.
READINESS_PATHS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sglang": ("/health", ("/model_info", "/get_server_info")),
    "vllm": ("/health", ("/v1/models",)),
}
#: Seconds between two readiness polls of a real engine.
READY_POLL_INTERVAL = 0.25


class EngineStartTimeout(EngineStartError):
    """The engine was still running but not ready within ``EngineSpec.ready_timeout``: no ready
    line (reference engine), or ``/health`` / the info endpoint never answered 200 (a real
    engine). The group was killed; ``exit_code`` is None."""


@functools.lru_cache(maxsize=1)
def ssl_context() -> Any:
    """httpx's default (verifying) SSL context, built once: building it loads the CA bundle,
    tens of ms that every restart's new client would otherwise pay."""
    return httpx.create_ssl_context()


def engine_client(spec: EngineSpec, url: str) -> SGLangClient | VLLMClient:
    """The client of ``spec``'s dialect on ``url``."""
    client_cls = VLLMClient if spec.dialect == "vllm" else SGLangClient
    return client_cls(
        url,
        api_key=spec.api_key,
        timeout=spec.client_timeout,
        transport=httpx.HTTPTransport(verify=ssl_context()),
    )


@dataclass
class StartAttempt:
    """One engine start being waited for: the spec, the command, the process and its output,
    and the launcher's stop request (set by ``stop()`` / ``kill()``)."""

    spec: EngineSpec
    cmd: list[str]
    proc: Proc
    pump: OutputPump
    stop_requested: threading.Event

    def fail(self, reason: str, *, timeout: bool = False) -> EngineStartError:
        """Kill the engine if it still runs and return the error to raise:
        :class:`EngineStartTimeout` for a ``timeout`` while it ran, else
        :class:`EngineStartError`."""
        proc = self.proc
        exit_code = proc.poll()
        if exit_code is None:
            signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.pump.close(timeout=1.0)
        cls = EngineStartTimeout if timeout and exit_code is None else EngineStartError
        return cls(
            reason,
            command=[redact(a, self.spec.secrets()) for a in self.cmd],
            exit_code=exit_code,
            output_tail=self.pump.text(),
            log_path=self.pump.log_path,
        )

    def check_not_stopped(self) -> None:
        """A start in progress ends (the engine killed) once stop() or kill() was called."""
        if self.stop_requested.is_set():
            raise self.fail("stop() was called while the engine was starting")


def wait_for_ready_line(
    attempt: StartAttempt, deadline: float, *, from_standby: bool = False
) -> dict[str, Any]:
    """The reference engine's ``ROLLSAFE_READY`` payload, once printed. :class:`StandbyLost`
    if an engine forked by a standby (``from_standby``) was killed before it (not the engine's
    fault: the caller starts afresh)."""
    proc, pump = attempt.proc, attempt.pump
    while not pump.ready_event.wait(0.05):
        attempt.check_not_stopped()
        if proc.poll() is not None:
            pump.wait_eof(0.2)  # collect the last output lines
            code = proc.returncode
            if pump.ready is None:
                if from_standby and code is not None and (code < 0 or code == EXIT_UNKNOWN):
                    # killed (or its zygote vanished) before its ready line: not the
                    # engine's fault
                    raise StandbyLost(
                        f"the engine forked by the standby (pid {proc.pid}) exited with "
                        f"code {code} before its ready line"
                    )
                raise attempt.fail(f"engine exited with code {code} before it was ready")
            break
        if time.monotonic() >= deadline:
            raise attempt.fail(
                f"no ready line within {attempt.spec.ready_timeout:.1f}s", timeout=True
            )
    if pump.ready is None:
        raise attempt.fail(pump.ready_error or "bad ready line")
    return pump.ready


def wait_for_health(
    attempt: StartAttempt, client: SGLangClient | VLLMClient, deadline: float
) -> None:
    """After the ready line: poll ``client``'s health check until it passes."""
    proc = attempt.proc
    last = ""
    while True:
        attempt.check_not_stopped()
        if proc.poll() is not None:
            raise attempt.fail(
                f"engine exited with code {proc.returncode} after its ready "
                "line, before a health check passed"
            )
        remaining = deadline - time.monotonic()
        try:
            client.health(timeout=max(0.5, min(5.0, remaining)))
            return
        except Exception as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise attempt.fail(
                f"ready line seen but health check did not pass within "
                f"{attempt.spec.ready_timeout:.1f}s: {last}",
                timeout=True,
            )
        time.sleep(0.1)


def wait_for_http_ready(attempt: StartAttempt, url: str) -> dict[str, Any]:
    """A real engine's readiness: poll ``/health``, then its info endpoint, until both
    answered 200, the process exits or ``spec.ready_timeout`` passes; then set a vLLM spec's
    weight version. Returns what the launcher reports as :attr:`EngineLauncher.ready_info`."""
    spec = attempt.spec
    t0 = time.monotonic()
    deadline = t0 + spec.ready_timeout
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    # trust_env=False: the engine is on this host; a proxy from the environment is not
    with httpx.Client(base_url=url, headers=headers, verify=ssl_context(), trust_env=False) as http:
        info, info_path = _poll_until_ready(attempt, http, deadline)
        weight_version = info.get("weight_version")
        source = "engine"
        if spec.kind == "vllm" and spec.weight_version is not None:
            weight_version, source = _set_vllm_weight_version(attempt, http, deadline)
    return {
        "url": url,
        "pid": attempt.proc.pid,
        "rank_pids": [],
        "ranks": spec.ranks,
        "kind": spec.kind,
        "dialect": spec.dialect,
        "weight_version": weight_version,
        "weight_version_source": source,
        "health_path": READINESS_PATHS[spec.kind][0],
        "info_path": info_path,
        "info": info,
        "startup_s": round(time.monotonic() - t0, 3),
        "from_standby": False,
    }


def _poll_until_ready(
    attempt: StartAttempt, http: httpx.Client, deadline: float
) -> tuple[dict[str, Any], str]:
    """Poll ``/health`` until 200, then the info endpoints (the next one where one answers
    404) until one answers 200 with a JSON object; return that object and its path."""
    spec, proc = attempt.spec, attempt.proc
    health_path, info_candidates = READINESS_PATHS[spec.kind]
    info_paths = list(info_candidates)
    healthy = False
    last = "no answer yet"
    while True:
        path = info_paths[0] if healthy else health_path
        attempt.check_not_stopped()
        if proc.poll() is not None:
            attempt.pump.wait_eof(0.5)  # collect the last output lines
            raise attempt.fail(
                f"engine exited with code {proc.returncode} before it answered 200 on "
                f"{path} (last poll: {last})"
            )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise attempt.fail(
                f"engine did not answer 200 on {health_path} and "
                f"{' / '.join(info_candidates)} within {spec.ready_timeout:.1f}s "
                f"(last poll: {last})",
                timeout=True,
            )
        try:
            resp = http.get(path, timeout=max(0.2, min(5.0, remaining)))
        except httpx.HTTPError as exc:
            last = f"GET {path}: {type(exc).__name__}: {exc}"
        else:
            if resp.status_code == 200 and not healthy:
                healthy = True
                continue
            if resp.status_code == 200:
                try:
                    info = resp.json()
                except ValueError:
                    info = None
                if isinstance(info, dict):
                    return info, path
                last = f"GET {path} answered 200 with a body that is no JSON object"
            elif resp.status_code == 404 and healthy and len(info_paths) > 1:
                info_paths.pop(0)
                continue
            else:
                last = f"GET {path} answered {resp.status_code}: {resp.text[:200]!r}"
        time.sleep(min(READY_POLL_INTERVAL, max(0.0, deadline - time.monotonic())))


def _serves_weight_version(http: httpx.Client, deadline: float) -> bool:
    """Whether the vLLM release behind ``http`` has ``/update_weight_version`` (0.32+; 0.26
    has none: its client keeps the label), read from its ``GET /version`` and the committed
    contracts. A server that does not say (no ``/version``, an unknown version) is assumed to
    have it, as ``VLLMClient`` assumes the pinned release."""
    from rollsafe.adapters.engines.contract import UnsupportedVersion, contract_version_for
    from rollsafe.adapters.engines.vllm_dialect import VLLMDialect

    try:
        answer = http.get("/version", timeout=max(1.0, min(10.0, deadline - time.monotonic())))
        reported = answer.json().get("version") if answer.status_code == 200 else None
        if not isinstance(reported, str):
            return True
        return VLLMDialect.of(contract_version_for("vllm", reported)).weight_version_routes
    except (httpx.HTTPError, ValueError, AttributeError, UnsupportedVersion):
        return True


def _set_vllm_weight_version(
    attempt: StartAttempt, http: httpx.Client, deadline: float
) -> tuple[str, str]:
    """vLLM takes no weight version at start: ``POST /update_weight_version`` (a dev-mode
    route, ``vllm/entrypoints/rl/online/api_router.py``) sets it; vLLM 0.26.0 has no such
    route, so there the label is the client's (``VLLMClient.update_weight_version``, nothing
    sent). Returns ``(version, source)``: ``"engine"`` or ``"client"``."""
    version = str(attempt.spec.weight_version)
    if not _serves_weight_version(http, deadline):
        return version, "client"
    path = "/update_weight_version"
    try:
        resp = http.post(
            path,
            json={"new_version": version},
            timeout=max(1.0, min(30.0, deadline - time.monotonic())),
        )
    except httpx.HTTPError as exc:
        raise attempt.fail(
            f"POST {path} failed after the engine was ready: {type(exc).__name__}: {exc}"
        ) from exc
    if resp.status_code != 200:
        raise attempt.fail(
            f"POST {path} answered {resp.status_code} after the engine was ready (is "
            f"VLLM_SERVER_DEV_MODE=1 set?): {resp.text[:500]!r}"
        )
    return version, "engine"
