"""Run by the real vLLM's interpreter (not a test module): vLLM's own weight digests of a model
with its linear weights kept, printed as one JSON line ``DIGESTS [{key: sha256}, ...]``.

On CPU vLLM empties every linear weight after prepacking (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)`` in ``vllm/model_executor/layers/utils.py``), so its ``/weight_checker``
has no data for them. Here the engine is built in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with that one call made with ``remove_weight=False``
(the weight still gets prepacked; only the emptying is skipped), and vLLM's own
``compute_weight_checksums`` (the worker method behind ``/weight_checker``) hashes the fused
parameters as vLLM loaded them: what a GPU vLLM, which keeps its weights, would report.

``python vllm_digest_dump.py MODEL_DIR [TP]``: with TP > 1 the workers are processes of their
own, so the same patch must run in each of them: put a ``sitecustomize.py`` that calls
:func:`keep_linear_weights` on their ``PYTHONPATH`` (the test does), and give each worker a
core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
"""

from __future__ import annotations

import json
import os
import sys


def keep_linear_weights() -> None:
    """Make vLLM's CPU GEMM dispatch keep the linear weights it would empty."""
    import vllm.model_executor.layers.utils as layer_utils

    empty_after_packing = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(empty_after_packing, "_keeps_weights", False):
        return

    def keep_weight(layer: object, remove_weight: bool) -> object:
        return empty_after_packing(layer, remove_weight=False)

    keep_weight._keeps_weights = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = keep_weight


def main() -> None:
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    keep_linear_weights()
    from vllm import LLM

    llm = LLM(
        model=sys.argv[1],
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        tensor_parallel_size=tp,
    )
    digests = llm.collective_rpc("compute_weight_checksums")
    print("DIGESTS " + json.dumps(digests), flush=True)


if __name__ == "__main__":
    main()
