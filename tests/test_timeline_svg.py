"""The timeline picture: self-contained SVG, one lane per group with the timeline's state spans,
markers for the crash, the detection, syncs, export-ready times and the recovery span, and the
served-requests rate per group; redrawn from a ``timeline.jsonl`` read back from disk."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from observe_helpers import run_rows, write_run_dir

from rollsafe.observe.runfile import load_run
from rollsafe.observe.timeline_svg import (
    STATE_COLORS,
    TITLE_CHAR_W,
    group_spans,
    render_svg,
    write_svg,
)

NS = "{http://www.w3.org/2000/svg}"


def _f(el: ET.Element, name: str) -> float:
    return float(el.get(name, "nan"))


def _tree(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def _lanes(root: ET.Element) -> dict[str, list[tuple[str, float, float]]]:
    out: dict[str, list[tuple[str, float, float]]] = {}
    for g in root.iter(f"{NS}g"):
        if g.get("class") != "lane":
            continue
        out[g.get("data-group", "")] = [
            (r.get("data-state", ""), _f(r, "data-t0"), _f(r, "data-t1"))
            for r in g.iter(f"{NS}rect")
            if r.get("class") == "span"
        ]
    return out


def test_one_lane_per_group_with_the_timelines_state_spans(tmp_path: Path) -> None:
    run = load_run(write_run_dir(tmp_path / "run"))
    root = _tree(render_svg(run.rows))
    lanes = _lanes(root)
    assert list(lanes) == ["g0", "g1"]
    assert lanes["g0"] == [("launching", 0.0, 1.0), ("active", 1.0, 5.0)]
    assert lanes["g1"] == [
        ("launching", 0.0, 1.1),
        ("active", 1.1, 3.0),
        ("inactive", 3.0, 3.05),
        ("recovering", 3.05, 3.6),
        ("active", 3.6, 5.0),
    ]
    # the same spans as the timeline's group transitions say, colour by state
    assert group_spans(run.rows, run.duration)["g1"] == lanes["g1"]
    spans = [r for r in root.iter(f"{NS}rect") if r.get("class") == "span"]
    fills = {r.get("data-state"): r.get("fill") for r in spans}
    assert all(fills[s] == STATE_COLORS[s] for s in fills)


def test_markers_recovery_span_and_request_rate(tmp_path: Path) -> None:
    root = _tree(render_svg(run_rows()))
    by_class: dict[str, list[ET.Element]] = {}
    for el in root.iter():
        cls = el.get("class")
        if cls:
            by_class.setdefault(cls, []).append(el)
    assert [float(e.get("data-t", "nan")) for e in by_class["crash"]] == [2.8]
    assert [float(e.get("data-t", "nan")) for e in by_class["detection"]] == [3.0]
    assert [e.get("data-label") for e in by_class["sync"]] == ["v1"]
    ready = [(e.get("data-subject"), _f(e, "data-t")) for e in by_class["export-ready"]]
    assert ready == [("v1", 2.5)]
    (rec,) = by_class["recovery"]
    assert float(rec.get("data-t0", "nan")) == 2.8 and float(rec.get("data-t1", "nan")) == 3.6
    assert abs(float(rec.get("data-latency", "nan")) - 0.8) < 1e-9
    texts = " ".join(t.text or "" for t in root.iter(f"{NS}text"))
    assert "recovered in 0.80 s (immediate)" in texts
    rates = {e.get("data-group"): e for e in by_class["rate"]}
    assert set(rates) == {"g0", "g1"}
    assert all(len((e.get("points") or "").split()) >= 4 for e in rates.values())


def test_self_contained_no_scripts_fonts_or_external_refs(tmp_path: Path) -> None:
    svg = render_svg(run_rows())
    root = _tree(svg)
    tags = {el.tag.removeprefix(NS) for el in root.iter()}
    assert not tags & {"script", "foreignObject", "image", "use", "a", "style", "link"}
    for el in root.iter():
        for name, value in el.attrib.items():
            assert not name.startswith("on"), name
            assert "href" not in name, name
            assert "url(" not in value and "http" not in value, (name, value)
    families = set(re.findall(r'font-family="([^"]*)"', svg))
    assert families <= {"sans-serif", "monospace"}
    assert "@import" not in svg and "@font-face" not in svg


def test_old_timelines_without_run_rows_still_draw(tmp_path: Path) -> None:
    rows = [r for r in run_rows() if r["kind"] in ("group", "export", "registration", "mark")]
    out = write_run_dir(tmp_path / "old", rows)
    run = load_run(out)
    path = write_svg(tmp_path / "old.svg", run.rows)
    root = _tree(path.read_text())
    assert list(_lanes(root)) == ["g0", "g1"]
    (rec,) = [e for e in root.iter() if e.get("class") == "recovery"]
    assert float(rec.get("data-t0", "nan")) == 2.8  # the crash mark before the fail
    assert [e.get("data-label") for e in root.iter() if e.get("class") == "sync"] == ["sync"]


def test_a_long_title_wraps_inside_the_picture(tmp_path: Path) -> None:
    """The demo's node-loss title ran off the right edge: it wraps at words now, every line
    within the picture, and the lanes move down to make room."""
    run = load_run(write_run_dir(tmp_path / "run"))
    title = "rollsafe demo --nodes 3: worker2 removed at step 2 (groups on it: g1)"
    root = _tree(render_svg(run.rows, title=title))
    lines = [t for t in root.iter(f"{NS}text") if t.get("class") == "title"]
    assert len(lines) == 2
    text = " ".join(t.text or "" for t in lines)
    assert text.startswith(f"{title}: 2 group(s), ")  # the whole title, in order
    width = float(root.get("width", "0"))
    for line in lines:
        assert _f(line, "x") + len(line.text or "") * TITLE_CHAR_W <= width
    assert _f(lines[1], "y") > _f(lines[0], "y")
    short = [t for t in _tree(render_svg(run.rows)).iter(f"{NS}text") if t.get("class") == "title"]
    assert len(short) == 1
    lane_top = min(_f(g, "y") for g in root.iter(f"{NS}rect") if g.get("class") == "span")
    short_top = min(
        _f(g, "y")
        for g in _tree(render_svg(run.rows)).iter(f"{NS}rect")
        if g.get("class") == "span"
    )
    assert lane_top > short_top  # the second title line pushed the lanes down
