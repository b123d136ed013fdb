"""Command line of the reference engine: ``python -m rollsafe.adapters.reference_engine``.

Owns start-up: argument checks (refuse a non-loopback bind without an API key; check the
model and tokenizer directories and the request limits), spawning the ranks, serving HTTP
under those limits, and the single
``ROLLSAFE_READY {json}`` line printed (flushed) on stdout once the server listens. Start-up
errors go to stderr with a non-zero exit status.

Order matters for start-up time. Importing torch and transformers is most of a cold start, so
on CPU rank 0 imports everything once (:func:`preload`) and then forks ranks ``1..N-1``, which
start with those modules already loaded; with CUDA (where forking is unsafe) the ranks are
spawned first, before rank 0's own imports, so all ranks import at the same time. See
:mod:`.bootstrap` for the rank protocol. The ready line carries ``startup_s``: seconds from
``main()`` to each start-up phase, and ``rank_start_method``.

Warm standby (``--standby [--model-path DIR]``): the process imports everything ``main()``
would (torch, transformers, tokenizers, aiohttp, every engine module, both dialects, and the
model classes of ``--model-path`` if given; CUDA is never initialised), prints one line
``ROLLSAFE_STANDBY {"pid": ..., "import_s": ..., ...}`` (flushed) and blocks reading ONE line
from stdin, the handoff ``{"argv": [...], "env": {...}}``: ``argv`` are the normal engine
arguments (no interpreter, no module), ``env`` variables set before ``main(argv)`` runs (ones
read at import time, such as ``OMP_NUM_THREADS``, have already been read). EOF or an empty line
exits 0; a malformed line exits 2 with the reason on stderr. From then on it is a normal start:
the same ``ROLLSAFE_READY`` line, with ``startup_s`` counted from the handoff,
``from_standby: true`` and ``standby: {"import_s", "idle_s"}``. The process stays
single-threaded while it waits, so CPU ranks are still forked from it.

Fork server (``--standby --fork-server-fd FD``, what ``EngineLauncher`` runs): the same imports
and line (with ``"fork_server": true``), then the process stays resident and forks one engine
per request read from ``FD`` instead of becoming the engine; each child runs ``main()`` as
above (``standby`` also holds ``zygote_pid``). Protocol and why forking is safe:
:mod:`.zygote`.

The API key comes from ``--api-key-file PATH`` (the file's content, surrounding whitespace
stripped) or the ``ROLLSAFE_API_KEY`` environment variable, so that it does not show in ``ps``;
``--api-key KEY`` is still accepted but visible to every user of the host.

Run as a program, the process exits through :func:`exit_fast` once ``main()`` returned: the
interpreter teardown it skips costs a second or more with torch loaded, on every stop.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import importlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, cast

from rollsafe.adapters.reference_engine.bootstrap import (
    RankChild,
    RankOptions,
    StartupClock,
    fork_is_safe,
    start_ranks,
)
from rollsafe.adapters.reference_engine.dialects import DEFAULT_VLLM_VERSION, VLLM_VERSIONS
from rollsafe.adapters.reference_engine.errors import ServerError, StartupError
from rollsafe.adapters.reference_engine.gc_heap import freeze_heap, warn_long_pauses
from rollsafe.adapters.reference_engine.paths import check_dir
from rollsafe.adapters.reference_engine.zygote import FORK_SERVER_FLAG
from rollsafe.errors import RollsafeError
from rollsafe.net import is_loopback
from rollsafe.wire.lines import READY_PREFIX, STANDBY_PREFIX

EXIT_USAGE = 2
EXIT_START = 3
#: the exit status after the engine core died (vLLM dialect: a forward pass over poisoned
#: weights or in the middle of a weight update); what vLLM's API server exits with then
EXIT_ENGINE_DEAD = 0
STANDBY_FLAG = "--standby"

#: seconds between an engine death and the exit: the 500s of what was in flight are written
DEATH_GRACE_S = 0.5

_PACKAGE = "rollsafe.adapters.reference_engine"
#: What start-up imports besides torch (``api`` modules are per dialect).
_ENGINE_MODULES = ("aiohttp.web", "ranks", "engine", "faults", "server")
#: What a node slice other than the head's imports before forking its ranks (no server there)
_RANK_MODULES = ("ranks",)
#: What a start imports on its way (besides :data:`_ENGINE_MODULES`); a standby imports them
#: ahead, best effort.
_LAZY_MODULES = (
    "checker_api",
    "rollsafe.adapters.engines.contract",
    "rollsafe.checksum",
    "safetensors",
    "safetensors.torch",
)
#: the environment variable an API key may come from (read once, then removed)
API_KEY_ENV = "ROLLSAFE_API_KEY"


@dataclass(frozen=True)
class StandbyStart:
    """How a start that came from a warm standby began (reported in the ready line)."""

    handoff_at: float  # time.monotonic() when the handoff line (or fork request) was read
    import_s: float  # the standby's imports
    idle_s: float  # from the standby line to the handoff
    zygote_pid: int | None = None  # set when forked by a fork server (``--fork-server-fd``)

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "import_s": round(self.import_s, 3),
            "idle_s": round(self.idle_s, 3),
        }
        if self.zygote_pid is not None:
            out["zygote_pid"] = self.zygote_pid
        return out


class HandoffError(RollsafeError, ValueError):
    """A warm standby's handoff line is malformed (the standby exits with ``EXIT_USAGE``)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rollsafe.adapters.reference_engine",
        description="rollsafe reference inference engine (SGLang / vLLM HTTP dialects)",
        epilog="--standby [--model-path DIR] runs a warm standby instead: it imports everything, "
        'prints ROLLSAFE_STANDBY {json} and starts with the arguments of one {"argv": [...], '
        '"env": {...}} line read from stdin (see --standby --help)',
    )
    p.add_argument(
        "--model-path", required=True, help="HF model directory (config.json + safetensors)"
    )
    p.add_argument(
        "--tokenizer-path",
        default=None,
        help="directory holding tokenizer.json (default: the model directory)",
    )
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--ranks", type=int, default=1, help="number of rank processes (TP-like)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (visible in ps: prefer --api-key-file or "
        f"{API_KEY_ENV})",
    )
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (surrounding whitespace stripped); without a "
        f"key flag the key comes from ${API_KEY_ENV} if set",
    )
    p.add_argument("--dialect", choices=["sglang", "vllm"], default="sglang")
    p.add_argument(
        "--vllm-version",
        choices=list(VLLM_VERSIONS),
        default=None,
        help=f"the vLLM release --dialect vllm imitates (default {DEFAULT_VLLM_VERSION}); "
        "docs/engines.md lists what differs",
    )
    _limit_args(p)
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=30.0,
        help="seconds before a collective among the engine's ranks fails",
    )
    p.add_argument(
        "--weight-group-timeout",
        type=float,
        default=120.0,
        help="seconds before a trainer weight-update group operation fails",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=180.0,
        help="seconds for every rank to load its shard and join the rank group",
    )
    p.add_argument(
        "--rank-backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="the ranks' own group: gloo (host copies; works with ranks sharing a GPU) or nccl "
        "(--device cuda, one GPU per rank)",
    )
    p.add_argument(
        "--rank-start-method",
        choices=["auto", "fork", "spawn"],
        default="auto",
        help="how ranks 1..N-1 start: auto = fork on CPU when safe (no re-import), else spawn",
    )
    p.add_argument("--weight-version", default="default")
    p.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="apply weight updates that hold NaN/inf values (refused with a 400 by default)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes the --ranks span (SGLang's flag): --ranks // --nnodes ranks on each",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's rank (0: the head, which serves HTTP; others run their ranks only)",
    )
    p.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="where the head listens for the other nodes (with --nnodes > 1; the key is "
        "$ROLLSAFE_DIST_INIT_KEY, required off loopback)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per rank (0: (cpus - 1) // ranks, at least 1)",
    )
    return p.parse_args(argv)


