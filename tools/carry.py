#!/usr/bin/env python3
"""Carry a locked wheel set to the device machine in calls that each fit, and install it there.

The device machine (benchmarks/gpu/README.md, "Carrying an engine") reaches no registry, keeps
``/tmp`` only while warm (30 s after a call) and takes at most 64 MiB of working tree per call
(the repository's own files included). This tool owns the whole path of a wheel set across that:

``lock SPEC``
    Resolve a spec (``constraints/gpu/*.toml``: the top-level requirements with why each is
    needed, what the device image already provides, what is left out and why, members stripped
    from a wheel and why, the environment the server needs) with pip's resolver as of a date
    (``--uploaded-prior-to``, so the set is what a fresh install saw at the engine's release),
    drop what the image provides, and write the lock: ``name==version --hash=sha256:...`` lines
    with the spec's reasons as comments (``constraints/gpu-*.txt``).
``download LOCK --dest DIR``
    ``pip download --no-deps --only-binary=:all: --python-version ...`` of every pinned wheel,
    each checked against its hash (a cached file with the right hash is reused).
``split LOCK --wheels DIR --out DIR``
    Strip the lock's ``# strip:`` members from their wheels (RECORD rewritten), then pack the
    wheels into call folders (``call-01/``, ...) that each fit one call: the per-call budget is
    64 MiB less the repository's size (tracked plus untracked-not-ignored files, measured) less
    a margin; a wheel larger than the space left is cut into byte parts. Every folder holds a
    ``carry-manifest.json`` (each wheel's sha256, its parts and theirs). Prints the tree and the
    command of each consecutive call.
``install --parts DIR --target DIR``
    On the device: reassemble the wheels from their parts (every part and every wheel checked
    against the manifest), ``pip install --no-index --no-deps --target``, then check each
    installed wheel's requirements against what the interpreter now sees (reported, exit 1 when
    one is unmet with ``--strict``).

Nothing here needs the network except ``lock`` and ``download``; ``split`` and ``install`` are
pure file work (``tests/test_carry.py`` runs the round trip on CPU with small wheels).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
#: what one device call may carry in all (tracked + untracked files + carried paths)
CALL_LIMIT = 64 * MIB
#: left free in every call besides the repository (files added between split and run)
DEFAULT_MARGIN = 2 * MIB
MANIFEST = "carry-manifest.json"
DEFAULT_PLATFORMS = (
    "manylinux_2_39_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)

__all__ = [
    "Lock",
    "Pin",
    "Strip",
    "install",
    "main",
    "parse_lock",
    "plan_calls",
    "reassemble",
    "repo_bytes",
    "strip_wheel",
]


class CarryError(RuntimeError):
    """A lock, a wheel or a part is not what it should be (the message names it)."""


def log(msg: str) -> None:
    print(f"[carry] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ----------------------------------------------------------------------------------- the lock


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str


@dataclass(frozen=True)
class Strip:
    """A member left out of a wheel (``dist`` is the distribution name)."""

    dist: str
    member: str
    reason: str


@dataclass
class Lock:
    """A parsed lock file: pins, strips, the device environment, the download tags."""

    pins: list[Pin] = field(default_factory=list)
    strips: list[Strip] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str = "3.12"
    platforms: tuple[str, ...] = DEFAULT_PLATFORMS

    def pin(self, dist: str) -> Pin:
        for p in self.pins:
            if normalize(p.name) == normalize(dist):
                return p
        raise CarryError(f"no pin for {dist!r} in the lock")


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def parse_lock(text: str) -> Lock:
    """Read a lock: ``name==version --hash=sha256:HEX`` (continuation lines allowed), and the
    directives ``# strip: DIST MEMBER -- reason``, ``# env: KEY=VALUE -- reason``,
    ``# python: 3.12``, ``# platforms: tag tag ...``."""
    lock = Lock()
    joined = re.sub(r"\\\n\s*", " ", text)
    for raw in joined.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            body = line[1:].strip()
            key, _, rest = body.partition(":")
            value, _, reason = rest.partition(" -- ")
            if key == "strip":
                dist, _, member = value.strip().partition(" ")
                if not member:
                    raise CarryError(f"strip directive without a member: {line!r}")
                lock.strips.append(Strip(dist, member.strip(), reason.strip()))
            elif key == "env":
                k, _, v = value.strip().partition("=")
                lock.env[k] = v
            elif key == "python":
                lock.python = value.strip()
            elif key == "platforms":
                lock.platforms = tuple(value.split())
            continue
        m = _PIN.match(line)
        if m is None:
            raise CarryError(f"not a pinned requirement: {line!r}")
        hashes = _HASH.findall(line)
        if len(hashes) != 1:
            raise CarryError(f"{m.group(1)}: exactly one --hash=sha256 expected, got {hashes}")
        lock.pins.append(Pin(m.group(1), m.group(2), hashes[0]))
    names = [normalize(p.name) for p in lock.pins]
    if len(set(names)) != len(names):
        raise CarryError("a distribution is pinned twice: two versions stop the whole install")
    return lock


