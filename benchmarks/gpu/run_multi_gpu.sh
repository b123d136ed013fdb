#!/usr/bin/env bash
# Issue #6 in one device call on nvidia-h200-x2 (or -x4): install the carried wheels, keep NVLink
# multicast off, run benchmarks/gpu/multi_gpu.py under a deadline; everything lands in $OUT.
#   run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600,
#       command="bash benchmarks/gpu/run_multi_gpu.sh")
# Arguments are passed to multi_gpu.py (e.g. --phases env,targeted_recovery, or --one-gpu for
# the single-GPU rehearsal on nvidia-h200). DEADLINE (s, default 430) is when multi_gpu.py stops
# starting phases; it is killed at DEADLINE + 110 s, which with the install stays under 600 s.
set -u
OUT=${OUT:-/tmp/out}
DEADLINE=${DEADLINE:-430}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ nvidia-smi -L; nvidia-smi topo -m; } >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
python3 -c "import torch, checkpoint_engine.ps, zmq, statemachine, rollsafe, pytest; \
print('deps ok', torch.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tee "$OUT/deps.log"
timeout -k 20 $((DEADLINE + 110)) python3 benchmarks/gpu/multi_gpu.py \
  --out "$OUT/multi_gpu.json" --deadline-s "$DEADLINE" "$@" 2>&1 | tee "$OUT/multi_gpu.log" | tail -60
rc=${PIPESTATUS[0]}
# stderr tails of the engines the script started itself (phases 2-3), for a failed start
mkdir -p "$OUT/engine-logs"
for f in /tmp/rollsafe-engine-*.stderr; do
  [ -f "$f" ] || continue
  grep -v '^rollsafe-profile ' "$f" | tail -c 6000 >"$OUT/engine-logs/$(basename "$f")"
  # ROLLSAFE_ENGINE_PROFILE=1 timing lines, kept whole
  grep '^rollsafe-profile ' "$f" >"$OUT/engine-logs/$(basename "$f" .stderr).profile"
done
ls -la "$OUT" "$OUT/engine-logs"
exit "$rc"
