#!/usr/bin/env bash
# `make test`'s checks. The real-vLLM tests (marker real_vllm: minutes of server starts, mostly
# waiting on vLLM) run in a second pytest beside everything else, their output in a log printed
# at the end; the run fails when any part fails. Usage: tools/run_tests.sh VENV_BIN
set -uo pipefail
BIN=${1:?usage: tools/run_tests.sh VENV_BIN}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rollsafe-test.XXXXXX")
real_log="$tmp/real_vllm.log"

"$BIN/python" -m pytest -q -p no:cacheprovider -m real_vllm --durations=15 \
  --basetemp="$tmp/pytest" >"$real_log" 2>&1 &
real_pid=$!
echo "real-vLLM tests started beside the others (pid $real_pid, log $real_log)"
stop_real() { kill -- "$real_pid" 2>/dev/null; }
trap stop_real INT TERM

failed=()
"$BIN/ruff" check rollsafe tests benchmarks examples || failed+=("ruff check")
"$BIN/ruff" format --check rollsafe tests benchmarks examples || failed+=("ruff format")
"$BIN/mypy" || failed+=("mypy")
"$BIN/python" -m pytest -q -m "not real_vllm" --durations=30 || failed+=("pytest (not real_vllm)")
"$BIN/rollsafe" diagrams --check || failed+=("diagrams --check")

echo "waiting for the real-vLLM tests ..."
wait "$real_pid"
real_rc=$?
echo "================ real-vLLM tests (ran beside the others) ================"
cat "$real_log"
[ "$real_rc" -eq 0 ] || failed+=("pytest (real_vllm, exit $real_rc)")

if [ "${#failed[@]}" -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
rm -rf "$tmp"
echo "all checks passed"