#: the request and connection limits: (flag, ServerLimits field, type, default, least, help).
#: The defaults equal :class:`~.server.ServerLimits`'s (a test holds them together); they are
#: kept here so that parsing the command line does not import the server (aiohttp, torch)
#: before CUDA ranks are spawned.
LIMIT_FLAGS: tuple[tuple[str, str, type, float, float, str], ...] = (
    (
        "--max-body-bytes",
        "max_body_bytes",
        int,
        64 << 20,
        1024,
        "largest request body; a larger Content-Length is answered 413 before reading",
    ),
    (
        "--max-prompts-per-request",
        "max_prompts",
        int,
        1024,
        1,
        "most prompts in one generation request (400 past it)",
    ),
    (
        "--max-total-new-tokens",
        "max_total_new_tokens",
        int,
        1 << 18,
        1,
        "most new tokens one request may ask for, max_new_tokens summed over its prompts "
        "(400 past it)",
    ),
    (
        "--max-concurrent-requests",
        "max_concurrent_requests",
        int,
        1024,
        1,
        "most prompts queued or running in the engine; a request past it is answered 503 and "
        "not queued",
    ),
    (
        "--max-connections",
        "max_connections",
        int,
        512,
        1,
        "most open HTTP connections; one more is answered 503 and closed",
    ),
    (
        "--header-timeout",
        "header_timeout_s",
        float,
        30.0,
        0.001,
        "seconds for a request's headers to arrive (from connect or from the previous "
        "response; an idle kept-alive connection closes sooner, after $SGLANG_TIMEOUT_KEEP_ALIVE "
        "or $VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds, 5 by default, as on the real servers)",
    ),
    (
        "--body-timeout",
        "body_timeout_s",
        float,
        60.0,
        0.001,
        "seconds for a request's body to arrive (408 past it)",
    ),
    (
        "--body-idle-timeout",
        "body_idle_timeout_s",
        float,
        5.0,
        0.001,
        "longest pause in seconds between two pieces of a request's body (408 past it)",
    ),
    (
        "--max-inflight-body-bytes",
        "max_inflight_body_bytes",
        int,
        256 << 20,
        1024,
        "request body bytes being read or held, all connections together; a body past it is "
        "answered 503 before reading",
    ),
)


