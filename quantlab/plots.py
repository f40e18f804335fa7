"""Pareto plots: a PNG for reports and an interactive HTML (plotly) for browsing."""
from __future__ import annotations

from pathlib import Path

from quantlab.metric_names import TPOT_P50, WEIGHT_MB
from quantlab.pareto import Point, frontier

COSTS = {TPOT_P50: "decode latency per token, P50 [ms]", WEIGHT_MB: "weight memory [MiB]"}


def _frontier(cost_key: str, pts: list[Point]) -> list[Point]:
    """Memory is real even for emulated points; their latency is not."""
    return frontier(pts if cost_key == WEIGHT_MB else [p for p in pts if not p.emulated])


OFFSETS = ((4, 4), (4, -12), (4, 16), (4, -24), (4, 28), (4, -36), (4, 40), (4, -48))


def label_offsets(pts: list[Point], near: float = 0.04) -> list[tuple[int, int]]:
    """A label offset (points) per point, so that labels of points closer than
    ``near`` of the axes' spans (bf16/fp16 at the same size and loss, the int4
    group sizes) stack instead of overlapping."""
    if not pts:
        return []
    span_c = (max(p.cost for p in pts) - min(p.cost for p in pts)) or 1.0
    span_l = (max(p.loss for p in pts) - min(p.loss for p in pts)) or 1.0
    placed: list[tuple[Point, int]] = []
    out = []
    for p in pts:
        taken = {i for q, i in placed if abs(q.cost - p.cost) / span_c < near and abs(q.loss - p.loss) / span_l < near}
        i = next(i for i in range(len(pts) + 1) if i not in taken)
        placed.append((p, i))
        out.append(OFFSETS[i % len(OFFSETS)] if i < len(OFFSETS) else (4, 4 + 12 * i))
    return out


