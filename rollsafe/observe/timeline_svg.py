"""The picture of a recorded run: a self-contained SVG drawn from ``timeline.jsonl`` rows.

Owns the drawing only (rows in, SVG text out), so any recorded run can be redrawn:
``rollsafe report PATH`` does it, ``rollsafe demo`` and :meth:`RolloutFleet.record` write it.

Top to bottom: a row of weight syncs (each a band as long as the sync, labelled with its
version), a row of recovery exports (a diamond at each export's ``ready`` time), one swim lane
per group coloured by its lifecycle state over time, with markers for a crash (a cross), the
detection (a triangle at the ``fail`` transition) and the recovery span under the lane (onset to
``active``, labelled with its latency and strategy); then the time axis, the served-requests
rate of every group, and the legend. Every element carries a ``<title>`` tooltip and ``data-*``
attributes (``data-group``, ``data-state``, ``data-t0``, ``data-t1``...) so the picture can be
checked by a program.

Self-contained on purpose: no scripts, no external references, no embedded or named fonts (only
the generic families ``sans-serif`` and ``monospace``), so it renders the same in a browser, on
GitHub and in an offline viewer.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

__all__ = ["STATE_COLORS", "group_spans", "recovery_spans", "render_svg", "write_svg"]

#: Lifecycle state -> fill colour of its span in a lane.
STATE_COLORS = {
    "launching": "#9ecae1",
    "active": "#2ca25f",
    "standby": "#a1d99b",
    "pending_weights": "#fdae6b",
    "inactive": "#de2d26",
    "recovering": "#8c6bb1",
    "unplaced": "#a50f15",
    "draining": "#bdbdbd",
    "retired": "#636363",
}
_GROUP_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#6a3d9a",
    "#17becf",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
)
_FONT = "sans-serif"

W = 1000
LEFT = 120
RIGHT = 24
LANE_H = 40
BAR_H = 20


def _num(v: Any) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)


def _attrs(**kw: Any) -> str:
    out = []
    for k, v in kw.items():
        if v is None:
            continue
        name = k.rstrip("_").replace("_", "-")
        out.append(f"{name}={quoteattr(_num(v) if isinstance(v, (int, float)) else str(v))}")
    return " ".join(out)


def _el(tag: str, title: str | None = None, text: str | None = None, **kw: Any) -> str:
    inner = (f"<title>{escape(title)}</title>" if title else "") + (escape(text) if text else "")
    if inner:
        return f"<{tag} {_attrs(**kw)}>{inner}</{tag}>"
    return f"<{tag} {_attrs(**kw)}/>"


# ---------------------------------------------------------------------------- what to draw
def _t(row: Mapping[str, Any]) -> float:
    return float(row["t"])


def group_spans(
    rows: Sequence[Mapping[str, Any]], end: float
) -> dict[str, list[tuple[str, float, float]]]:
    """Per group: ``(state, t_start, t_end)`` spans from its transitions (first state from 0)."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    for r in rows:
        if r["kind"] != "group":
            continue
        spans = out.setdefault(str(r["subject"]), [])
        t = max(0.0, _t(r))
        if not spans:
            spans.append((str(r["source"]), min(0.0, t), t))
        else:
            state, t0, _ = spans[-1]
            spans[-1] = (state, t0, t)
        spans.append((str(r["target"]), t, max(t, end)))
    return out