def read_lock(path: Path) -> Lock:
    return parse_lock(path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------ lock


def _spec(path: Path) -> dict[str, Any]:
    import tomllib

    with path.open("rb") as f:
        return tomllib.load(f)


def resolve(
    spec: dict[str, Any],
    python: str,
    platforms: Sequence[str],
    requirements: Sequence[str] | None = None,
    *,
    no_deps: bool = False,
) -> list[dict[str, Any]]:
    """pip's resolution of ``requirements`` (default: the spec's ``requirement`` entries) as
    its ``--report`` ``install`` entries; ``no_deps``: each requirement alone."""
    reqs = (
        list(requirements)
        if requirements is not None
        else [r["requirement"] for r in spec["requirement"]]
    )
    if not reqs:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--target",
            str(Path(tmp) / "t"),
        ]
        for tag in [*platforms, "any"]:
            cmd += ["--platform", tag]
        if spec.get("uploaded_prior_to") and not no_deps:
            cmd += ["--uploaded-prior-to", str(spec["uploaded_prior_to"])]
        if no_deps:
            cmd.append("--no-deps")
        cmd += reqs
        log("resolving" + (" (no deps)" if no_deps else "") + ": " + " ".join(reqs))
        subprocess.run(cmd, check=True)
        return list(json.loads(report.read_text())["install"])


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def write_lock(spec_path: Path, out: Path) -> Lock:
    """Resolve ``spec_path`` and write the lock to ``out`` (see the module docstring)."""
    spec = _spec(spec_path)
    python = str(spec.get("python", "3.12"))
    platforms = tuple(spec.get("platforms", DEFAULT_PLATFORMS))
    provided = {normalize(n) for n in spec.get("image_provides", [])}
    excluded = {normalize(e["dist"]): e["reason"] for e in spec.get("exclude", [])}
    installs = resolve(spec, python, platforms)
    # pinned by hand, without their dependencies (those pull torch & co., which the image has):
    # what they need is listed in the spec too, and checked on the device by `install`
    pinned = spec.get("pinned", [])
    by_hand = resolve(spec, python, platforms, [r["requirement"] for r in pinned], no_deps=True)
    from packaging.requirements import Requirement as _Req

    pinned_why = {normalize(_Req(r["requirement"]).name): r["reason"] for r in pinned}
    clash = {normalize(i["metadata"]["name"]) for i in installs} & set(pinned_why)
    if clash:
        raise CarryError(f"pinned by hand and resolved too: {sorted(clash)}")
    installs = installs + by_hand
    lines = [f"# {line}" if line else "#" for line in spec["header"].strip().splitlines()]
    lines += [
        "#",
        f"# Generated by `python tools/carry.py lock {_rel(spec_path)}` (pip's",
        f"# resolver as of {spec.get('uploaded_prior_to', 'now')}); download, split and install:",
        "# benchmarks/gpu/README.md, 'Carrying an engine'.",
        f"# python: {python}",
        f"# platforms: {' '.join(platforms)}",
    ]
    for key, item in sorted(spec.get("env", {}).items()):
        lines.append(f"# env: {key}={item['value']} -- {item['reason']}")
    for s in spec.get("strip", []):
        lines.append(f"# strip: {s['dist']} {s['member']} -- {s['reason']}")
    lines.append("#")
    lines.append("# Left out (the evidence: tools/wheel_imports.py on the serve path):")
    for dist, reason in sorted(excluded.items()):
        lines.append(f"#   {dist}: {reason}")
    lines.append("# Provided by the device image (not carried): " + ", ".join(sorted(provided)))
    lines.append("")
    from packaging.requirements import Requirement

    why = {normalize(Requirement(r["requirement"]).name): r["reason"] for r in spec["requirement"]}
    why.update(pinned_why)
    pins: list[Pin] = []
    for item in sorted(installs, key=lambda i: normalize(i["metadata"]["name"])):
        meta = item["metadata"]
        name = normalize(meta["name"])
        if name in provided or name in excluded:
            continue
        info = item["download_info"]
        digest = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if not digest:
            raise CarryError(f"{name}: the resolver reported no sha256 (re-run with a cache)")
        reason = why.get(name) or "needed by " + ", ".join(
            sorted(
                normalize(i["metadata"]["name"])
                for i in installs
                if any(
                    normalize(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0]) == name
                    for r in i["metadata"].get("requires_dist", []) or []
                    if "extra ==" not in r
                )
            )
        )
        lines.append(f"# {reason}")
        lines.append(f"{meta['name']}=={meta['version']} \\")
        lines.append(f"    --hash=sha256:{digest}")
        pins.append(Pin(meta["name"], meta["version"], digest))
    for extra in spec.get("add", []):  # pinned by hand (not from the resolver)
        lines.append(f"# {extra['reason']}")
        lines.append(f"{extra['name']}=={extra['version']} \\")
        lines.append(f"    --hash=sha256:{extra['sha256']}")
        pins.append(Pin(extra["name"], extra["version"], extra["sha256"]))
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log(f"wrote {out} ({len(pins)} wheels)")
    return parse_lock(out.read_text(encoding="utf-8"))