def _limit_args(p: argparse.ArgumentParser) -> None:
    for flag, _, kind, default, _, text in LIMIT_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default:g})")


def _limit_problem(args: argparse.Namespace) -> str | None:
    for flag, _, _, _, least, _ in LIMIT_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if not value >= least or value == float("inf"):  # also NaN
            return f"{flag} must be >= {least:g}, got {value}"
    return None


#: The variable each dialect's server reads for uvicorn's ``timeout_keep_alive`` (SGLang
#: 0.5.x ``envs.SGLANG_TIMEOUT_KEEP_ALIVE``, vLLM ``envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: an
#: int, 5 when unset): how long an idle kept-alive connection stays open after a response.
KEEPALIVE_ENV = {"sglang": "SGLANG_TIMEOUT_KEEP_ALIVE", "vllm": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"}
KEEPALIVE_DEFAULT_S = 5


def keepalive_timeout(dialect: str, environ: Any = None) -> int | str:
    """The idle keep-alive seconds ``dialect``'s variable sets (:data:`KEEPALIVE_ENV`), or
    what is wrong with it (the real servers parse it with ``int()``)."""
    name = KEEPALIVE_ENV[dialect]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return KEEPALIVE_DEFAULT_S
    try:
        value = int(raw)
    except ValueError:
        return f"${name} must be a whole number of seconds, got {raw!r}"
    if value < 0:
        return f"${name} must be >= 0, got {value}"
    return value


def server_limits(args: argparse.Namespace) -> Any:
    """The :class:`~.server.ServerLimits` of the command line (and of the dialect's
    keep-alive variable, :data:`KEEPALIVE_ENV`)."""
    from rollsafe.adapters.reference_engine.server import ServerLimits

    keepalive = keepalive_timeout(args.dialect)
    if isinstance(keepalive, str):  # check_args refuses it first
        raise ValueError(keepalive)
    return ServerLimits(
        **{field: getattr(args, flag[2:].replace("-", "_")) for flag, field, *_ in LIMIT_FLAGS},
        keepalive_timeout_s=float(keepalive),
    )


def resolve_api_key(args: argparse.Namespace, environ: Any = None) -> str | None:
    """Set ``args.api_key`` from ``--api-key-file`` or ``$ROLLSAFE_API_KEY`` (removed from the
    environment once read, so the ranks do not inherit it); ``None`` when all went well, else
    what is wrong. A key given by none of them leaves the engine without authentication."""
    env = os.environ if environ is None else environ
    from_env = env.pop(API_KEY_ENV, None)
    if args.api_key is not None:
        return None
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.read(1 << 16).strip()
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            return f"--api-key-file {args.api_key_file!r} cannot be read: {reason}"
        if not key:
            return f"--api-key-file {args.api_key_file!r} is empty"
        args.api_key = key
    elif from_env is not None:
        if not from_env.strip():
            return f"${API_KEY_ENV} is set but empty"
        args.api_key = from_env.strip()
    return None


def check_args(args: argparse.Namespace) -> str | None:
    if args.ranks < 1:
        return f"--ranks must be >= 1, got {args.ranks}"
    problem = check_nodes(args)
    if problem is not None:
        return problem
    if args.node_rank > 0:  # a node without the server: the HTTP flags do not apply
        return None
    if args.vllm_version is not None and args.dialect != "vllm":
        return f"--vllm-version {args.vllm_version} needs --dialect vllm (got {args.dialect})"
    problem = resolve_api_key(args)
    if problem is not None:
        return problem
    if not is_loopback(args.host) and not args.api_key:
        return (
            f"refusing to bind non-loopback address {args.host!r} without an API key "
            f"(--api-key-file, ${API_KEY_ENV} or --api-key): anyone who can reach it could "
            "replace the weights"
        )
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key must not be empty"
    problem = _limit_problem(args)
    if problem is not None:
        return problem
    keepalive = keepalive_timeout(args.dialect)
    if isinstance(keepalive, str):
        return keepalive
    if args.start_timeout <= 0:
        return "--start-timeout must be > 0"
    if args.rank_backend == "nccl" and args.device != "cuda":
        return "--rank-backend nccl needs --device cuda"
    try:
        check_dir(
            args.model_path, what="--model-path", must_contain=("config.json",), error=StartupError
        )
        if args.tokenizer_path is not None:
            check_dir(
                args.tokenizer_path,
                what="--tokenizer-path",
                must_contain=("tokenizer.json",),
                error=StartupError,
            )
    except ServerError as exc:
        return str(exc)
    return None  # --device cuda is checked by each rank once torch is imported


def check_nodes(args: argparse.Namespace) -> str | None:
    """The multi-node flags (:mod:`.nodes`): whole node slices, a node rank in range, an
    address (and, off loopback, a key) when the ranks span nodes."""
    from rollsafe.adapters.reference_engine.nodes import dist_key, parse_dist_init_addr

    if args.nnodes < 1 or args.ranks % args.nnodes:
        return f"--nnodes {args.nnodes} must be >= 1 and divide --ranks {args.ranks}"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}"
    if args.nnodes == 1:
        return None
    if args.dist_init_addr is None:
        return "--nnodes > 1 needs --dist-init-addr HOST:PORT (where the head listens)"
    if args.rank_backend == "nccl":
        return "--nnodes > 1 runs the ranks' group over gloo (--rank-backend nccl is one node's)"
    try:
        host, _ = parse_dist_init_addr(args.dist_init_addr)
        dist_key(host)
    except ServerError as exc:
        return str(exc)
    return None


