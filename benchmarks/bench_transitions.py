"""Median cost of a guarded transition per machine vs a bare python-statemachine transition.

Run: ``.venv/bin/python benchmarks/bench_transitions.py`` (or ``rollsafe bench``); writes
``benchmarks/results/transitions.json``.
"""

from rollsafe.bench.transitions import main

if __name__ == "__main__":
    raise SystemExit(main())