# -------------------------------------------------------------------------------- download


def wheel_for(pin: Pin, directory: Path) -> Path | None:
    """The wheel of ``pin`` in ``directory`` with the pinned hash, if there is one."""
    stem = normalize(pin.name).replace("-", "_")
    for path in sorted(directory.glob("*.whl")):
        base = normalize(path.name.split("-")[0]).replace("-", "_")
        if base == stem and f"-{pin.version}-" in path.name and sha256_file(path) == pin.sha256:
            return path
    return None


def download(lock: Lock, dest: Path, cache: Iterable[Path] = ()) -> list[Path]:
    """Every wheel of ``lock`` in ``dest`` (copied from ``cache`` when there, else pip
    download), each checked against its hash."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for pin in lock.pins:
        found = wheel_for(pin, dest)
        for directory in cache:
            if found is None and directory.is_dir():
                cached = wheel_for(pin, directory)
                if cached is not None:
                    found = Path(shutil.copy2(cached, dest / cached.name))
        if found is None:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                lock.python,
                "--implementation",
                "cp",
                "-d",
                str(dest),
            ]
            for tag in [*lock.platforms, "any"]:
                cmd += ["--platform", tag]
            cmd.append(f"{pin.name}=={pin.version}")
            subprocess.run(cmd, check=True)
            found = wheel_for(pin, dest)
        if found is None:
            raise CarryError(
                f"{pin.name}=={pin.version}: no wheel with sha256 {pin.sha256} in {dest}"
            )
        out.append(found)
    return out


# ----------------------------------------------------------------------------------- strip


def _record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def strip_wheel(wheel: Path, members: Sequence[str], out_dir: Path) -> Path:
    """A copy of ``wheel`` in ``out_dir`` (same file name) without ``members`` (a member ending
    in ``/`` drops every file under that folder); its RECORD loses their lines. Deterministic:
    the same input gives the same bytes. A member that matches nothing in the wheel is a
    :class:`CarryError` (the lock is stale)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        drop: set[str] = set()
        missing = []
        for member in members:
            hit = (
                {n for n in names if n.startswith(member)}
                if member.endswith("/")
                else ({member} & set(names))
            )
            if not hit:
                missing.append(member)
            drop |= hit
        if missing:
            raise CarryError(f"{wheel.name}: strip members not in the wheel: {missing}")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        with zipfile.ZipFile(target, "w") as dst:
            for info in src.infolist():
                if info.filename in drop:
                    continue
                data = src.read(info.filename)
                if info.filename == record:
                    rows = [
                        r
                        for r in csv.reader(io.StringIO(data.decode("utf-8")))
                        if r and r[0] not in drop
                    ]
                    buf = io.StringIO()
                    csv.writer(buf, lineterminator="\n").writerows(rows)
                    data = buf.getvalue().encode("utf-8")
                dst.writestr(info, data, compress_type=info.compress_type)
    return target


