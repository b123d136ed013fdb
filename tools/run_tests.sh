#!/usr/bin/env bash
# `make test`'s checks, in three parts that run side by side:
#   1. the real-vLLM tests (marker real_vllm: minutes of server starts, mostly waiting on vLLM);
#   2. every other test, in two pytest-xdist workers that take whole files (--dist loadfile:
#      a module's fixtures stay in one process);
#   3. ruff, mypy and `rollsafe diagrams --check`.
# Parts 1 and 3 write to logs printed at the end; the run fails when any part fails.
# Usage: tools/run_tests.sh [--stress] VENV_BIN   (ROLLSAFE_TEST_WORKERS=N sets part 2's workers,
# default 2). --stress: the same three parts with two busy loops (`while True: pass`, one core
# each) running beside them for the whole run, so a test that passes only on an idle machine
# fails here; the loops are killed when the run ends, fails or is interrupted (Ctrl-C, SIGTERM).
set -uo pipefail
STRESS=0
if [ "${1:-}" = "--stress" ]; then
  STRESS=1
  shift
fi
BIN=${1:?usage: tools/run_tests.sh [--stress] VENV_BIN}
WORKERS=${ROLLSAFE_TEST_WORKERS:-2}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rollsafe-test.XXXXXX")
real_log="$tmp/real_vllm.log"
lint_log="$tmp/lint.log"
start=$SECONDS

busy_pids=()
stop_busy() {
  [ "${#busy_pids[@]}" -gt 0 ] || return 0
  kill "${busy_pids[@]}" 2>/dev/null
  wait "${busy_pids[@]}" 2>/dev/null
  busy_pids=()
}
trap stop_busy EXIT
# a busy loop that also ends by itself once this script is gone (even SIGKILLed)
BUSY='import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(10**6):
        pass'
if [ "$STRESS" -eq 1 ]; then
  for _ in 1 2; do
    "$BIN/python" -c "$BUSY" &
    busy_pids+=($!)
  done
  echo "--stress: two busy loops beside the tests (pids ${busy_pids[*]}), killed at the end"
  # what the machine was doing, every 10 s (a failure under load names a time: this says
  # whether CPU, memory or swap was short then): time, 1-min load, runnable processes,
  # MemAvailable and swap used (MiB)
  machine_log="$tmp/machine.log"
  (
    while kill -0 $$ 2>/dev/null; do
      read -r l1 _ _ runq _ </proc/loadavg
      awk -v t="$(date +%T)" -v l="$l1" -v r="$runq" \
        '/^MemAvailable:/ {a=$2} /^SwapTotal:/ {st=$2} /^SwapFree:/ {sf=$2}
         END {printf "%s load %s run %s avail_mib %d swap_used_mib %d\n", t, l, r, a/1024, (st-sf)/1024}' \
        /proc/meminfo
      sleep 10
    done
  ) >"$machine_log" 2>&1 &
  busy_pids+=($!)
  echo "--stress: the machine's load and memory every 10 s in $machine_log"
fi

"$BIN/python" -m pytest -q -p no:cacheprovider -m real_vllm --durations=15 \
  --basetemp="$tmp/pytest-real" >"$real_log" 2>&1 &
real_pid=$!
echo "real-vLLM tests started beside the others (pid $real_pid, log $real_log)"

lint() {
  local bad=0
  "$BIN/ruff" check rollsafe tests benchmarks examples || { echo "FAILED: ruff check"; bad=1; }
  "$BIN/ruff" format --check rollsafe tests benchmarks examples || { echo "FAILED: ruff format"; bad=1; }
  "$BIN/mypy" || { echo "FAILED: mypy"; bad=1; }
  "$BIN/rollsafe" diagrams --check || { echo "FAILED: diagrams --check"; bad=1; }
  return "$bad"
}
lint >"$lint_log" 2>&1 &
lint_pid=$!
echo "ruff, mypy and diagrams --check started beside the tests (pid $lint_pid, log $lint_log)"

main_pid=
stop_all() {
  kill -- "$real_pid" "$lint_pid" ${main_pid:+"$main_pid"} 2>/dev/null
  stop_busy
}
# an interrupted run stops every part (and the busy loops) at once and fails
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM

failed=()
if [ "$WORKERS" -gt 1 ]; then
  dist=(-n "$WORKERS" --dist loadfile)
else
  dist=(-p no:xdist)
fi
# in the background, so a signal to this script is handled at once (bash defers its traps while
# a foreground command runs)
"$BIN/python" -m pytest -q -m "not real_vllm" "${dist[@]}" --durations=30 \
  --basetemp="$tmp/pytest" &
main_pid=$!
wait "$main_pid" || failed+=("pytest (not real_vllm)")
main_pid=
echo "the other tests ended after $((SECONDS - start)) s"

wait "$lint_pid"
lint_rc=$?
echo "================ ruff, mypy, diagrams --check (ran beside the tests) ================"
cat "$lint_log"
[ "$lint_rc" -eq 0 ] || failed+=("lint (see the FAILED lines above)")

echo "waiting for the real-vLLM tests ..."
wait "$real_pid"
real_rc=$?
echo "================ real-vLLM tests (ran beside the others) ================"
cat "$real_log"
[ "$real_rc" -eq 0 ] || failed+=("pytest (real_vllm, exit $real_rc)")
echo "all parts ended after $((SECONDS - start)) s"
stop_busy

if [ "${#failed[@]}" -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
rm -rf "$tmp"
echo "all checks passed"
