#!/usr/bin/env bash
# `make test`'s checks, in three parts that run side by side:
#   1. the real-vLLM tests (marker real_vllm: minutes of server starts, mostly waiting on vLLM);
#   2. every other test, in two pytest-xdist workers that take whole files (--dist loadfile:
#      a module's fixtures stay in one process);
#   3. ruff, mypy and `rollsafe diagrams --check`.
# Parts 1 and 3 write to logs printed at the end; the run fails when any part fails.
# Usage: tools/run_tests.sh VENV_BIN   (ROLLSAFE_TEST_WORKERS=N sets part 2's workers, default 2)
set -uo pipefail
BIN=${1:?usage: tools/run_tests.sh VENV_BIN}
WORKERS=${ROLLSAFE_TEST_WORKERS:-2}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rollsafe-test.XXXXXX")
real_log="$tmp/real_vllm.log"
lint_log="$tmp/lint.log"
start=$SECONDS

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

stop_all() { kill -- "$real_pid" "$lint_pid" 2>/dev/null; }
trap stop_all INT TERM

failed=()
if [ "$WORKERS" -gt 1 ]; then
  dist=(-n "$WORKERS" --dist loadfile)
else
  dist=(-p no:xdist)
fi
"$BIN/python" -m pytest -q -m "not real_vllm" "${dist[@]}" --durations=30 \
  --basetemp="$tmp/pytest" || failed+=("pytest (not real_vllm)")
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

if [ "${#failed[@]}" -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
rm -rf "$tmp"
echo "all checks passed"
