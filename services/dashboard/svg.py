"""The dashboard's charts, drawn as inline SVG on the server: no script, no asset fetched at run
time (clusters are often offline), and a page's size bounded by the points per curve
(services/dashboard/data.py downsamples)."""

from __future__ import annotations

import html
import math

W, H = 560, 220
L, R, T, B = 52, 12, 14, 30
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    if abs(v) >= 1e4 or (v and abs(v) < 1e-3):
        return f"{v:.1e}"
    return f"{v:.4g}"


class Frame:
    """Axes mapping data to pixels."""

    def __init__(self, x0: float, x1: float, y0: float, y1: float, w: int = W, h: int = H):
        if x1 <= x0:
            x1 = x0 + 1
        if y1 <= y0:
            y0, y1 = y0 - 0.5, y1 + 0.5
        self.x0, self.x1, self.y0, self.y1, self.w, self.h = x0, x1, y0, y1, w, h

    def x(self, v: float) -> float:
        return L + (v - self.x0) / (self.x1 - self.x0) * (self.w - L - R)

    def y(self, v: float) -> float:
        return self.h - B - (v - self.y0) / (self.y1 - self.y0) * (self.h - T - B)

    def axes(self, x_label: str, y_label: str = "", x_time: bool = False) -> list[str]:
        out = [f'<rect x="{L}" y="{T}" width="{self.w - L - R}" height="{self.h - T - B}" fill="#fff" stroke="#ccc"/>']
        for v in _ticks(self.y0, self.y1):
            y = self.y(v)
            out.append(f'<line x1="{L}" x2="{self.w - R}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                       f'<text x="{L - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')  # fmt: skip
        ticks = [self.x0 + t for t in _ticks(0.0, self.x1 - self.x0)] if x_time else _ticks(self.x0, self.x1)
        for v in ticks:
            x = self.x(v)
            label = f"{v - self.x0:.3g}s" if x_time else _fmt(v)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{self.h - B}" y2="{self.h - B + 4}" stroke="#888"/>'
                       f'<text x="{x:.1f}" y="{self.h - B + 16}" text-anchor="middle">{label}</text>')  # fmt: skip
        out.append(f'<text x="{(L + self.w - R) / 2:.0f}" y="{self.h - 2}" text-anchor="middle">'
                   f"{html.escape(x_label)}</text>")  # fmt: skip
        if y_label:
            out.append(f'<text x="12" y="{T + (self.h - T - B) / 2:.0f}" text-anchor="middle" '
                       f'transform="rotate(-90 12 {T + (self.h - T - B) / 2:.0f})">{html.escape(y_label)}</text>')  # fmt: skip
        return out


def _svg(parts: list[str], title: str, w: int = W, h: int = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
            f'role="img" aria-label="{html.escape(title)}" font-size="11" font-family="sans-serif">'
            f"<title>{html.escape(title)}</title>{''.join(parts)}</svg>")  # fmt: skip


def empty(title: str, why: str) -> str:
    return _svg([f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" fill="#888" class="empty">'
                 f"{html.escape(why)}</text>"], title)  # fmt: skip


def lines(title: str, curves: list[tuple[str, list[float], list[float]]], x_label: str, y_label: str = "",
          x_time: bool = False, markers: bool = False) -> str:  # fmt: skip
    """One line per (name, xs, ys); a legend in the top left."""
    curves = [c for c in curves if c[1]]
    if not curves:
        return empty(title, "no data yet")
    xs = [x for _, cx, _ in curves for x in cx]
    ys = [y for _, _, cy in curves for y in cy]
    f = Frame(min(xs), max(xs), min(ys), max(ys))
    parts = f.axes(x_label, y_label, x_time)
    for k, (name, cx, cy) in enumerate(curves):
        color = COLORS[k % len(COLORS)]
        pts = " ".join(f"{f.x(x):.1f},{f.y(y):.1f}" for x, y in zip(cx, cy, strict=True))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
        if markers or len(cx) == 1:
            parts += [f'<circle cx="{f.x(x):.1f}" cy="{f.y(y):.1f}" r="2.5" fill="{color}"/>'
                      for x, y in zip(cx, cy, strict=True)]  # fmt: skip
        parts.append(f'<text x="{L + 6}" y="{T + 12 + 13 * k}" fill="{color}">{html.escape(name)}</text>')
    return _svg(parts, title)


def heatmap(title: str, columns: list[tuple[float, dict[int, int]]], x_label: str, y_label: str) -> str:
    """Per x (a step, or a bin of steps), counts per integer y (staleness): darker is more."""
    columns = [(x, c) for x, c in columns if c]
    if not columns:
        return empty(title, "no trained groups yet")
    ys = [y for _, c in columns for y in c]
    f = Frame(columns[0][0], columns[-1][0] + 1, min(ys), max(ys) + 1)
    parts = f.axes(x_label, y_label)
    width = max(1.0, (W - L - R) / max(1, len(columns)))
    top = max(n for _, c in columns for n in c.values())
    for x, counts in columns:
        for y, n in counts.items():
            alpha = 0.15 + 0.85 * n / top
            parts.append(f'<rect x="{f.x(x):.1f}" y="{f.y(y + 1):.1f}" width="{width:.1f}" '
                         f'height="{f.y(y) - f.y(y + 1):.1f}" fill="#d62728" fill-opacity="{alpha:.2f}"/>')  # fmt: skip
    return _svg(parts, title)


def timeline(title: str, engines: dict[str, list[tuple[float, int]]], pauses: dict[str, list[tuple[float, float]]],
             trainer: list[tuple[float, int]]) -> str:  # fmt: skip
    """Weight version over wall-clock time: the trainer's (dashed) and each engine's (steps), each
    engine's update pauses drawn as bands."""
    points = [p for v in engines.values() for p in v] + trainer
    if not points:
        return empty(title, "no weight update yet")
    t0 = min(t for t, _ in points)
    t1 = max(t for t, _ in points)
    f = Frame(t0, t1, min(v for _, v in points), max(v for _, v in points))
    parts = f.axes("wall-clock (s from the first update)", "weight version", x_time=True)
    for k, (_, bands) in enumerate(sorted(pauses.items())):
        color = COLORS[(k + 1) % len(COLORS)]
        parts += [f'<rect x="{f.x(a):.1f}" y="{T}" width="{max(0.8, f.x(b) - f.x(a)):.1f}" height="{H - T - B}" '
                  f'fill="{color}" fill-opacity="0.18" class="pause"/>' for a, b in bands]  # fmt: skip
    if trainer:
        pts = " ".join(f"{f.x(t):.1f},{f.y(v):.1f}" for t, v in trainer)
        parts.append(f'<polyline fill="none" stroke="#333" stroke-dasharray="4 3" points="{pts}"/>'
                     f'<text x="{L + 6}" y="{T + 12}" fill="#333">trainer</text>')  # fmt: skip
    for k, (name, pts_) in enumerate(sorted(engines.items())):
        color = COLORS[(k + 1) % len(COLORS)]
        path, prev = [], None
        for t, v in sorted(pts_):
            if prev is not None:
                path.append(f"{f.x(t):.1f},{f.y(prev):.1f}")
            path.append(f"{f.x(t):.1f},{f.y(v):.1f}")
            prev = v
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(path)}"/>'
                     f'<text x="{L + 6}" y="{T + 25 + 13 * k}" fill="{color}">{html.escape(name)}</text>')  # fmt: skip
    return _svg(parts, title)
