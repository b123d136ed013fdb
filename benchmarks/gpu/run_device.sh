#!/usr/bin/env bash
# One device call on a lent H200: install the carried wheels, then run one phase, time-boxed.
#   phase "tests": every @pytest.mark.gpu test, then the checkpoint-engine benchmark
#   phase "bench": the ipc / nccl transport benchmark (8 GB Qwen3-4B shapes)
#   phase "ce_p2p" / "ce_p2p_smoke": ce_p2p_recovery.py (issue #13: a checkpoint-engine fleet
#     re-syncs a SIGKILLed group by P2P over Mooncake's TCP transport; smoke: a tiny model).
#     Needs ".mc" carried too (a Mooncake TCP build, see benchmarks/gpu/README.md); exits with its status.
# Outputs land in $OUT (logs and JSON). Usage: bash benchmarks/gpu/run_device.sh tests|bench|ce_p2p|ce_p2p_smoke
set -u
phase=${1:-tests}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# SGLang's own decoder files for tests/test_sglang_wire.py (carry ".sgsrc": the two upstream files
# tests/sglang_decoder.py reads, copied from the pinned wheel; never committed)
if [ -d .sgsrc/sglang ]; then export ROLLSAFE_SGLANG_SRC=$PWD/.sgsrc; fi
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch, checkpoint_engine.ps, zmq, statemachine, rollsafe; print('deps ok', torch.__version__)" \
  2>&1 | tee "$OUT/deps.log"
if [ "$phase" = tests ]; then
  files=$(grep -l 'mark.gpu' tests/test_*.py)
  echo "gpu test files: $files"
  timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 200 $files 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -40
  timeout 280 python3 benchmarks/gpu/bench_checkpoint_engine_gpu.py \
    --out "$OUT/checkpoint_engine_gpu.json" --deadline-s 240 2>&1 | tee "$OUT/ce_bench.log" | tail -30
elif [ "$phase" = ce_p2p ] || [ "$phase" = ce_p2p_smoke ]; then
  # shellcheck disable=SC1091
  source .mc/env.sh || { echo "no .mc/env.sh: carry .mc (see benchmarks/gpu/README.md)"; exit 1; }
  python3 -c "import mooncake.engine, checkpoint_engine.ps; print('mooncake ok')" 2>&1 \
    | tee -a "$OUT/deps.log"
  name=ce_p2p; extra=()
  if [ "$phase" = ce_p2p_smoke ]; then name=ce_p2p_smoke; extra=(--smoke --deadline-s 200); fi
  timeout 570 python3 benchmarks/gpu/ce_p2p_recovery.py --out "$OUT/$name.json" "${extra[@]}" \
    > "$OUT/$name.log" 2>&1
  rc=$?
  tail -60 "$OUT/$name.log"
  ls -la "$OUT"
  exit $rc
else
  timeout 540 python3 benchmarks/gpu/bench_transports_gpu.py --out "$OUT/transports_gpu.json" \
    2>&1 | tee "$OUT/transports_bench.log" | tail -40
fi
ls -la "$OUT"