def rank_options(args: argparse.Namespace) -> RankOptions:
    host = "127.0.0.1"
    if args.nnodes > 1:
        from rollsafe.adapters.reference_engine.nodes import parse_dist_init_addr

        host = parse_dist_init_addr(args.dist_init_addr)[0]
    return RankOptions(
        model_path=str(Path(args.model_path).resolve()),
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        world_size=args.ranks,
        collective_timeout_s=args.collective_timeout,
        weight_group_timeout_s=args.weight_group_timeout,
        threads=args.threads,
        rank_backend=args.rank_backend,
        start_timeout_s=args.start_timeout,
        start_method=args.rank_start_method,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_host=host,
    )


def preload(opts: RankOptions, dialect: str, *, serving: bool = True) -> None:
    """Import every module start-up needs, including the model's transformers classes.

    Run before forking ranks so they inherit the imports. ``serving=False`` (a node slice
    other than the head's, which runs ranks and no server): the ranks' modules only, not the
    HTTP server's and the API's, so a slice that starts beside its head (on a shared or small
    machine) takes less CPU from it. Raises :class:`StartupError` for ``--device cuda``
    without CUDA. Best effort otherwise: a broken model directory is reported by the real load
    later, with its proper message.
    """
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():  # before the slow imports
        raise StartupError("--device cuda but torch.cuda.is_available() is false")
    api = "sglang_api" if dialect == "sglang" else "vllm_api"
    for name in (*_ENGINE_MODULES, api) if serving else _RANK_MODULES:
        importlib.import_module(name if "." in name else f"{_PACKAGE}.{name}")
    from rollsafe.adapters.reference_engine.model import load_config, model_class

    with contextlib.suppress(Exception):
        model_class(load_config(opts.model_path))