# ----------------------------------------------------------------------------------- split


def repo_bytes(root: Path = REPO) -> int:
    """Bytes of what travels with every device call besides the carry: tracked files and
    untracked files git does not ignore (and ``shared/`` when the checkout has one)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout
    total = 0
    for rel in out.decode().split("\0"):
        if rel:
            path = root / rel
            if path.is_file():
                total += path.stat().st_size
    shared = root / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file())
    return total


@dataclass
class Piece:
    """A whole wheel or one byte range of it, placed in one call."""

    wheel: str
    name: str  # file name in the call folder
    offset: int
    size: int
    call: int


def plan_calls(sizes: Sequence[tuple[str, int]], budget: int) -> list[Piece]:
    """Place wheels (``(file name, bytes)``, largest first is best) into calls of ``budget``
    bytes each, in as few calls as the total allows: a wheel goes whole into the first call
    with room for it, or whole into a new call while that stays within the fewest calls
    possible; otherwise it is cut into byte parts that fill the last call and the next ones."""
    if budget <= 0:
        raise CarryError(f"no room left in a call: budget {budget} bytes")
    fewest = max(1, -(-sum(size for _, size in sizes) // budget))
    pieces: list[Piece] = []
    free: list[int] = [budget]  # room left in each call so far
    for wheel, size in sizes:
        home = next((i for i, room in enumerate(free) if size <= room), None)
        if home is None and size <= budget and len(free) < fewest:
            free.append(budget)
            home = len(free) - 1
        if home is not None:
            pieces.append(Piece(wheel, wheel, 0, size, home + 1))
            free[home] -= size
            continue
        offset, part = 0, 0
        while offset < size:
            if free[-1] == 0:
                free.append(budget)
            n = min(free[-1], size - offset)
            pieces.append(Piece(wheel, f"{wheel}.part-{part:03d}", offset, n, len(free)))
            offset, part = offset + n, part + 1
            free[-1] -= n
    return pieces


def split(
    lock: Lock,
    wheels: Path,
    out: Path,
    *,
    budget: int | None = None,
    margin: int = DEFAULT_MARGIN,
    strip: bool = True,
) -> dict[str, Any]:
    """Strip, then pack the lock's wheels from ``wheels`` into ``out/call-NN/`` folders; returns
    the manifest (also written into every folder)."""
    if budget is None:
        budget = CALL_LIMIT - repo_bytes() - margin
    files = [download_check(lock, pin, wheels) for pin in lock.pins]
    if strip and lock.strips:
        slim = out / ".stripped"
        by_dist: dict[str, list[str]] = {}
        for s in lock.strips:
            by_dist.setdefault(normalize(s.dist), []).append(s.member)
        files = [
            strip_wheel(f, by_dist[normalize(p.name)], slim) if normalize(p.name) in by_dist else f
            for f, p in zip(files, lock.pins, strict=True)
        ]
    order = sorted(files, key=lambda f: f.stat().st_size, reverse=True)
    pieces = plan_calls([(f.name, f.stat().st_size) for f in order], budget)
    for old in out.glob("call-*"):
        shutil.rmtree(old)
    by_name = {f.name: f for f in files}
    manifest: dict[str, Any] = {
        "budget_bytes": budget,
        "calls": max((p.call for p in pieces), default=0),
        "env": lock.env,
        "python": lock.python,
        "platforms": list(lock.platforms),
        "wheels": {},
    }
    for f in order:
        manifest["wheels"][f.name] = {
            "sha256": sha256_file(f),
            "bytes": f.stat().st_size,
            "parts": [],
        }
    for piece in pieces:
        folder = out / f"call-{piece.call:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        with by_name[piece.wheel].open("rb") as src, (folder / piece.name).open("wb") as dst:
            src.seek(piece.offset)
            data = src.read(piece.size)
            dst.write(data)
        manifest["wheels"][piece.wheel]["parts"].append(
            {
                "call": piece.call,
                "file": piece.name,
                "offset": piece.offset,
                "bytes": piece.size,
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    for folder in sorted(out.glob("call-*")):
        (folder / MANIFEST).write_text(text)
    return manifest


def download_check(lock: Lock, pin: Pin, wheels: Path) -> Path:
    found = wheel_for(pin, wheels)
    if found is None:
        raise CarryError(
            f"{pin.name}=={pin.version} with the pinned hash is not in {wheels}: "
            "run `tools/carry.py download` first"
        )
    return found


def describe(manifest: dict[str, Any], out: Path, staging: str = "/tmp/carry") -> str:
    """The tree of the call folders and the command of each consecutive call."""
    lines = []
    calls = int(manifest["calls"])
    total = sum(int(w["bytes"]) for w in manifest["wheels"].values())
    lines.append(
        f"{len(manifest['wheels'])} wheels, {total / MIB:.1f} MiB, {calls} call(s) of at most "
        f"{manifest['budget_bytes'] / MIB:.1f} MiB (64 MiB less the repository and a margin)"
    )
    rel = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    for k in range(1, calls + 1):
        folder = out / f"call-{k:02d}"
        files = sorted(p for p in folder.iterdir() if p.name != MANIFEST)
        size = sum(p.stat().st_size for p in files)
        lines.append(f"{rel}/call-{k:02d}/  ({size / MIB:.1f} MiB)")
        for p in files:
            lines.append(f"    {p.name}  {p.stat().st_size / MIB:.2f} MiB")
    lines.append("")
    if not rel.is_absolute():
        lines.append(f"once, in the checkout's root: echo /{rel.parts[0]}/ >> .git/info/exclude")
    else:
        lines.append("move the call folders under the checkout (a folder .git/info/exclude names)")
    lines.append("then, one call after the other (each within 30 s of the last, while warm):")
    env = " ".join(f"{k}={v}" for k, v in sorted(manifest.get("env", {}).items()))
    for k in range(1, calls + 1):
        folder = f"{rel}/call-{k:02d}"
        cmd = f"mkdir -p {staging} && cp {folder}/* {staging}/"
        if k == calls:
            cmd += (
                f" && python3 tools/carry.py install --parts {staging} --target /tmp/site"
                f" && export PYTHONPATH=/tmp/site:$PWD {env}".rstrip()
                + " && <the run>"
            )
        lines.append(f'  run(carry=["{folder}"], command="{cmd}")')
    return "\n".join(lines)


# --------------------------------------------------------------------------------- install


def reassemble(parts: Path, dest: Path) -> list[Path]:
    """The wheels of ``parts/carry-manifest.json``, rebuilt in ``dest`` from their parts (every
    part and every wheel checked against the manifest; a missing part names its call)."""
    manifest = json.loads((parts / MANIFEST).read_text())
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for wheel, info in sorted(manifest["wheels"].items()):
        target = dest / wheel
        with target.open("wb") as dst:
            for part in sorted(info["parts"], key=lambda p: p["offset"]):
                path = parts / part["file"]
                if not path.is_file():
                    raise CarryError(
                        f"{wheel}: part {part['file']} missing (call {part['call']} of "
                        f"{manifest['calls']} not copied into {parts}?)"
                    )
                data = path.read_bytes()
                if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
                    raise CarryError(f"{wheel}: part {part['file']} is corrupt")
                dst.write(data)
        if sha256_file(target) != info["sha256"]:
            raise CarryError(f"{wheel}: reassembled wheel does not match its sha256")
        out.append(target)
    return out


def unmet_requirements(target: Path, wheels: Sequence[Path]) -> list[str]:
    """Each installed wheel's unconditional requirements (markers evaluated here) that the
    interpreter, with ``target`` first on its path, does not satisfy."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - the image and rollsafe's venv have packaging
        return ["(packaging is not importable: requirements not checked)"]
    sys.path.insert(0, str(target))
    try:
        problems = []
        for wheel in wheels:
            dist_name = wheel.name.split("-")[0]
            try:
                requires = metadata.requires(dist_name) or []
            except metadata.PackageNotFoundError:
                problems.append(f"{dist_name}: not installed")
                continue
            for text in requires:
                req = Requirement(text)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                try:
                    have = metadata.version(req.name)
                except metadata.PackageNotFoundError:
                    problems.append(f"{dist_name}: needs {req} (absent)")
                    continue
                if req.specifier and not req.specifier.contains(have, prereleases=True):
                    problems.append(f"{dist_name}: needs {req} (found {have})")
        return problems
    finally:
        sys.path.remove(str(target))


