"""The report's cost-by-size section: how decode time grows with the weight
bytes a step reads, per engine, for a sweep whose points cover more than one
model (``+sweep=scaling``: named shapes with random weights).

Per engine and scheme (each its own kernel), a least-squares line TPOT = a + b x GB: ``1 / b``
is the effective bandwidth (GB/s) a step reaches once it is bound by bytes,
``a`` the fixed cost per token (launches, Python, sampling). Beside it, per
point, the achieved bandwidth and its share of the host's measured read
bandwidth, and TTFT by prompt length.
"""
from __future__ import annotations

import re
from pathlib import Path

from quantlab import tracking
from quantlab.measurement import weight_bytes_read

_CELL_TTFT = re.compile(r"^cell/b1_p(\d+)/ttft_ms_p50$")


def ttft_by_prompt(metrics: dict[str, float]) -> dict[int, float]:
    """Prompt length -> TTFT p50 (ms) at batch 1, the primary cell's and the grid's."""
    out = {int(m[1]): v for k, v in metrics.items() if (m := _CELL_TTFT.match(k))}
    if metrics.get("lat/batch_size") == 1.0 and "lat/ttft_ms_p50" in metrics:
        out[int(metrics["lat/prompt_tokens"])] = metrics["lat/ttft_ms_p50"]
    return dict(sorted(out.items()))


def rows(runs) -> list[dict]:
    """One row per finished point with a decode timing, smallest model first."""
    out = []
    for r in runs:
        m = r.data.metrics
        if not tracking.done(r) or "lat/tpot_ms_p50" not in m or "size/weight_bytes" not in m:
            continue
        out.append({"name": r.info.run_name, "model": r.data.tags.get("model", "?"),
                    "scheme": r.data.tags.get("scheme", "?"), "engine": r.data.tags.get("target.variant", "?"),
                    "emulated": r.data.tags.get("emulated") == "true", "gb": weight_bytes_read(m) / 1e9,
                    "params": m.get("size/params", 0.0), "tpot": m["lat/tpot_ms_p50"],
                    "gbs": m.get("bw/achieved_gb_s"), "util": m.get("bw/util"),
                    "overhead": m.get("bw/overhead_ms"), "rss": m.get("mem/peak_rss_mb"), "ttft": ttft_by_prompt(m)})
    return sorted(out, key=lambda x: (x["engine"], x["params"], x["gb"]))


def fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b x`` as ``(a, b)``; None under two distinct x."""
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fits(table: list[dict]) -> dict[tuple[str, str], tuple[float, float, int]]:
    """(engine, scheme) -> (intercept ms, slope ms/GB, points) over its real
    (not emulated) points: one kernel's cost across sizes."""
    out = {}
    for key in dict.fromkeys((r["engine"], r["scheme"]) for r in table):
        pts = [r for r in table if (r["engine"], r["scheme"]) == key and not r["emulated"]]
        if (ab := fit([r["gb"] for r in pts], [r["tpot"] for r in pts])) is not None:
            out[key] = (*ab, len(pts))
    return out


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def section(runs, out: Path) -> tuple[str, list[str]]:
    """Markdown and the files written in ``out`` (``scaling.png``); ('', [])
    unless the sweep's timed points cover more than one model."""
    table = rows(runs)
    if len({r["model"] for r in table}) < 2:
        return "", []
    prompts = sorted({p for r in table for p in r["ttft"]})
    head = ["point", "model", "engine", "weight GB read", "TPOT p50 ms", "GB/s", "share of peak", "overhead ms/token",
            *(f"TTFT p{p} ms" for p in prompts), "peak RSS MB"]
    lines = ["Cost by size (decode at batch 1; GB/s = weight bytes a step reads x steps per second; share of the "
             "host's measured read bandwidth; overhead = TPOT minus bytes / that bandwidth):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        lines.append("| " + " | ".join([
            r["name"] + (" (emulated)" if r["emulated"] else ""), r["model"], r["engine"], f"{r['gb']:.3f}",
            f"{r['tpot']:.2f}", _f(r["gbs"], ".1f"), _f(r["util"] and 100 * r["util"], ".0f") + "%",
            _f(r["overhead"], ".2f"), *(_f(r["ttft"].get(p), ".0f") for p in prompts), _f(r["rss"], ".0f")]) + " |")
    lines += ["", "TPOT against weight GB per engine and scheme, least squares over its real points across sizes "
              "(slope: ms per GB, 1 / slope: the effective bandwidth once bound by bytes; intercept: fixed cost "
              "per token):", "",
              "| engine | scheme | points | ms per GB | effective GB/s | intercept ms |", "|---|---|---|---|---|---|"]
    lines_fit = fits(table)
    lines += [f"| {e} | {sc} | {n} | {b:.2f} | {_f(1e3 / b if b > 0 else None, '.1f')} | {a:.2f} |"
              for (e, sc), (a, b, n) in lines_fit.items()]
    files = []
    if png(table, lines_fit, out / "scaling.png"):
        files.append("scaling.png")
        lines += ["", "![TPOT against weight bytes](scaling.png)"]
    return "\n".join(lines), files


def png(table: list[dict], lines: dict[tuple[str, str], tuple[float, float, int]], path: Path) -> bool:
    """TPOT against weight GB: a colour per engine, a marker and a fitted line
    per scheme (``lines``: :func:`fits` of the table); emulated points hollow;
    the largest model's points named. False when there is nothing to draw."""
    if not table:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    schemes = list(dict.fromkeys(r["scheme"] for r in table))
    biggest = max(r["params"] for r in table)
    for i, engine in enumerate(dict.fromkeys(r["engine"] for r in table)):
        colour = f"C{i}"
        for j, scheme in enumerate(schemes):
            pts = [r for r in table if (r["engine"], r["scheme"]) == (engine, scheme)]
            if not pts:
                continue
            marker, style = "osD^v<>"[j % 7], ("-", "--", ":", "-.")[j % 4]
            real, emu = [r for r in pts if not r["emulated"]], [r for r in pts if r["emulated"]]
            if real:
                ax.scatter([r["gb"] for r in real], [r["tpot"] for r in real], c=colour, marker=marker,
                           label=f"{engine} {scheme}")
            if emu:
                ax.scatter([r["gb"] for r in emu], [r["tpot"] for r in emu], facecolors="none", edgecolors=colour,
                           marker=marker, label=f"{engine} {scheme} (emulated)")
            if (engine, scheme) in lines:
                a, b, _ = lines[(engine, scheme)]
                xs = [0.0, max(r["gb"] for r in pts)]
                ax.plot(xs, [a + b * x for x in xs], style, c=colour, lw=1)
            for r in pts:
                if r["params"] == biggest:  # the rest are named by the table; labels there would overlap
                    ax.annotate(r["model"].removesuffix("-random"), (r["gb"], r["tpot"]), fontsize=7,
                                textcoords="offset points", xytext=(4, 3))
    ax.set_xlabel("weight GB a decode step reads")
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_title("decode time per token against weight bytes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