def _eos_ids(model_path: str, config: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None),):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(ValueError, OSError):
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(i) for i in eos)
    return tuple(sorted(ids))


async def serve(
    args: argparse.Namespace,
    opts: RankOptions,
    children: list[RankChild],
    clock: StartupClock,
    codec: Any,
    start_method: str,
    standby: StandbyStart | None = None,
    listener: Any = None,
) -> int:
    from rollsafe.adapters.reference_engine.dialects import VLLMRelease
    from rollsafe.adapters.reference_engine.engine import ReferenceEngine
    from rollsafe.adapters.reference_engine.faults import FaultInjector, fault_injection_enabled
    from rollsafe.adapters.reference_engine.ranks import RankSet
    from rollsafe.adapters.reference_engine.server import (
        ServerContext,
        build_app,
        start_server,
    )

    holder: dict[str, ReferenceEngine] = {}
    loop = asyncio.get_running_loop()

    def on_rank_failure(reason: str) -> None:
        engine = holder.get("engine")
        if engine is not None:
            engine.fail(reason)
        print(f"rollsafe engine: {reason}", file=sys.stderr, flush=True)

    ranks = await loop.run_in_executor(
        None,
        lambda: RankSet(
            opts, children=children, on_failure=on_rank_failure, clock=clock, listener=listener
        ),
    )
    cfg = ranks.local.model.config
    engine = ReferenceEngine(
        ranks,
        eos_token_ids=_eos_ids(opts.model_path, cfg),
        max_context=int(getattr(cfg, "max_position_embeddings", 4096)),
        weight_version=args.weight_version,
    )
    engine.allow_non_finite = bool(args.allow_non_finite)
    holder["engine"] = engine
    if ranks.failure is not None:
        engine.fail(ranks.failure)
    ctx = ServerContext(
        engine=engine,
        codec=codec,
        model_name=args.served_model_name or opts.model_path,
        dialect=args.dialect,
        device=args.device,
        rank_pids=ranks.rank_pids,
        limits=server_limits(args),
        vllm=VLLMRelease(args.vllm_version or DEFAULT_VLLM_VERSION),
    )
    app = build_app(ctx, api_key=args.api_key, faults=FaultInjector(fault_injection_enabled()))
    runner, port = await start_server(app, args.host, args.port, ctx.limits)
    stop = asyncio.Event()
    died: list[str] = []

    def on_death(reason: str) -> None:  # driver thread
        loop.call_soon_threadsafe(_engine_died, reason)

    def _engine_died(reason: str) -> None:
        # vLLM's API server stops listening at once and exits once the answers are out
        print(f"rollsafe engine: engine core died: {reason}", file=sys.stderr, flush=True)
        died.append(reason)
        for site in runner.sites:
            server = getattr(site, "_server", None)
            if server is not None:
                server.close()
        loop.call_later(DEATH_GRACE_S, stop.set)

    engine.on_death = on_death
    url_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    clock.mark("serving")
    ready = {
        "url": f"http://{url_host}:{port}",
        "pid": os.getpid(),
        "rank_pids": ranks.rank_pids,
        "remote_rank_pids": {str(r): p for r, p in ranks.remote_rank_pids.items()},
        "nnodes": opts.nnodes,
        "ranks": args.ranks,
        "dialect": args.dialect,
        "vllm_version": ctx.vllm.version if args.dialect == "vllm" else None,
        "device": args.device,
        "weight_version": engine.weight_version,
        "tokenizer_path": str(codec.path) if codec.tokenizer is not None else None,
        "rank_start_method": start_method if opts.world_size > 1 else None,
        "startup_s": clock.phases,
        "from_standby": standby is not None,
        "standby": standby.as_dict() if standby is not None else None,
    }
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the ready line: a stop right after it
        loop.add_signal_handler(sig, stop.set)  # is a graceful one
    # as vLLM and SGLang once up: the start-up heap is never walked again (gc_heap)
    ready["gc_frozen"] = freeze_heap()
    warn_long_pauses("rank 0")  # serving from here: a long collection is a pause to log
    sys.stdout.write(f"{READY_PREFIX}{json.dumps(ready)}\n")
    sys.stdout.flush()
    await stop.wait()
    if died:  # the answers in flight were written during the grace; nothing waits for more
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runner.cleanup(), DEATH_GRACE_S)
        engine.close()
        return EXIT_ENGINE_DEAD
    await runner.cleanup()
    engine.close()
    return 0


