"""Embedded reference inference engine: a small but real SGLang/vLLM-dialect HTTP server.

Run it with ``python -m rollsafe.adapters.reference_engine --model-path DIR``; once serving it
prints one line ``ROLLSAFE_READY {"url": ..., "pid": ..., "rank_pids": [...], ...}`` on stdout.
``--standby`` starts a warm standby instead: it imports everything, prints
``ROLLSAFE_STANDBY {json}`` and waits for one handoff line on stdin (see ``__main__``), or, with
``--fork-server-fd FD``, stays resident and forks engines on request (:mod:`.zygote`).
Modules: :mod:`.tiny_model` (deterministic tiny Llama checkpoints), :mod:`.model` (one rank's
shard), :mod:`.weights` (receiving side of weight updates), :mod:`.deltas` (a delta update
held across its calls, then applied), :mod:`.collective` (process groups),
:mod:`.bootstrap` (how ranks start: fork after rank 0's imports on CPU, early spawn on CUDA; the
start-up protocol), :mod:`.ranks` (multi-process ranks), :mod:`.engine` (scheduler),
:mod:`.server`, :mod:`.sglang_api`, :mod:`.vllm_api` (HTTP), :mod:`.codec` (tokenizer,
``--tokenizer-path``), :mod:`.paths` (directory checks), :mod:`.faults` (fault injection),
:mod:`.errors`. Importing this package is light: torch and transformers load only in the
submodules (``bootstrap``, ``codec``, ``paths`` and ``errors`` never import them).
"""

from __future__ import annotations

__all__: list[str] = []