def png(panels: dict[str, list[Point]], loss_label: str, path: Path, title: str) -> Path:
    """One panel per cost axis; frontier joined by a line; emulated points hollow
    red crosses labelled "(emulated)" so nobody reads their latency as real."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (cost_key, pts) in zip(axes[0], panels.items()):
        real = [p for p in pts if not p.emulated]
        emu = [p for p in pts if p.emulated]
        front = _frontier(cost_key, pts)
        ax.scatter([p.cost for p in real], [p.loss for p in real], s=40, c="tab:blue", label="measured point")
        if emu:
            ax.scatter([p.cost for p in emu], [p.loss for p in emu], s=60, marker="x", c="tab:red",
                       label="emulated (latency not real)")
        if front:
            ax.plot([p.cost for p in front], [p.loss for p in front], "-", c="tab:green", lw=1.5,
                    label="Pareto frontier")
        bounded = [p for p in pts if p.loss_upper is not None]
        if bounded:  # the 95 % bound the budget decision uses
            ax.errorbar([p.cost for p in bounded], [p.loss for p in bounded],
                        yerr=[[0.0] * len(bounded), [p.upper - p.loss for p in bounded]], fmt="none",
                        ecolor="gray", elinewidth=1, capsize=3, label="95% upper bound of the loss")
        for p, offset in zip(pts, label_offsets(pts)):
            ax.annotate(p.name + (" (emulated)" if p.emulated else ""), (p.cost, p.loss),
                        textcoords="offset points", xytext=offset, fontsize=8,
                        arrowprops=dict(arrowstyle="-", lw=0.5, color="gray") if offset != OFFSETS[0] else None)
        ax.set_xlabel(COSTS.get(cost_key, cost_key))
        ax.set_ylabel(loss_label)
        if pts and min(p.loss for p in pts) > 0 and max(p.loss for p in pts) / min(p.loss for p in pts) > 100:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def html(panels: dict[str, list[Point]], loss_label: str, path: Path, title: str) -> Path:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[COSTS.get(k, k) for k in panels])
    for col, (cost_key, pts) in enumerate(panels.items(), start=1):
        for emulated, color, symbol in ((False, "royalblue", "circle"), (True, "crimson", "x-open")):
            sel = [p for p in pts if p.emulated == emulated]
            if sel:
                fig.add_trace(go.Scatter(
                    x=[p.cost for p in sel], y=[p.loss for p in sel], mode="markers+text",
                    error_y=dict(type="data", symmetric=False, array=[p.upper - p.loss for p in sel],
                                 arrayminus=[0.0] * len(sel), color="gray"),
                    text=[p.name for p in sel], textposition="top right",
                    marker=dict(color=color, symbol=symbol, size=10),
                    name="emulated (latency not real)" if emulated else "measured point",
                    showlegend=col == 1,
                    hovertemplate="%{text}<br>cost %{x:.3g}<br>loss %{y:.3g}<extra></extra>"), row=1, col=col)
        front = _frontier(cost_key, pts)
        fig.add_trace(go.Scatter(x=[p.cost for p in front], y=[p.loss for p in front], mode="lines",
                                 line=dict(color="seagreen"), name="Pareto frontier", showlegend=col == 1),
                      row=1, col=col)
        fig.update_xaxes(title_text=COSTS.get(cost_key, cost_key), row=1, col=col)
        fig.update_yaxes(title_text=loss_label, row=1, col=col)
    fig.update_layout(title=title, height=500)
    # plotly.js inlined (4.8 MB): the MLflow UI shows this file in a sandboxed
    # frame on machines that often have no route to a CDN
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return path


LOAD_PANELS = (("ttft_ms_p99", "TTFT P99 [ms]"), ("itl_ms_p99", "inter-token latency P99 [ms]"),
               ("achieved_rps", "achieved [requests/s]"))


def load_png(series: dict[str, list[dict]], path: Path, title: str, slo: dict[str, float | None]) -> Path:
    """P99 TTFT, P99 ITL and achieved rate against offered rate, one line per
    series (a policy, or point/policy); rates that ended early (saturated)
    are drawn as hollow markers; the SLOs as dashed lines; achieved == offered
    as a dotted diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LOAD_PANELS), figsize=(6 * len(LOAD_PANELS), 4.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], LOAD_PANELS):
        for name, rows in series.items():
            rows = sorted(rows, key=lambda r: r["offered_rps"])
            line, = ax.plot([r["offered_rps"] for r in rows], [r.get(key, float("nan")) for r in rows], "-o", ms=4,
                            label=name)
            ended = [r for r in rows if r.get("stopped")]
            ax.scatter([r["offered_rps"] for r in ended], [r.get(key, float("nan")) for r in ended], s=70,
                       facecolors="none", edgecolors=line.get_color())
        limit = {"ttft_ms_p99": slo.get("ttft_ms"), "itl_ms_p99": slo.get("tpot_ms")}.get(key)
        if limit:
            ax.axhline(limit, ls="--", c="gray", lw=1, label="SLO")
        if key == "achieved_rps":
            top = max((r["offered_rps"] for rows in series.values() for r in rows), default=1.0)
            ax.plot([0, top], [0, top], ":", c="gray", lw=1, label="achieved = offered")
        elif any(r.get(key, 0) > 0 for rows in series.values() for r in rows):
            ax.set_yscale("log")
        ax.set_xlabel("offered [requests/s]")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    fig.suptitle(title + " (hollow: rate ended early, saturated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_html(series: dict[str, list[dict]], path: Path, title: str) -> Path:
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(LOAD_PANELS), subplot_titles=[label for _, label in LOAD_PANELS])
    for col, (key, label) in enumerate(LOAD_PANELS, start=1):
        for i, (name, rows) in enumerate(series.items()):
            rows = sorted(rows, key=lambda r: r["offered_rps"])
            fig.add_trace(go.Scatter(
                x=[r["offered_rps"] for r in rows], y=[r.get(key) for r in rows], mode="lines+markers", name=name,
                legendgroup=name, showlegend=col == 1, line=dict(color=qualitative.Plotly[i % len(qualitative.Plotly)]),
                text=[r.get("stopped") or "" for r in rows],
                hovertemplate=f"{name}<br>offered %{{x:.3g}}/s<br>{label} %{{y:.4g}}<br>%{{text}}<extra></extra>"),
                row=1, col=col)
        fig.update_xaxes(title_text="offered [requests/s]", row=1, col=col)
    fig.update_layout(title=title, height=480)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return path


def kv_position_png(series: dict[str, list[tuple[float, float, float]]], path: Path, title: str) -> Path:
    """KL against position, one line per point: ``(bucket midpoint, mean
    KL, se over windows)`` per bucket, error bars at +-1 se; both axes log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6))
    for name, pts in series.items():
        pts = sorted(p for p in pts if p[1] > 0)  # an exact cache's 0 has no place on a log axis
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], fmt="-o", ms=4,
                    capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("position in the window (bucket midpoint) [tokens]")
    ax.set_ylabel("KL against the uncached pass [nats]")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
