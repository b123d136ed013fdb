"""The reference engine's weight checkers, in each dialect's upstream shape.

Neither real engine serves a rollsafe checksum; this module serves theirs instead:

**SGLang** ``GET|POST /weights_checker`` with a ``CheckWeightsReqInput`` body (all optional):
``action`` (``checksum`` default, ``snapshot``, ``reset_tensors``, ``compare``),
``allow_quant_error`` (bool), ``skip_tensor_list`` (name substrings to leave out), ``selector``
(``target``/``draft``/``all``), plus ``BaseReq``'s ``rid`` / ``http_worker_ipc`` (accepted,
unused). Answers as SGLang 0.5.23's handler: ``{"success", "message"}`` and, for ``checksum``,
``"ranks"`` (one ``ChecksumInfo`` per TP rank: ``checksums`` ``{name: 16 hex}``,
``per_gpu_checksum`` = ``overall_checksum(checksums)``, ``parallelism_info`` = one entry per
runner role) and ``"per_engine_checksum"`` (SHA-256 over the ranks' ``per_gpu_checksum``);
status 200 on success, 400 with ``success: false`` otherwise. Digests use SGLang's algorithm for
the engine's device (:mod:`rollsafe.checksum`: GPU hash on CUDA, SHA-256 prefix on CPU).
``selector="draft"`` has no runner here (no speculative decoding): success without ``ranks``.

What each rank reports is what a real SGLang's rank hashes (its model's ``named_parameters()``
and ``named_buffers()``, ``srt/utils/weight_checker.py``): SGLang's own parameter names, with
``q/k/v_proj`` fused into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``, that TP
rank's shard of each, the vocabulary padded (:meth:`ReferenceEngine.sglang_layout`,
:mod:`rollsafe.engine_layout`), a tied ``lm_head`` listed once (as ``embed_tokens``).
``skip_tensor_list`` substrings match those names, for ``checksum``, ``reset_tensors`` and
``compare`` alike (``"v_proj"`` leaves ``qkv_proj`` out, ``"up_proj"`` ``gate_up_proj``), as
SGLang's one skip rule. ``compare`` runs on every rank holding a snapshot and each drops its
own on success, but the answer is TP rank 0's, as upstream (only rank 0 answers the tokenizer
manager). The reference engine's own ranks hold a replicated trunk and its own split of
``lm_head``, so every rank's parameters are laid out on the driver from the full weights (the
``lm_head`` gathered); a trainer compares through
:func:`rollsafe.fleet.weights_check.expected_digests`, never with HF-named digests directly.

**vLLM** ``POST /weight_checker`` ``{"action": "checksum"|"reset"|"compare", "baseline"?}``:
``{"checksums": {"dp0:pp0:pcp0:tp<r>:<name>": sha256 hex}}``, ``{"status": "reset"}`` (every
parameter zeroed), ``{"match": bool, "mismatches": [sorted keys]}``; errors are vLLM's
``{"error": {"message", "type", "param", "code"}}`` with 400. The checksums are what vLLM 0.32
reports (:func:`vllm_checker_answer`): vLLM's parameter names (fused ``qkv_proj`` and
``gate_up_proj``), one TP shard per rank, and on a CPU engine the SHA-256 of empty bytes for
the linear weights, exactly as a real CPU vLLM answers; a trainer's HF digests do not compare
with them directly (:mod:`rollsafe.engine_layout`, :mod:`rollsafe.digest_check`).

Unknown body keys are what the imitated release does with them (both ignore them: SGLang's
``CheckWeightsReqInput`` parse and vLLM's named ``Body`` parameters drop them, recorded in the
contracts); values outside a field's domain are a 400 naming them.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from rollsafe.adapters.reference_engine.errors import BadRequest
from rollsafe.adapters.reference_engine.server import await_future, ctx_of, request_body
from rollsafe.checksum import overall_checksum, per_engine_checksum
from rollsafe.engine_layout import (
    EMPTY_SHA256,
    EngineLayout,
    LayoutError,
    checker_key,
    vllm_cpu_emptied,
    vllm_rank_digests,
)

__all__ = [
    "SGLANG_ACTIONS",
    "VLLM_ACTIONS",
    "routes",
    "sglang_checker_answer",
    "vllm_checker_answer",
]

SGLANG_ACTIONS = ("checksum", "snapshot", "reset_tensors", "compare")
SGLANG_SELECTORS = ("target", "draft", "all")
SGLANG_KEYS = (
    "action",
    "allow_quant_error",
    "skip_tensor_list",
    "selector",
    "rid",
    "http_worker_ipc",
)
VLLM_ACTIONS = ("checksum", "reset", "compare")
VLLM_KEYS = ("action", "baseline")


def _unknown(body: dict[str, Any], allowed: tuple[str, ...], path: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequest(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"for {path}; allowed: {sorted(allowed)}"
        )


# ---------------------------------------------------------------------------- SGLang
def _sglang_request(body: dict[str, Any]) -> tuple[str, tuple[str, ...], str]:
    _unknown(body, SGLANG_KEYS, "/weights_checker")
    action = body.get("action", "checksum")
    if not isinstance(action, str):
        raise BadRequest(f"key 'action' must be str, got {type(action).__name__}")
    if action not in SGLANG_ACTIONS:
        raise BadRequest(f"Unsupported action={action!r}; allowed: {list(SGLANG_ACTIONS)}")
    quant = body.get("allow_quant_error", False)
    if not isinstance(quant, bool):
        raise BadRequest(f"key 'allow_quant_error' must be bool, got {type(quant).__name__}")
    skip = body.get("skip_tensor_list")
    if skip is not None and not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise BadRequest("key 'skip_tensor_list' must be a list of strings or null")
    selector = body.get("selector", "all")
    if selector not in SGLANG_SELECTORS:
        raise BadRequest(f"selector={selector!r} is not one of {list(SGLANG_SELECTORS)}")
    for key in ("rid", "http_worker_ipc"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadRequest(f"key {key!r} must be str or null")
    return action, tuple(skip or ()), selector


async def weights_checker(request: web.Request) -> web.Response:
    """SGLang ``/weights_checker``: ``{"success", "message", "ranks"?, "per_engine_checksum"?}``."""
    ctx = ctx_of(request)
    engine = ctx.engine
    try:
        action, skip, selector = _sglang_request(await request_body(request))
        if selector == "draft":  # no draft runner: nothing ran, nothing to report
            return web.json_response({"success": True, "message": "Success."})
        if action == "snapshot":
            await await_future(engine.checker_snapshot())
        elif action == "reset_tensors":
            await await_future(engine.checker_reset("random", skip))
        elif action == "compare":
            await await_future(engine.checker_compare(skip))
        else:
            per_rank = await await_future(engine.checker_checksums(skip))
            return web.json_response(sglang_checker_answer(per_rank))
    except (BadRequest, LayoutError) as exc:  # upstream: any error of the check, success false
        return web.json_response({"success": False, "message": str(exc)}, status=400)
    return web.json_response({"success": True, "message": "Success."})


def sglang_checker_answer(per_rank: list[dict[str, str]]) -> dict[str, Any]:
    """SGLang 0.5.23's ``checksum`` answer for one ``{name: digest}`` per TP rank: per rank a
    ``ChecksumInfo`` (``checksums``, ``per_gpu_checksum`` = :func:`overall_checksum` of them,
    ``parallelism_info``: one entry, the target runner's), and ``per_engine_checksum``, SHA-256
    over the ranks' ``per_gpu_checksum`` in rank order."""
    world = len(per_rank)
    ranks: list[dict[str, Any]] = [
        {
            "checksums": checksums,
            "per_gpu_checksum": overall_checksum(checksums),
            "parallelism_info": [
                {
                    "role": "target",
                    "tp_rank": r,
                    "tp_size": world,
                    "dp_rank": 0,
                    "dp_size": 1,
                    "pp_rank": 0,
                    "pp_size": 1,
                    "rank": r,
                    "size": world,
                }
            ],
        }
        for r, checksums in enumerate(per_rank)
    ]
    return {
        "success": True,
        "message": "Success.",
        "ranks": ranks,
        "per_engine_checksum": per_engine_checksum(str(r["per_gpu_checksum"]) for r in ranks),
    }


# ---------------------------------------------------------------------------- vLLM
def _vllm_error(message: str, param: str | None = None, status: int = 400) -> web.Response:
    phrase = {400: "Bad Request", 500: "Internal Server Error"}.get(status, "Error")
    return web.json_response(
        {"error": {"message": message, "type": phrase, "param": param, "code": status}},
        status=status,
    )


def vllm_checker_answer(engine: Any) -> dict[str, str]:
    """Driver thread only: vLLM's ``checksums`` object for this engine's weights, as vLLM 0.32
    reports it (:mod:`rollsafe.engine_layout`): fused ``qkv_proj`` / ``gate_up_proj``, each TP
    rank's shard under ``dp0:pp0:pcp0:tp<r>:``, and on a CPU engine the empty-bytes digest for
    every linear weight (real vLLM empties them after prepacking on CPU)."""
    world = engine.ranks.world_size
    layout = EngineLayout.from_config(engine.ranks.local.model.config, tp_size=world)
    ranks = vllm_rank_digests(engine.full_named_tensors(), layout)
    on_cpu = engine.device.type == "cpu"
    return {
        checker_key(name, r): EMPTY_SHA256 if on_cpu and vllm_cpu_emptied(name) else digest
        for r, digests in enumerate(ranks)
        for name, digest in digests.items()
    }


async def weight_checker(request: web.Request) -> web.Response:
    """vLLM ``/weight_checker``: checksum | reset | compare (``baseline``)."""
    engine = ctx_of(request).engine
    try:
        body = await request_body(request)
        _unknown(body, VLLM_KEYS, "/weight_checker")
    except BadRequest as exc:
        return _vllm_error(str(exc), "body")
    action = body.get("action")
    if action is None:
        return _vllm_error("1 validation error:\n  body.action: Field required", "body.action")
    if action not in VLLM_ACTIONS:
        return _vllm_error(
            f"1 validation error:\n  body.action: Input should be "
            f"{', '.join(map(repr, VLLM_ACTIONS[:-1]))} or {VLLM_ACTIONS[-1]!r} "
            f"(got {action!r})",
            "body.action",
        )
    baseline = body.get("baseline")
    if baseline is not None and not (
        isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values())
    ):
        return _vllm_error(
            "1 validation error:\n  body.baseline: must be an object of strings", "body.baseline"
        )
    if action == "reset":
        await await_future(engine.checker_reset("zero"))
        return web.json_response({"status": "reset"})
    if action == "compare" and baseline is None:
        return _vllm_error("action='compare' requires a 'baseline' object")
    checksums = await await_future(engine.submit(lambda: vllm_checker_answer(engine)))
    if action == "checksum":
        return web.json_response({"checksums": checksums})
    assert baseline is not None
    mismatches = sorted(
        k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
    )
    return web.json_response({"match": not mismatches, "mismatches": mismatches})


def routes(dialect: str) -> list[web.RouteDef]:
    """The checker route(s) of ``dialect``."""
    if dialect == "sglang":
        return [
            web.get("/weights_checker", weights_checker),
            web.post("/weights_checker", weights_checker),
        ]
    if dialect == "vllm":
        return [web.post("/weight_checker", weight_checker)]
    raise ValueError(f"dialect must be 'sglang' or 'vllm', got {dialect!r}")