def main(argv: list[str] | None = None, *, standby: StandbyStart | None = None) -> int:
    """Run the engine (``argv`` as on the command line); ``--standby`` runs a warm standby.

    ``standby`` is set when a warm standby hands off to this call (see the module docstring).
    """
    if standby is None:
        raw = sys.argv[1:] if argv is None else argv
        if STANDBY_FLAG in raw:
            return standby_main(raw)
    clock = StartupClock(standby.handoff_at if standby is not None else None)
    args = parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        print(f"rollsafe engine: error: {problem}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    opts = rank_options(args)
    # numpy's OpenBLAS would start a thread pool on import; the engine never uses it, and a
    # single-threaded process is what makes forking the ranks safe
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if opts.nnodes > 1 and opts.node_rank > 0:
        return node_main(args, opts)
    children: list[RankChild] = []
    listener: Any = None
    try:
        from rollsafe.adapters.reference_engine.codec import TextCodec

        tokenizer_dir = args.tokenizer_path or opts.model_path
        codec = TextCodec(tokenizer_dir, required=args.tokenizer_path is not None)
        method = opts.planned_start_method()
        if opts.ranks_per_node > 1 and method == "spawn":
            children, method = start_ranks(opts, "spawn")  # before the heavy imports
            clock.mark("ranks_started")
        preload(opts, args.dialect)
        clock.mark("preloaded")
        if opts.ranks_per_node > 1 and method == "fork":
            children, method = start_ranks(opts, "fork")  # they inherit the imports
            clock.mark("ranks_started")
        if opts.nnodes > 1:  # the other nodes may connect while this one loads
            listener = head_listener(args)
        return asyncio.run(
            serve(args, opts, children, clock, codec, method, standby, listener=listener)
        )
    except Exception as exc:
        for child in children:
            with contextlib.suppress(Exception):
                child.proc.kill()
        if listener is not None:
            listener.close()
        print(
            f"rollsafe engine: failed to start: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_START


def head_listener(args: argparse.Namespace) -> Any:
    """The head's open listener for the other nodes (:class:`~.nodes.NodeListener`)."""
    from rollsafe.adapters.reference_engine.nodes import (
        NodeListener,
        dist_key,
        parse_dist_init_addr,
    )

    host, port = parse_dist_init_addr(args.dist_init_addr)
    return NodeListener(rank_options(args), host, port, dist_key(host)).open()


def node_main(args: argparse.Namespace, opts: RankOptions) -> int:
    """Node rank > 0 (:func:`~.nodes.slice_main`): this node's ranks, linked to the head."""
    from rollsafe.adapters.reference_engine.nodes import (
        dist_key,
        parse_dist_init_addr,
        slice_main,
    )

    host, port = parse_dist_init_addr(args.dist_init_addr)
    method = opts.planned_start_method()
    if method == "fork":
        preload(opts, args.dialect, serving=False)  # the ranks inherit the imports
        if not fork_is_safe(opts):
            method = "spawn"
    return slice_main(opts, (host, port), dist_key(host), method)


# --------------------------------------------------------------------------- warm standby
def parse_standby_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rollsafe.adapters.reference_engine --standby",
        description="warm standby: import everything, print ROLLSAFE_STANDBY {json}, then read "
        'one handoff line {"argv": [...], "env": {...}} from stdin and start the engine with it',
    )
    p.add_argument(STANDBY_FLAG, action="store_true", required=True)
    p.add_argument(
        "--model-path",
        default=None,
        help="also import the transformers classes of this model's architecture (any directory "
        "with the same config.json architecture as the one handed off later)",
    )
    p.add_argument(
        FORK_SERVER_FLAG,
        type=int,
        default=None,
        metavar="FD",
        help="stay resident as a fork server ('zygote'): read fork requests from this AF_UNIX "
        "SOCK_SEQPACKET descriptor instead of one handoff line from stdin (see the "
        "reference_engine.zygote module)",
    )
    return p.parse_args(argv)


def standby_imports(model_path: str | None = None) -> None:
    """Import everything :func:`main` imports lazily, for either dialect; never touch CUDA.

    ``model_path`` (best effort) also imports its transformers modeling module.
    """
    import torch  # noqa: F401

    for name in (*_ENGINE_MODULES, "sglang_api", "vllm_api", "codec", "model", "weights"):
        importlib.import_module(name if "." in name else f"{_PACKAGE}.{name}")
    importlib.import_module("tokenizers")
    importlib.import_module("transformers.models.auto.modeling_auto")
    # what a start still imports lazily (a few hundred ms on CPU, paid by every fork otherwise):
    # the HTTP contracts build_app checks requests against (parsed once per process), the
    # weights loader and the checksum of the checker routes
    for name in _LAZY_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name if "." in name else f"{_PACKAGE}.{name}")
    with contextlib.suppress(Exception):
        from rollsafe.adapters.engines.contract import load_contract

        load_contract("sglang")
        load_contract("vllm")
    if model_path:
        from rollsafe.adapters.reference_engine.model import load_config, model_class

        with contextlib.suppress(Exception):
            model_class(load_config(model_path))