def recovery_spans(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Recovery spans (group, onset t, active t, latency s, strategy, status, onset source).

    From the ``recovery`` rows (onset = the failure episode's onset when recorded, else the
    detection); for files without them, from each group's ``fail`` to its next ``active``
    (onset = a crash mark of the group in between, if any).
    """
    t0 = _t0(rows)
    spans: list[dict[str, Any]] = []
    recs = [r for r in rows if r["kind"] == "recovery"]
    for r in recs:
        onset = float(r["onset"] if r.get("onset") is not None else r["failed_at"])
        active = r.get("active_at")
        spans.append(
            {
                "group": r.get("group_id"),
                "onset": float(onset) - t0,
                "active": None if active is None else float(active) - t0,
                "detected": float(r.get("detected_at") or r["failed_at"]) - t0,
                "latency_s": None if active is None else float(active) - float(onset),
                "strategy": r.get("strategy"),
                "status": r.get("status"),
                "onset_source": r.get("onset_source") or "detection",
            }
        )
    if recs:
        return spans
    crashes = [r for r in rows if r["kind"] == "mark" and r.get("event") == "crash"]
    open_: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["kind"] != "group":
            continue
        gid = str(r["subject"])
        if r["target"] == "inactive" and gid not in open_:
            before = [_t(c) for c in crashes if c.get("subject") == gid and _t(c) <= _t(r)]
            onset = max(before) if before and _t(r) - max(before) < 30 else _t(r)
            open_[gid] = {
                "group": gid,
                "onset": onset,
                "detected": _t(r),
                "active": None,
                "latency_s": None,
                "strategy": None,
                "status": None,
                "onset_source": "crash_mark" if onset != _t(r) else "detection",
            }
        elif r["target"] in ("active", "retired") and gid in open_:
            span = open_.pop(gid)
            if r["target"] == "active":
                span.update(active=_t(r), latency_s=_t(r) - span["onset"], status="active")
            else:
                span["status"] = "retired"
            spans.append(span)
    spans.extend(open_.values())
    return spans


def _t0(rows: Sequence[Mapping[str, Any]]) -> float:
    for r in rows:
        return float(r["timestamp"]) - float(r["t"])
    return 0.0


def _syncs(rows: Sequence[Mapping[str, Any]]) -> list[tuple[float, float, str, bool]]:
    """(t start, t end, label, ok) of every weight sync."""
    out = []
    for r in rows:
        if r["kind"] == "sync":
            secs = float(r.get("seconds") or 0.0)
            label = f"v{r.get('version')}"
            delta = r.get("delta")
            if isinstance(delta, Mapping) and delta.get("delta_targets"):
                # a delta sync: the label says so, with its bytes and fallbacks
                label += (
                    f" \u0394 ({delta.get('bytes_delta', 0)} B delta, "
                    f"{delta.get('bytes_full', 0)} B full, {delta.get('fallbacks', 0)} fallback(s))"
                )
            out.append((_t(r), _t(r) + secs, label, bool(r.get("ok"))))
    if out:
        return out
    start: dict[str, float] = {}  # files without sync rows: the registration's own transitions
    for r in rows:
        if r["kind"] != "registration":
            continue
        if r["event"] == "begin_register":
            start[str(r["subject"])] = _t(r)
        elif r["event"] == "update_done" and str(r["subject"]) in start:
            version = (r.get("inputs") or {}).get("version")
            label = f"v{version}" if version is not None else "sync"
            out.append((start.pop(str(r["subject"])), _t(r), label, True))
    return out


def _rates(
    rows: Sequence[Mapping[str, Any]], groups: Sequence[str], end: float, start: float = 0.0
) -> tuple[float, dict[str, list[tuple[float, float]]]]:
    """(bin width s, per group [(bin start t, served/s)]) from the ``requests`` rows."""
    samples = [r for r in rows if r["kind"] == "requests"]
    if len(samples) < 2 or end <= start:
        return 0.0, {}
    width = max(0.5, _nice((end - start) / 90.0))
    times = [_t(s) for s in samples]
    out: dict[str, list[tuple[float, float]]] = {}
    for gid in groups:
        counts = [int((s.get("served") or {}).get(gid, 0)) for s in samples]

        def at(t: float, counts: list[int] = counts) -> int:
            i = bisect.bisect_right(times, t) - 1
            return counts[i] if i >= 0 else 0

        series = []
        b = start
        while b < end:
            e = min(end, b + width)
            series.append((b, (at(e) - at(b)) / max(e - b, 1e-9)))
            b = e
        out[gid] = series
    return width, out


def _nice(x: float) -> float:
    if x <= 0:
        return 1.0
    exp = math.floor(math.log10(x))
    for m in (1, 2, 2.5, 5, 10):
        if m * 10**exp >= x:
            return float(m * 10**exp)
    return float(10 ** (exp + 1))


# ---------------------------------------------------------------------------- drawing
#: the title's font size, and the width of one of its characters at most (bold sans serif)
TITLE_FONT = 15
TITLE_CHAR_W = 0.62 * TITLE_FONT


def title_lines(text: str, width: float) -> list[str]:
    """``text`` wrapped at spaces into lines of at most ``width`` pixels of title font (a
    word longer than a line stays whole on its own line)."""
    per_line = max(8, int(width // TITLE_CHAR_W))
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= per_line:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def render_svg(rows: Sequence[Mapping[str, Any]], *, title: str | None = None) -> str:
    """The SVG text of a recorded run's rows (as :func:`~rollsafe.observe.runfile.load_run`
    or :func:`~rollsafe.observe.runfile.build_rows` give them)."""
    rows = [r for r in rows if "t" in r and "kind" in r]
    header = next((r for r in rows if r["kind"] == "run"), None)
    end_t = max((_t(r) for r in rows), default=1.0)
    end_t = max(end_t, 1e-3)
    if header is not None and isinstance(header.get("groups"), list):
        groups = [str(g) for g in header["groups"]]
    else:
        groups = []
    spans = group_spans(rows, end_t)
    for gid in spans:
        if gid not in groups:
            groups.append(gid)
    plot_w = W - LEFT - RIGHT

    # the picture starts when the fleet started (a demo's setup before it is left out)
    t_min = 0.0
    if header is not None and isinstance(header.get("started_at"), (int, float)):
        t_min = max(0.0, float(header["started_at"]) - float(header["timestamp"]))
        if t_min >= end_t:
            t_min = 0.0
    span_t = end_t - t_min

    def x(t: float) -> float:
        return round(LEFT + (max(t_min, min(t, end_t)) - t_min) / span_t * plot_w, 2)

    parts: list[str] = []
    y = 10
    heading = title or "rollsafe run"
    info = [f"{len(groups)} group(s)", f"{end_t:.1f} s"]
    if header is not None and header.get("transport"):
        info.append(f"transport {header['transport']}")
    # the title never runs off the picture: wrapped at words to the width it has
    for line in title_lines(f"{heading}: {', '.join(info)}", W - LEFT - 10):
        parts.append(
            _el(
                "text",
                text=line,
                x=LEFT,
                y=y + 14,
                font_size=TITLE_FONT,
                font_weight="bold",
                class_="title",
            )
        )
        y += 18
    y += 12

    # -- syncs row
    parts.append(_el("text", text="syncs", x=LEFT - 8, y=y + 14, text_anchor="end", font_size=11))
    for t0, t1, label, ok in _syncs(rows):
        w = max(2.0, x(t1) - x(t0))
        parts.append(
            _el(
                "rect",
                title=f"sync {label}: {t0:.2f}-{t1:.2f} s ({t1 - t0:.3f} s)"
                + ("" if ok else " FAILED"),
                x=x(t0),
                y=y + 2,
                width=round(w, 2),
                height=16,
                fill="#3182bd" if ok else "#de2d26",
                opacity=0.85,
                class_="sync",
                data_t0=round(t0, 4),
                data_t1=round(t1, 4),
                data_label=label,
            )
        )
        parts.append(
            _el(
                "line",
                x1=x(t0),
                y1=y + 18,
                x2=x(t0),
                y2=y + 52 + LANE_H * len(groups),
                stroke="#3182bd",
                stroke_width=0.6,
                stroke_dasharray="3,3",
                opacity=0.6,
            )
        )
        parts.append(
            _el(
                "text",
                text=label.split(" (")[0],  # "v3" or "v3 \u0394"; the details are in the title
                x=round(x(t0) + w + 2, 2),
                y=y + 14,
                font_size=10,
                fill="#08519c",
            )
        )
    y += 22

    # -- exports row
    parts.append(_el("text", text="exports", x=LEFT - 8, y=y + 14, text_anchor="end", font_size=11))
    for r in rows:
        if r["kind"] == "export" and r["target"] == "ready":
            cx, cy = x(_t(r)), y + 10
            parts.append(
                _el(
                    "path",
                    title=f"export {r['subject']} ready at {_t(r):.2f} s",
                    d=f"M{cx} {cy - 6} L{cx + 6} {cy} L{cx} {cy + 6} L{cx - 6} {cy} Z",
                    fill="#756bb1",
                    class_="export-ready",
                    data_t=round(_t(r), 4),
                    data_subject=r["subject"],
                )
            )
            parts.append(
                _el(
                    "text",
                    text=str(r["subject"]),
                    x=round(cx + 8, 2),
                    y=cy + 4,
                    font_size=10,
                    fill="#54278f",
                )
            )
    y += 30

    # -- lanes
    recs = recovery_spans(rows)
    crashes = [r for r in rows if r["kind"] == "mark" and r.get("event") == "crash"]
    for gid in groups:
        lane: list[str] = []
        lane.append(
            _el(
                "text",
                text=gid,
                x=LEFT - 8,
                y=y + BAR_H - 5,
                text_anchor="end",
                font_size=13,
                font_weight="bold",
            )
        )
        for state, t0, t1 in spans.get(gid, []):
            lane.append(
                _el(
                    "rect",
                    title=f"{gid} {state}: {t0:.3f}-{t1:.3f} s ({t1 - t0:.3f} s)",
                    x=x(t0),
                    y=y,
                    width=round(max(0.0, x(t1) - x(t0)), 2),
                    height=BAR_H,
                    fill=STATE_COLORS.get(state, "#bdbdbd"),
                    class_="span",
                    data_state=state,
                    data_t0=round(t0, 4),
                    data_t1=round(t1, 4),
                )
            )
        for r in rows:
            if r["kind"] == "group" and r["subject"] == gid and r["event"] == "fail":
                cx = x(_t(r))
                why = (r.get("inputs") or {}).get("reason")
                lane.append(
                    _el(
                        "path",
                        title=f"{gid} detected failed (out of routing) at {_t(r):.3f} s"
                        + (f": {why}" if why else ""),
                        d=f"M{cx - 5} {y - 7} L{cx + 5} {y - 7} L{cx} {y} Z",
                        fill="#000000",
                        class_="detection",
                        data_t=round(_t(r), 4),
                    )
                )
        for c in crashes:
            if c.get("subject") != gid:
                continue
            cx, cy = x(_t(c)), y + BAR_H // 2
            lane.append(
                _el(
                    "path",
                    title=f"{gid} crashed at {_t(c):.3f} s"
                    + (f" (rank {c['rank']})" if c.get("rank") is not None else ""),
                    d=f"M{cx - 6} {cy - 6} L{cx + 6} {cy + 6} "
                    f"M{cx - 6} {cy + 6} L{cx + 6} {cy - 6}",
                    stroke="#000000",
                    stroke_width=2.5,
                    class_="crash",
                    data_t=round(_t(c), 4),
                )
            )
        for s in recs:
            if s["group"] != gid:
                continue
            t1 = s["active"] if s["active"] is not None else end_t
            by = y + BAR_H + 6
            lat = s["latency_s"]
            label = f"recovered in {lat:.2f} s" if lat is not None else f"not back ({s['status']})"
            if s.get("strategy"):
                label += f" ({s['strategy']})"
            lane.append(
                _el(
                    "path",
                    title=f"{gid} recovery: onset {s['onset']:.3f} s ({s['onset_source']}),"
                    f" detected {s['detected']:.3f} s, active "
                    + (f"{s['active']:.3f} s" if s["active"] is not None else "never"),
                    d=f"M{x(s['onset'])} {by - 4} L{x(s['onset'])} {by} "
                    f"L{x(t1)} {by} L{x(t1)} {by - 4}",
                    fill="none",
                    stroke="#000000",
                    stroke_width=1.2,
                    class_="recovery",
                    data_t0=round(s["onset"], 4),
                    data_t1=round(t1, 4),
                    data_latency=None if lat is None else round(lat, 4),
                )
            )
            if x(t1) + 6 * len(label) < W - RIGHT:
                lane.append(_el("text", text=label, x=round(x(t1) + 4, 2), y=by + 4, font_size=10))
            else:  # no room right of the span: right-align it under the bracket
                lane.append(
                    _el("text", text=label, x=x(t1), y=by + 12, font_size=10, text_anchor="end")
                )
        parts.append(f'<g class="lane" data-group={quoteattr(gid)}>' + "".join(lane) + "</g>")
        y += LANE_H

    # -- time axis
    parts.append(
        _el("line", x1=LEFT, y1=y, x2=LEFT + plot_w, y2=y, stroke="#000000", stroke_width=0.8)
    )
    step = _nice(span_t / 10)
    tick = math.ceil(t_min / step - 1e-9) * step
    while tick <= end_t + 1e-9:
        parts.append(_el("line", x1=x(tick), y1=y, x2=x(tick), y2=y + 4, stroke="#000000"))
        parts.append(
            _el(
                "text",
                text=_num(round(tick, 3)),
                x=x(tick),
                y=y + 15,
                text_anchor="middle",
                font_size=10,
            )
        )
        tick += step
    parts.append(
        _el(
            "text",
            text="seconds since the run started",
            x=LEFT + plot_w,
            y=y + 28,
            text_anchor="end",
            font_size=10,
            fill="#555555",
        )
    )
    y += 40

    # -- served-requests rate
    width, rates = _rates(rows, groups, end_t, t_min)
    chart_h = 110
    parts.append(
        _el("text", text="served requests per second, per group", x=LEFT, y=y + 10, font_size=11)
    )
    y += 16
    if rates:
        top = max((v for series in rates.values() for _, v in series), default=0.0)
        top = _nice(top) if top > 0 else 1.0

        def ry(v: float) -> float:
            return round(y + chart_h - v / top * chart_h, 2)

        parts.append(
            _el(
                "rect",
                x=LEFT,
                y=y,
                width=plot_w,
                height=chart_h,
                fill="#fafafa",
                stroke="#cccccc",
                stroke_width=0.6,
            )
        )
        for frac in (0.0, 0.5, 1.0):
            parts.append(
                _el(
                    "text",
                    text=_num(round(top * frac, 2)),
                    x=LEFT - 8,
                    y=ry(top * frac) + 4,
                    text_anchor="end",
                    font_size=9,
                    fill="#555555",
                )
            )
        for i, gid in enumerate(groups):
            series = rates.get(gid, [])
            pts: list[str] = []
            for b, v in series:
                pts.append(f"{x(b)},{ry(v)}")
                pts.append(f"{x(min(end_t, b + width))},{ry(v)}")
            color = _GROUP_COLORS[i % len(_GROUP_COLORS)]
            parts.append(
                _el(
                    "polyline",
                    title=f"{gid}: served requests per second ({width:g} s bins)",
                    points=" ".join(pts),
                    fill="none",
                    stroke=color,
                    stroke_width=1.6,
                    class_="rate",
                    data_group=gid,
                    data_bin_s=width,
                )
            )
        lx = LEFT
        for i, gid in enumerate(groups):
            color = _GROUP_COLORS[i % len(_GROUP_COLORS)]
            parts.append(
                _el(
                    "line",
                    x1=lx,
                    y1=y + chart_h + 14,
                    x2=lx + 18,
                    y2=y + chart_h + 14,
                    stroke=color,
                    stroke_width=2,
                )
            )
            parts.append(_el("text", text=gid, x=lx + 22, y=y + chart_h + 18, font_size=10))
            lx += 70
        y += chart_h + 28
    else:
        parts.append(
            _el(
                "text",
                text="(no request samples recorded)",
                x=LEFT,
                y=y + 12,
                font_size=10,
                fill="#777777",
            )
        )
        y += 24

    # -- legend
    lx = LEFT
    for state, color in STATE_COLORS.items():
        parts.append(_el("rect", x=lx, y=y, width=12, height=12, fill=color))
        parts.append(_el("text", text=state, x=lx + 16, y=y + 10, font_size=10))
        lx += 30 + 7 * len(state)
    y += 20
    legend = (
        "x crash (mark)   \u25bc detected (out of routing)   \u25c6 export ready   "
        "\u25ac sync   \u2514\u2518 recovery: onset to active"
    )
    parts.append(_el("text", text=legend, x=LEFT, y=y + 10, font_size=10, fill="#333333"))
    height = y + 24
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'viewBox="0 0 {W} {height}" font-family="{_FONT}" role="img">'
        f"<title>{escape(heading)}</title>"
        f'<rect x="0" y="0" width="{W}" height="{height}" fill="#ffffff"/>'
        + "".join(parts)
        + "</svg>\n"
    )


def write_svg(
    path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]], *, title: str | None = None
) -> Path:
    """Render ``rows`` and write the SVG to ``path`` (atomically); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render_svg(list(rows), title=title), encoding="utf-8")
    os.replace(tmp, out)
    return out
