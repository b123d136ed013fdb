#!/usr/bin/env bash
# One device call on a lent H200: install the carried wheels, then run one phase, time-boxed.
#   phase "tests": every @pytest.mark.gpu test, then the checkpoint-engine benchmark
#   phase "bench": the ipc / nccl transport benchmark (8 GB Qwen3-4B shapes)
# Outputs land in $OUT (logs and JSON). Usage: bash benchmarks/gpu/run_device.sh tests|bench
set -u
phase=${1:-tests}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch, checkpoint_engine.ps, zmq, statemachine, rollsafe; print('deps ok', torch.__version__)" \
  2>&1 | tee "$OUT/deps.log"
if [ "$phase" = tests ]; then
  files=$(grep -l 'mark.gpu' tests/test_*.py)
  echo "gpu test files: $files"
  timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu -x --timeout 200 $files 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -40
  timeout 280 python3 benchmarks/gpu/bench_checkpoint_engine_gpu.py \
    --out "$OUT/checkpoint_engine_gpu.json" --deadline-s 240 2>&1 | tee "$OUT/ce_bench.log" | tail -30
else
  timeout 540 python3 benchmarks/gpu/bench_transports_gpu.py --out "$OUT/transports_gpu.json" \
    2>&1 | tee "$OUT/transports_bench.log" | tail -40
fi
ls -la "$OUT"
