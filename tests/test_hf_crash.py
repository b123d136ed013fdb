"""A writer killed with SIGKILL mid-export leaves nothing under a final name; the previous ready
export stays intact and verifiable; the next exporter (or the next export) removes the debris."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from hf_support import hidden_entries, small_tensors

from rollsafe.hf import HFExporter, verify_hf_dir

# Exports version 2 (4 shards); after the first shard is durable it says so and hangs, so the
# parent can kill it mid-write at a known point.
CHILD = textwrap.dedent(
    """
    import sys, time, torch
    import rollsafe.hf.exporter as E

    original = E.write_shard
    written = []

    def write_shard(*args, **kwargs):
        size = original(*args, **kwargs)
        written.append(size)
        if len(written) == 1:
            print("SHARD_WRITTEN", flush=True)
            time.sleep(120)
        return size

    E.write_shard = write_shard
    exporter = E.HFExporter(sys.argv[1], shard_size_bytes=1 << 20)
    tensors = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(4)}
    exporter.start(tensors, 2).wait()
    print("UNEXPECTED_DONE", flush=True)
    """
)


def _run_child_and_kill(root: Path) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "SHARD_WRITTEN", (line, proc.stderr.read() if proc.stderr else "")
        temps = [p for p in root.iterdir() if p.name.startswith(f".hf-v2.tmp-{proc.pid}-")]
        assert len(temps) == 1 and any(temps[0].glob("model-*.safetensors"))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


def test_sigkill_mid_write_leaves_previous_export_intact(tmp_path: Path) -> None:
    previous = HFExporter(tmp_path).start(small_tensors(), 1).wait(30)

    dead_pid = _run_child_and_kill(tmp_path)

    assert not (tmp_path / "hf-v2").exists()  # nothing under the final name
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["hf-v1"]
    assert len(hidden_entries(tmp_path)) == 1  # the killed writer's temp dir is still there
    verified = verify_hf_dir(previous, expected_keys=small_tensors())
    assert verified.checksums_verified and verified.version == 1

    # A new exporter on the same root removes the stale temp dir ...
    HFExporter(tmp_path)
    assert hidden_entries(tmp_path) == []

    # ... and so does the next export of a running exporter (and it can export version 2).
    exporter = HFExporter(tmp_path)
    (tmp_path / f".hf-v2.tmp-{dead_pid}-0badf00d").mkdir()
    (tmp_path / f".hf-v2.tmp-{dead_pid}-0badf00d" / "model-00001-of-00004.safetensors").touch()
    live = tmp_path / f".hf-v8.tmp-{os.getpid()}-cafe0001"  # this process: not stale
    live.mkdir()
    path = exporter.start({"w": torch.ones(4)}, 2).wait(30)
    assert hidden_entries(tmp_path) == [live.name]
    assert verify_hf_dir(path, expected_keys=["w"]).version == 2
