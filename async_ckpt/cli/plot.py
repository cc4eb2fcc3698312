"""``stats --plot``: a picture of a run's saves from its stats log (matplotlib, the ``plot``
extra), and the terminal's sparklines of the same figures."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..stats import FAILED, FALLBACK, UPLOAD_SKIPPED, SaveStats

#: the picture's size in inches at :data:`DPI`: 1000 x 640 pixels
FIGSIZE = (10.0, 6.4)
DPI = 100
#: colours of the marks (matplotlib's tab10): a test finds them in the picture
SKIPPED_COLOR = "#ff7f0e"
FALLBACK_COLOR = "#9467bd"
FAILED_COLOR = "#d62728"
_BARS = "▁▂▃▄▅▆▇█"
_ASCII_BARS = "_.-=+*#@"


def marks(records: Sequence[SaveStats]) -> Dict[str, List[int]]:
    """The steps of the records that are marked: ``upload_skipped``, ``fallback``, ``failed``.

    Args:
        records: the stats log's records.

    Returns:
        Mark name -> steps (sorted, each once).
    """
    out: Dict[str, List[int]] = {}
    for key in (UPLOAD_SKIPPED, FALLBACK, FAILED):
        out[key] = sorted({r.step for r in records if r.extra.get(key)})
    return out


def plot_run(records: Sequence[SaveStats], out: Any, title: str) -> Tuple[int, int]:
    """Draw a run's saves and write the picture to ``out`` (its format from the file's suffix:
    ``.png``, ``.svg``, ``.pdf``).

    Top: the time training was blocked per save (ms, left axis) and the time until each save
    was durable (s, right axis; one line per tier); vertical lines mark steps whose upload was
    skipped (orange dashes), that fell back to the local tier (purple dots) and saves that
    failed (red). Bottom: the bytes each save wrote, and those it took from earlier steps
    (incremental saves), stacked.

    Args:
        records: the stats log's records, in log order.
        out: a path or a writable binary file.
        title: the picture's title.

    Returns:
        The picture's size in pixels ``(width, height)``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("stats --plot needs matplotlib (pip install matplotlib, or from a checkout of "
                          "async_ckpt: pip install -e '.[plot]')") from None
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    done = [r for r in records if not r.extra.get(FAILED)]
    steps = sorted({r.step for r in records})
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    width = 0.8 * (min(gaps) if gaps else 1)

    # blocking time: one point per save (the tiers of one save share the stall)
    seen: Dict[int, SaveStats] = {}
    for r in done:
        seen.setdefault(r.step, r)
    xs = sorted(seen)
    top.plot(xs, [seen[s].blocking_s * 1e3 for s in xs], "o-", color="#1f77b4", ms=3, lw=1,
             label="blocked (ms)")
    top.set_ylabel("training blocked (ms)", color="#1f77b4")
    top.set_ylim(bottom=0)
    right = top.twinx()
    tiers = sorted({str(r.extra.get("tier", "")) for r in done})
    colors = {"": "#2ca02c", "persistent": "#2ca02c", "local": "#8c564b"}
    for tier in tiers:
        pts = sorted((r.step, r.durable_s) for r in done if str(r.extra.get("tier", "")) == tier
                     and r.durable_s is not None)
        if pts:
            right.plot([p[0] for p in pts], [p[1] for p in pts], "s--", color=colors.get(tier, "#7f7f7f"), ms=3,
                       lw=1, label=f"durable after (s){f', {tier}' if tier else ''}")
    right.set_ylabel("durable after (s)", color="#2ca02c")
    right.set_ylim(bottom=0)
    handles = top.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    found = marks(records)
    styles = {UPLOAD_SKIPPED: (SKIPPED_COLOR, "--", "upload skipped"),
              FALLBACK: (FALLBACK_COLOR, ":", "fell back to the local tier"),
              FAILED: (FAILED_COLOR, "-", "save failed")}
    for key, (color, ls, label) in styles.items():
        for i, s in enumerate(found[key]):
            line = top.axvline(s, color=color, ls=ls, lw=2, label=label)
            bottom.axvline(s, color=color, ls=ls, lw=2)
            if i == 0:
                handles.append(line)
    top.legend(handles=handles, loc="best", fontsize=8, framealpha=0.8)
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3)

    # bytes written and shared, per save (the persistent root's copy where there are tiers)
    per_step: Dict[int, SaveStats] = {}
    for r in done:
        if r.step not in per_step or r.extra.get("tier") == "persistent":
            per_step[r.step] = r
    bx = sorted(per_step)
    written, scale, unit = _scaled([per_step[s].written_bytes or per_step[s].nbytes for s in bx])
    shared = [per_step[s].referred_bytes / scale for s in bx]
    bottom.bar(bx, written, width=width, color="#1f77b4", label=f"written ({unit})")
    if any(shared):
        bottom.bar(bx, shared, width=width, bottom=written, color="#aec7e8",
                   label=f"taken from earlier steps ({unit})")
    bottom.set_ylabel(f"bytes ({unit})")
    bottom.set_xlabel("step")
    # above the bars, never over them (loc="best" covered the newest bar of a full plot)
    bottom.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=8, frameon=False,
                  borderaxespad=0.2)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    w, h = fig.get_size_inches() * DPI
    return int(round(w)), int(round(h))


def _scaled(values: List[int]) -> Tuple[List[float], float, str]:
    top = max(values, default=0)
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if top >= scale:
            return [v / scale for v in values], scale, unit
    return [float(v) for v in values], 1.0, "B"


def sparkline(values: Sequence[Optional[float]], width: int = 60) -> str:
    """A one-line chart of ``values`` (the last ``width`` of them), from 0 to their maximum;
    ``" "`` for a missing value. Block characters where the terminal can print them, else
    ASCII.

    Args:
        values: the figures, oldest first.
        width: how many of the newest to show.

    Returns:
        The line.
    """
    shown = list(values)[-width:]
    top = max((v for v in shown if v is not None), default=0.0)
    bars = _BARS
    try:
        bars.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        bars = _ASCII_BARS
    out = []
    for v in shown:
        if v is None:
            out.append(" ")
        else:
            out.append(bars[min(len(bars) - 1, int(v / top * (len(bars) - 1) + 0.5)) if top > 0 else 0])
    return "".join(out)
