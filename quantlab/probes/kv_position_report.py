"""The KV-position probe's section of the report: each point's KV-cache KL
by position bucket, with a plot."""
from __future__ import annotations

from pathlib import Path

from quantlab import plots
from quantlab.metric_names import SectionView

def tokens(n: str) -> int:
    """The inverse of :func:`quantlab.probes.kv_position.tokens_name`: ``1k`` -> 1024."""
    return int(n[:-1]) * 1024 if n.endswith("k") else int(n)


def _bucket_start(key: str) -> int:
    return tokens(key.split("_")[-2])


def kv_position_series(runs) -> dict[str, list[tuple[float, float, float]]]:
    """Per point that ran the position probe: ``(bucket midpoint, KL, se)`` per bucket."""
    out = {}
    for r in runs:
        m = r.metrics
        if not r.done or "kvpos/windows" not in m:
            continue
        out[r.name] = [((tokens(k.split("_")[-2]) + tokens(k.split("_")[-1])) / 2, m[k],
                                 m.get(k + "_stderr", 0.0))
                                for k in m if k.startswith("kvpos/kl_") and not k.endswith("_stderr")]
    return out


def kv_position_table(runs) -> str:
    """Markdown: each point's KV-cache KL by position bucket (± se over
    windows) and the first bucket whose bound passed the tolerance; '' when
    no point ran the position probe."""
    timed = [r for r in runs if r.done and "kvpos/windows" in r.metrics]
    if not timed:
        return ""
    keys = sorted({k for r in timed for k in r.metrics if k.startswith("kvpos/kl_") and not k.endswith("_stderr")},
                  key=_bucket_start)
    head = ["point", *(k.removeprefix("kvpos/kl_").replace("_", "-") for k in keys), "first bucket over"]
    rows = [[r.name, *(f"{r.metrics[k]:.2e}±{r.metrics.get(k + '_stderr', float('nan')):.1e}"
                                if k in r.metrics else "-" for k in keys),
             r.tags.get("kvpos.first_over", "-")] for r in timed]
    lines = ["KV cache by position (KL against the uncached pass per bucket of positions, ± se over windows; "
             "the first bucket whose one-sided 95 % bound passes probe.kv_position.tolerance):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def section(view: SectionView) -> tuple[str, list[str]]:
    """The table (:func:`kv_position_table`) and, where a point ran the
    probe, ``kv_position.png`` in ``view.out``."""
    text = kv_position_table(view.runs)
    if not (series := kv_position_series(view.runs)):
        return text, []
    plots.kv_position_png(series, Path(view.out) / "kv_position.png", f"{view.title}: KV cache error by position")
    return text + "\n\n![KL by position](kv_position.png)", ["kv_position.png"]