def install(parts: Path, target: Path, *, strict: bool = False, rehearse: bool = False) -> int:
    """Reassemble and ``pip install --no-index --no-deps --target``; report unmet requirements
    (exit 1 on any with ``strict``). ``rehearse``: install as for the lock's Python and
    platforms (``--python-version``, ``--platform``), so a host with another interpreter can
    check the round trip (nothing is imported from the target then)."""
    manifest = json.loads((parts / MANIFEST).read_text())
    with tempfile.TemporaryDirectory(dir=parts) as tmp:
        wheels = reassemble(parts, Path(tmp))
        tags: list[str] = []
        if rehearse:
            tags = ["--only-binary=:all:", "--python-version", str(manifest.get("python", "3.12"))]
            tags += ["--implementation", "cp"]
            for tag in [*manifest.get("platforms", DEFAULT_PLATFORMS), "any"]:
                tags += ["--platform", tag]
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(target),
            *tags,
            *map(str, wheels),
        ]
        subprocess.run(cmd, check=True)
        log(f"installed {len(wheels)} wheels into {target}")
        problems = [] if rehearse else unmet_requirements(target, wheels)
    for p in problems:
        log(f"unmet: {p}")
    if rehearse:
        log("a rehearsal: requirements are checked on the device, not here")
    elif not problems:
        log("every requirement of the installed wheels is met")
    return 1 if problems and strict else 0


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("lock", help="resolve a spec into a lock")
    p.add_argument("spec", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("download", help="fetch the lock's wheels (hash-checked)")
    p.add_argument("lock", type=Path)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--cache", type=Path, action="append", default=[])
    p = sub.add_parser("split", help="strip and pack the wheels into call folders")
    p.add_argument("lock", type=Path)
    p.add_argument("--wheels", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-mib", type=float, help="bytes per call (default: 64 MiB - repo)")
    p.add_argument("--margin-mib", type=float, default=DEFAULT_MARGIN / MIB)
    p.add_argument("--no-strip", action="store_true", help="carry the wheels as released")
    p = sub.add_parser("install", help="on the device: reassemble and install")
    p.add_argument("--parts", type=Path, required=True)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--strict", action="store_true", help="exit 1 on an unmet requirement")
    p.add_argument(
        "--rehearse", action="store_true", help="install for the lock's Python/platforms (host)"
    )
    args = ap.parse_args(argv)
    try:
        if args.cmd == "lock":
            write_lock(args.spec, args.out)
        elif args.cmd == "download":
            files = download(read_lock(args.lock), args.dest, args.cache)
            total = sum(f.stat().st_size for f in files)
            log(f"{len(files)} wheels, {total / MIB:.1f} MiB in {args.dest}")
        elif args.cmd == "split":
            budget = int(args.budget_mib * MIB) if args.budget_mib else None
            manifest = split(
                read_lock(args.lock),
                args.wheels,
                args.out,
                budget=budget,
                margin=int(args.margin_mib * MIB),
                strip=not args.no_strip,
            )
            print(describe(manifest, args.out.resolve()))
        elif args.cmd == "install":
            return install(args.parts, args.target, strict=args.strict, rehearse=args.rehearse)
    except CarryError as exc:
        log(f"FAILED: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
