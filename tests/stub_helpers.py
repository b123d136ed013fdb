"""Stub engines for the data plane and gateway tests: the gateway benchmark's zero-work
server (benchmarks/gateway/stub_engine.py: real HTTP/1.1, SGLang's ``/generate`` with fixed
tokens, no model), started as processes of their own, and a registry of groups on them."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_sim import bring_up

from rollsafe.adapters.engines import SGLangClient
from rollsafe.fleet.router import Router
from rollsafe.registry import FleetRegistry

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "benchmarks" / "gateway" / "stub_engine.py"
STUB_TOKEN = 7  # the stub's token id


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Stub:
    """One stub engine process (its own session: killed with its group)."""

    def __init__(self, tmp: Path, token_interval_ms: float = 0.0) -> None:
        self.counters = tmp / f"stub-{id(self)}.counters"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(STUB),
                "--token-interval-ms",
                str(token_interval_ms),
                "--counters",
                str(self.counters),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            preexec_fn=raise_nofile,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("STUB_READY "), line
        self.url = json.loads(line[len("STUB_READY ") :])["url"]

    def stats(self) -> dict[str, int]:
        sys.path.insert(0, str(STUB.parent))
        try:
            from stub_engine import read_counters
        finally:
            sys.path.pop(0)
        return read_counters(self.counters)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def stubs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[Stub]]:
    interval = getattr(request, "param", 0.0)
    made = [Stub(tmp_path, interval), Stub(tmp_path, interval)]
    yield made
    for stub in made:
        stub.stop()


def stub_router(stubs: list[Stub], **kw: Any) -> Router:
    reg = FleetRegistry(fleet_version=1)
    for i, stub in enumerate(stubs):
        reg.add_group(f"g{i}", [i], clients=[SGLangClient(stub.url, timeout=60.0)])
        bring_up(reg, f"g{i}")
    return Router(reg, **kw)
