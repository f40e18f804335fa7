"""The roofline probe's sections of the report. Cost by size: how decode time grows with the weight
bytes a step reads, per engine, for a sweep whose points cover more than one
model (``+sweep=scaling``: named shapes with random weights).

Per engine and scheme (each its own kernel), a least-squares line TPOT = a + b x GB: ``1 / b``
is the effective bandwidth (GB/s) a step reaches once it is bound by bytes,
``a`` the fixed cost per token (launches, Python, sampling). Beside it, per
point, the achieved bandwidth and its share of the host's measured read
bandwidth, and TTFT by prompt length.

And the cost-by-context section (``+sweep=context``, or any sweep whose latency
grid has more than one prompt length): TTFT and TPOT per prompt length, and how
much of TPOT's rise from the shortest to the longest context the cache's extra
bytes explain at the measured bandwidth (the rest is attention's arithmetic).
"""
from __future__ import annotations

import re
from pathlib import Path

from quantlab.measurement import weight_bytes_read
from quantlab.metric_names import SectionView

_CELL = re.compile(r"^cell/b1_p(\d+)/(ttft_ms_p50|tpot_ms_p50|kv_mb)$")
_PRIMARY = {"ttft_ms_p50": "lat/ttft_ms_p50", "tpot_ms_p50": "lat/tpot_ms_p50", "kv_mb": "mem/kv_mb"}


def by_prompt(metrics: dict[str, float], name: str = "ttft_ms_p50") -> dict[int, float]:
    """Prompt length -> the latency probe's ``name`` (``ttft_ms_p50``,
    ``tpot_ms_p50``: decode steps after that prompt, ``kv_mb``: the cache at the
    request's end) at batch 1, the primary cell's and the grid's."""
    out = {int(m[1]): v for k, v in metrics.items() if (m := _CELL.match(k)) and m[2] == name}
    if metrics.get("lat/batch_size") == 1.0 and _PRIMARY[name] in metrics:
        out[int(metrics["lat/prompt_tokens"])] = metrics[_PRIMARY[name]]
    return dict(sorted(out.items()))


def rows(runs) -> list[dict]:
    """One row per finished point with a decode timing, smallest model first."""
    out = []
    for r in runs:
        m = r.metrics
        if not r.done or "lat/tpot_ms_p50" not in m or "size/weight_bytes" not in m:
            continue
        out.append({"name": r.name, "model": r.tags.get("model", "?"),
                    "scheme": r.tags.get("scheme", "?"), "engine": r.tags.get("target.variant", "?"),
                    "emulated": r.tags.get("emulated") == "true", "gb": weight_bytes_read(m) / 1e9,
                    "params": m.get("size/params", 0.0), "tpot": m["lat/tpot_ms_p50"],
                    "gbs": m.get("bw/achieved_gb_s"), "util": m.get("bw/util"), "peak": m.get("bw/peak_gb_s"),
                    "overhead": m.get("bw/overhead_ms"), "rss": m.get("mem/peak_rss_mb"), "ttft": by_prompt(m),
                    "tpot_at": by_prompt(m, "tpot_ms_p50"), "kv_mb": by_prompt(m, "kv_mb")})
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


def by_size(view: SectionView) -> tuple[str, list[str]]:
    """Markdown and the files written in ``view.out`` (``scaling.png``); ('', [])
    unless the sweep's timed points cover more than one model."""
    table, out = rows(view.runs), Path(view.out)
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


def by_context(view: SectionView) -> tuple[str, list[str]]:
    """Markdown and the files written in ``view.out`` (``context.png``); ('', [])
    unless some timed point has TPOT at more than one prompt length."""
    table, out = [r for r in rows(view.runs) if len(r["tpot_at"]) > 1], Path(view.out)
    if not table:
        return "", []
    prompts = sorted({p for r in table for p in r["tpot_at"]})
    head = ["point", "engine", *(f"{k} p{p} ms" for p in prompts for k in ("TTFT", "TPOT")),
            "TPOT rise ms", "of which KV bytes ms", "KV MB at longest"]
    lines = ["Cost by context (batch 1, p50; TPOT p<N>: decode steps after an N-token prompt; TPOT rise: longest "
             "prompt's TPOT minus shortest's; of which KV bytes: the cache's extra megabytes at the host's measured "
             "read bandwidth, the rest of the rise is attention's arithmetic and the engine's own cost):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        lo, hi = min(r["tpot_at"]), max(r["tpot_at"])
        rise = r["tpot_at"][hi] - r["tpot_at"][lo]
        known = r["kv_mb"].get(hi, 0.0) > 0 and lo in r["kv_mb"]  # 0: an engine that does not say (vLLM's server)
        kv_mb = r["kv_mb"][hi] if known else None
        kv_ms = (kv_mb - r["kv_mb"][lo]) * 2**20 / (r["peak"] * 1e9) * 1e3 if known and r["peak"] else None
        cells = [_f(c.get(p), ".1f") for p in prompts for c in (r["ttft"], r["tpot_at"])]
        lines.append("| " + " | ".join([r["name"] + (" (emulated)" if r["emulated"] else ""), r["engine"], *cells,
                                        f"{rise:.2f}", _f(kv_ms, ".2f"), _f(kv_mb, ".0f")]) + " |")
    files = []
    if context_png(table, out / "context.png"):
        files.append("context.png")
        lines += ["", "![TTFT and TPOT against context](context.png)"]
    return "\n".join(lines), files


def context_png(table: list[dict], path: Path) -> bool:
    """Two panels against prompt tokens (log 2 axis): TTFT, and TPOT after that
    prompt; a colour per point. False when there is nothing to draw."""
    if not table:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, r in enumerate(table):
        style = dict(marker="o", c=f"C{i % 10}", ls="--" if r["emulated"] else "-",
                     label=r["name"] + (" (emulated)" if r["emulated"] else ""))
        a.plot(list(r["ttft"]), list(r["ttft"].values()), **style)
        b.plot(list(r["tpot_at"]), list(r["tpot_at"].values()), **style)
    for ax, what in ((a, "TTFT p50 (ms)"), (b, "TPOT p50 after the prompt (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    a.set_yscale("log")
    b.legend(fontsize=7)
    fig.suptitle("cost against context")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