def parse_handoff(line: str) -> tuple[list[str], dict[str, str]]:
    """The ``(argv, env)`` of a handoff line; :class:`HandoffError` naming what is wrong."""
    try:
        msg = json.loads(line)
    except ValueError as exc:
        raise HandoffError(f"not JSON ({exc}): {line[:200]!r}") from exc
    return check_handoff(msg)


def check_handoff(msg: object) -> tuple[list[str], dict[str, str]]:
    """The ``(argv, env)`` of a decoded handoff (a line, or a fork server's request)."""
    if not isinstance(msg, dict):
        raise HandoffError(f"expected a JSON object, got {type(msg).__name__}")
    unknown = sorted(set(msg) - {"argv", "env"})
    if unknown:
        raise HandoffError(f"unknown keys {unknown}; expected 'argv' and optionally 'env'")
    argv = msg.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise HandoffError("'argv' must be a list of strings (the engine arguments)")
    if STANDBY_FLAG in argv:
        raise HandoffError(f"'argv' must not contain {STANDBY_FLAG}")
    env = msg.get("env", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise HandoffError("'env' must be an object of string values")
    return argv, env


def standby_main(argv: list[str]) -> int:
    """Import, announce ``ROLLSAFE_STANDBY``, wait for the handoff line, then run :func:`main`."""
    t0 = time.monotonic()
    args = parse_standby_args(argv)
    # as in main(): no OpenBLAS thread pool, so the process stays single-threaded (forkable)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        standby_imports(args.model_path)
    except Exception as exc:
        print(
            f"rollsafe engine: standby failed to import: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_START
    import torch

    announced = time.monotonic()
    info = {
        "pid": os.getpid(),
        "import_s": round(announced - t0, 3),
        "python": sys.executable,
        "cuda_initialized": bool(cast(Any, torch.cuda).is_initialized()),
    }
    if args.fork_server_fd is not None:
        info["fork_server"] = True
    sys.stdout.write(f"{STANDBY_PREFIX}{json.dumps(info)}\n")
    sys.stdout.flush()
    if args.fork_server_fd is not None:
        return _serve_forks(args.fork_server_fd, t0, announced)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # EOF or an empty line: released without a start
    handoff_at = time.monotonic()
    try:
        engine_argv, env = parse_handoff(line)
    except HandoffError as exc:
        print(
            f"rollsafe engine: error: bad standby handoff line: {exc}", file=sys.stderr, flush=True
        )
        return EXIT_USAGE
    os.environ.update(env)
    start = StandbyStart(
        handoff_at=handoff_at, import_s=announced - t0, idle_s=handoff_at - announced
    )
    return main(engine_argv, standby=start)


def _serve_forks(fd: int, t0: float, announced: float) -> int:
    """``--standby --fork-server-fd FD``: fork one engine per request (see :mod:`.zygote`)."""
    import socket

    from rollsafe.adapters.reference_engine.zygote import serve_forks

    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        print(
            f"rollsafe engine: error: {FORK_SERVER_FLAG} {fd}: {exc}", file=sys.stderr, flush=True
        )
        return EXIT_USAGE

    def run(argv: list[str], handoff_at: float) -> int:
        start = StandbyStart(
            handoff_at=handoff_at,
            import_s=announced - t0,
            idle_s=handoff_at - announced,
            zygote_pid=os.getppid(),
        )
        return main(argv, standby=start)

    return serve_forks(sock, run, check_handoff, exit_fast)


def exit_fast(code: int) -> NoReturn:
    """Exit with ``code`` after the ``atexit`` hooks, skipping the interpreter's teardown.

    With torch and transformers loaded, tearing the interpreter down takes a second or more of
    CPU after ``main()`` returned (module and object deallocation, nothing the engine needs):
    every graceful stop and restart would wait for it. The engine's own clean-up has run by
    then (server closed, ranks shut down); atexit hooks (logging, multiprocessing, weakref
    finalizers) still run and stdio is flushed.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_fast(main())
