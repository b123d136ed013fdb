"""Watching a fleet: what it saw over time, its Prometheus metrics, its picture, its report.

* :mod:`~rollsafe.observe.observer`: :class:`FleetObserver`, request-count samples, crash marks
  and failure episodes (onset -> detection -> active) of a running fleet;
* :mod:`~rollsafe.observe.runfile`: the recorded-run files (``timeline.jsonl``, ``fleet.json``)
  written by ``RolloutFleet.record(path)`` and ``rollsafe demo``, and their validated reading;
* :mod:`~rollsafe.observe.stream`: the run a fleet with ``FleetConfig.run_dir`` streams to disk
  as it happens (``stream.jsonl``: every transition, sync and recovery, whole however long the
  run), and its reading back for ``rollsafe verify --trace``;
* :mod:`~rollsafe.observe.metrics`: :class:`FleetMetrics`, Prometheus metrics (the optional
  ``[metrics]`` extra, prometheus-client), names in ``docs/metrics.md``;
* :mod:`~rollsafe.observe.timeline_svg`: the self-contained SVG picture of a recorded run;
* :mod:`~rollsafe.observe.report`: ``rollsafe report PATH`` (summary, recovery breakdown,
  invariant checks, the picture).

Importing this package imports none of them (prometheus-client stays optional).
"""
