"""Command line of the reference engine: ``python -m rollsafe.adapters.reference_engine``.

Owns start-up: argument checks (refuse a non-loopback bind without ``--api-key``), spawning the
ranks, serving HTTP, and the single ``ROLLSAFE_READY {json}`` line printed (flushed) on stdout
once the server listens. Start-up errors go to stderr with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, cast

from rollsafe.adapters.reference_engine import READY_PREFIX

EXIT_USAGE = 2
EXIT_START = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rollsafe.adapters.reference_engine",
        description="rollsafe reference inference engine (SGLang / vLLM HTTP dialects)",
    )
    p.add_argument(
        "--model-path", required=True, help="HF model directory (config.json + safetensors)"
    )
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--ranks", type=int, default=1, help="number of rank processes (TP-like)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--dialect", choices=["sglang", "vllm"], default="sglang")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20)
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
    p.add_argument("--weight-version", default="default")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per rank (0: (cpus - 1) // ranks, at least 1)",
    )
    return p.parse_args(argv)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_args(args: argparse.Namespace) -> str | None:
    if args.ranks < 1:
        return f"--ranks must be >= 1, got {args.ranks}"
    if not _is_loopback(args.host) and not args.api_key:
        return (
            f"refusing to bind non-loopback address {args.host!r} without --api-key: anyone who "
            "can reach it could replace the weights"
        )
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key must not be empty"
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be >= 1024"
    path = Path(args.model_path)
    if not path.is_dir():
        return f"--model-path {str(path)!r} is not a directory"
    if not (path / "config.json").is_file():
        return f"--model-path {str(path)!r} has no config.json"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but torch.cuda.is_available() is false"
    return None


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


async def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from rollsafe.adapters.reference_engine.engine import ReferenceEngine
    from rollsafe.adapters.reference_engine.faults import FaultInjector, fault_injection_enabled
    from rollsafe.adapters.reference_engine.ranks import RankOptions, RankSet
    from rollsafe.adapters.reference_engine.server import ServerContext, TextCodec, build_app

    opts = RankOptions(
        model_path=str(Path(args.model_path).resolve()),
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        world_size=args.ranks,
        collective_timeout_s=args.collective_timeout,
        weight_group_timeout_s=args.weight_group_timeout,
        threads=args.threads,
    )
    holder: dict[str, ReferenceEngine] = {}
    loop = asyncio.get_running_loop()

    def on_rank_failure(reason: str) -> None:
        engine = holder.get("engine")
        if engine is not None:
            engine.fail(reason)
        print(f"rollsafe engine: {reason}", file=sys.stderr, flush=True)

    ranks = await loop.run_in_executor(None, lambda: RankSet(opts, on_failure=on_rank_failure))
    cfg = ranks.local.model.config
    engine = ReferenceEngine(
        ranks,
        eos_token_ids=_eos_ids(opts.model_path, cfg),
        max_context=int(getattr(cfg, "max_position_embeddings", 4096)),
        weight_version=args.weight_version,
    )
    holder["engine"] = engine
    if ranks.failure is not None:
        engine.fail(ranks.failure)
    ctx = ServerContext(
        engine=engine,
        codec=TextCodec(opts.model_path),
        model_name=args.served_model_name or opts.model_path,
        dialect=args.dialect,
        device=args.device,
        rank_pids=ranks.rank_pids,
    )
    app = build_app(
        ctx,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        faults=FaultInjector(fault_injection_enabled()),
    )
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    server = site._server
    assert server is not None
    port = int(cast(Any, server).sockets[0].getsockname()[1])
    url_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    ready = {
        "url": f"http://{url_host}:{port}",
        "pid": os.getpid(),
        "rank_pids": ranks.rank_pids,
        "ranks": args.ranks,
        "dialect": args.dialect,
        "device": args.device,
        "weight_version": engine.weight_version,
    }
    sys.stdout.write(f"{READY_PREFIX} {json.dumps(ready)}\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        print(f"rollsafe engine: error: {problem}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        return asyncio.run(serve(args))
    except Exception as exc:
        print(
            f"rollsafe engine: failed to start: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_START


if __name__ == "__main__":
    sys.exit(main())
