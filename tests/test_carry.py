"""``tools/carry.py``: a locked wheel set split into device calls, reassembled and installed.

Small wheels are built here (a module, METADATA with a requirement, RECORD); the round trip
runs as on the device: split with a budget that forces byte parts, copy every call's folder
into one staging directory, reassemble (each part and wheel checked), ``pip install --no-index
--no-deps --target`` into a temporary target, import from it in a fresh interpreter. Stripping
drops members (a folder prefix too) and their RECORD lines, and the stripped wheel installs.
The committed locks parse and name what the GPU runs need.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    name = "carry_tool"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "carry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _record(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(
    directory: Path,
    dist: str,
    version: str,
    files: dict[str, bytes],
    requires: tuple[str, ...] = (),
) -> Path:
    """A real (pip-installable) pure-Python wheel."""
    info = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    members = {
        **files,
        f"{info}/METADATA": meta.encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [_record(n, d) for n, d in members.items()] + [f"{info}/RECORD,,"]
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def lock_for(wheels: list[Path], extra: str = "") -> str:
    lines = [extra] if extra else []
    for w in wheels:
        dist, version = w.name.split("-")[:2]
        digest = hashlib.sha256(w.read_bytes()).hexdigest()
        lines.append(f"{dist}=={version} \\\n    --hash=sha256:{digest}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def wheels(tmp_path: Path) -> list[Path]:
    d = tmp_path / "wheels"
    d.mkdir()
    blob = random.Random(0).randbytes(30_000)  # incompressible: the wheel spans parts
    big = {
        "bigpkg/__init__.py": b"VALUE = 42\n",
        "bigpkg/blob.bin": blob,
        "bigpkg/extra/__init__.py": b"",
        "bigpkg/extra/huge.bin": blob[::-1],
        "bigpkg/unused.so": b"\x7fELF" + blob[:5000],
    }
    return [
        make_wheel(d, "bigpkg", "1.0", big, requires=("smallpkg>=0.5",)),
        make_wheel(d, "smallpkg", "0.5", {"smallpkg/__init__.py": b"NAME = 'small'\n"}),
    ]


def test_split_reassemble_install_round_trip(tmp_path: Path, wheels: list[Path]) -> None:
    tool = _tool()
    lock = tool.parse_lock(lock_for(wheels, "# env: FOO=1 -- a reason"))
    out = tmp_path / "carry"
    budget = 20_000  # bytes per call: the big wheel spans several calls, in byte parts
    manifest = tool.split(lock, wheels[0].parent, out, budget=budget, strip=False)
    calls = sorted(out.glob("call-*"))
    assert len(calls) == manifest["calls"] > 2
    for folder in calls:  # every call fits its budget (the manifest travels besides)
        size = sum(p.stat().st_size for p in folder.iterdir() if p.name != tool.MANIFEST)
        assert size <= budget, (folder, size)
    big = manifest["wheels"][wheels[0].name]
    assert len(big["parts"]) > 1 and sum(p["bytes"] for p in big["parts"]) == big["bytes"]
    assert manifest["env"] == {"FOO": "1"}
    text = tool.describe(manifest, out)
    assert f"{len(calls)} call(s)" in text and "tools/carry.py install" in text
    # the device: each call copies its folder into one staging directory, then installs
    staging = tmp_path / "staging"
    staging.mkdir()
    for folder in calls:
        for p in folder.iterdir():
            shutil.copy2(p, staging / p.name)
    target = tmp_path / "site"
    assert tool.install(staging, target, strict=True) == 0
    code = "import bigpkg, smallpkg; print(bigpkg.VALUE, smallpkg.NAME)"
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.split() == ["42", "small"]
    blob = (target / "bigpkg" / "extra" / "huge.bin").read_bytes()
    with zipfile.ZipFile(wheels[0]) as zf:
        assert blob == zf.read("bigpkg/extra/huge.bin")


def test_a_missing_or_corrupt_part_is_named(tmp_path: Path, wheels: list[Path]) -> None:
    tool = _tool()
    lock = tool.parse_lock(lock_for(wheels))
    out = tmp_path / "carry"
    manifest = tool.split(lock, wheels[0].parent, out, budget=20_000, strip=False)
    staging = tmp_path / "staging"
    shutil.copytree(out / "call-01", staging)  # the later calls never copied
    with pytest.raises(tool.CarryError, match=r"missing \(call 2 of"):
        tool.reassemble(staging, tmp_path / "w")
    for folder in sorted(out.glob("call-*"))[1:]:
        for p in folder.iterdir():
            shutil.copy2(p, staging / p.name)
    part = manifest["wheels"][wheels[0].name]["parts"][1]["file"]
    data = bytearray((staging / part).read_bytes())
    data[10] ^= 0xFF
    (staging / part).write_bytes(bytes(data))
    with pytest.raises(tool.CarryError, match="corrupt"):
        tool.reassemble(staging, tmp_path / "w2")


def test_strip_drops_members_and_their_record_lines(tmp_path: Path, wheels: list[Path]) -> None:
    tool = _tool()
    text = lock_for(wheels) + (
        "# strip: bigpkg bigpkg/unused.so -- not on the path\n"
        "# strip: bigpkg bigpkg/extra/ -- a folder\n"
    )
    lock = tool.parse_lock(text)
    assert [(s.dist, s.member) for s in lock.strips] == [
        ("bigpkg", "bigpkg/unused.so"),
        ("bigpkg", "bigpkg/extra/"),
    ]
    out = tmp_path / "carry"
    manifest = tool.split(lock, wheels[0].parent, out, budget=1 << 20)
    assert manifest["calls"] == 1
    slim = out / ".stripped" / wheels[0].name
    with zipfile.ZipFile(slim) as zf:
        names = zf.namelist()
        record = zf.read("bigpkg-1.0.dist-info/RECORD").decode()
    assert "bigpkg/unused.so" not in names and not any("extra/" in n for n in names)
    assert "bigpkg/blob.bin" in names and "unused.so" not in record and "extra/" not in record
    assert manifest["wheels"][wheels[0].name]["bytes"] < wheels[0].stat().st_size
    again = tool.strip_wheel(wheels[0], ["bigpkg/unused.so", "bigpkg/extra/"], tmp_path / "b")
    assert again.read_bytes() == slim.read_bytes()  # deterministic
    target = tmp_path / "site"
    assert tool.install(out / "call-01", target, strict=True) == 0
    assert (target / "bigpkg" / "blob.bin").is_file()
    assert not (target / "bigpkg" / "unused.so").exists()
    with pytest.raises(tool.CarryError, match="not in the wheel"):
        tool.strip_wheel(wheels[0], ["bigpkg/nothing.so"], tmp_path / "c")


def test_an_unmet_requirement_is_reported_and_fails_strict(
    tmp_path: Path, wheels: list[Path]
) -> None:
    tool = _tool()
    lonely = [wheels[0]]  # bigpkg needs smallpkg>=0.5, which is not carried
    out = tmp_path / "carry"
    tool.split(
        tool.parse_lock(lock_for(lonely)), wheels[0].parent, out, budget=1 << 20, strip=False
    )
    assert tool.install(out / "call-01", tmp_path / "site", strict=True) == 1
    assert tool.install(out / "call-01", tmp_path / "site2", strict=False) == 0


def test_plan_calls_fills_each_call_and_cuts_only_what_does_not_fit() -> None:
    tool = _tool()
    pieces = tool.plan_calls([("a.whl", 250), ("b.whl", 60), ("c.whl", 30)], 100)
    by_call: dict[int, int] = {}
    for p in pieces:
        by_call[p.call] = by_call.get(p.call, 0) + p.size
    assert max(by_call.values()) <= 100
    assert sum(by_call.values()) == 340 and len(by_call) == 4  # ceil(340 / 100)
    whole = [p for p in pieces if p.name == p.wheel]
    assert {p.wheel for p in whole} == {"b.whl", "c.whl"}  # small ones travel whole
    a = [p for p in pieces if p.wheel == "a.whl"]
    assert [p.offset for p in a] == [0, 100, 200] and sum(p.size for p in a) == 250
    with pytest.raises(tool.CarryError, match="no room"):
        tool.plan_calls([("a.whl", 1)], 0)


def test_lock_parsing_refuses_what_would_break_the_install() -> None:
    tool = _tool()
    good = "a==1 --hash=sha256:" + "0" * 64 + "\n"
    assert tool.parse_lock(good).pins[0].version == "1"
    with pytest.raises(tool.CarryError, match="pinned twice"):
        tool.parse_lock(good + "A==2 --hash=sha256:" + "1" * 64 + "\n")
    with pytest.raises(tool.CarryError, match="hash"):
        tool.parse_lock("a==1\n")
    with pytest.raises(tool.CarryError, match="not a pinned"):
        tool.parse_lock("a>=1 --hash=sha256:" + "0" * 64 + "\n")


@pytest.mark.parametrize(
    ("lock", "must"),
    [
        ("gpu-vllm-0.26.0.txt", {"vllm": "0.26.0", "fastapi": None, "pyzmq": None}),
        ("gpu-sglang-0.5.16.txt", {"sglang": "0.5.16", "sglang-kernel": "0.4.5"}),
    ],
)
def test_the_committed_gpu_locks(lock: str, must: dict[str, str | None]) -> None:
    """Each committed lock parses (one pin per distribution, a hash each), pins the engine and
    what it needs, carries nothing the device image has at a version it pins (torch), and its
    spec regenerates it (the header names the spec)."""
    tool = _tool()
    path = REPO / "constraints" / lock
    parsed = tool.read_lock(path)
    pins = {tool.normalize(p.name): p.version for p in parsed.pins}
    for dist, version in must.items():
        assert dist in pins, dist
        assert version is None or pins[dist] == version
    for image_dist in ("torch", "triton", "numpy", "safetensors", "torchvision"):
        assert image_dist not in pins, image_dist  # the image's (the engines pin its torch)
    assert parsed.python == "3.12"
    spec = REPO / "constraints" / "gpu" / (lock.removeprefix("gpu-").removesuffix(".txt") + ".toml")
    assert spec.is_file() and f"tools/carry.py lock constraints/gpu/{spec.name}" in path.read_text()
    json.dumps([p.__dict__ for p in parsed.pins])  # plain data
