"""Per-sweep report read back from MLflow: table, recovery, Pareto frontier,
"the fastest point within a budget", plots. ``python -m quantlab.report``."""
from __future__ import annotations

import tempfile
from pathlib import Path

from quantlab import plots, tracking
from quantlab.errors import UserError
from quantlab.pareto import Point, Recommendation, fastest_within, frontier

# (header, metric or tag key, format)
COLUMNS = (
    ("point", "name", "{}"),
    ("outcome", "tag:" + tracking.OUTCOME_TAG, "{}"),
    ("emulated", "tag:emulated", "{}"),
    ("MB", "size/weight_mb", "{:.1f}"),
    ("bits/w", "size/bits_per_weight", "{:.2f}"),
    ("KL mean", "fid/kl_mean", "{:.2e}"),
    ("top1", "fid/top1_agree", "{:.3f}"),
    ("TTFT p50 ms", "lat/ttft_ms_p50", "{:.1f}"),
    ("TPOT p50 ms", "lat/tpot_ms_p50", "{:.2f}"),
    ("TPOT p99 ms", "lat/tpot_ms_p99", "{:.2f}"),
    ("decode tok/s", "tput/decode_tok_s", "{:.1f}"),
    ("peak RSS MB", "mem/peak_rss_mb", "{:.0f}"),
)


def _cell(run, key: str, fmt: str, reused: bool) -> str:
    if key == "name":
        return run.info.run_name
    if key == "tag:" + tracking.OUTCOME_TAG and reused:
        return "reused"
    if key.startswith("tag:"):
        return run.data.tags.get(key[4:], "-")
    value = run.data.metrics.get(key)
    return "-" if value is None else fmt.format(value)


def table(runs, reused: set[str] = frozenset()) -> str:
    """Markdown table, one row per run; missing values are ``-``, never 0.
    Runs in ``reused`` were finished by an earlier sweep and shown as such."""
    extra = sorted({k for r in runs for k in r.data.metrics
                    if k.startswith(("acc/", "acc_norm/", "ppl_token_wikitext2_w"))
                    and not k.endswith("_windows")})
    columns = [*COLUMNS, *((k, k, "{:.4g}") for k in extra)]
    rows = [[h for h, _, _ in columns]]
    rows += [[_cell(r, k, f, r.info.run_id in reused) for _, k, f in columns] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    reasons = [f"- {r.info.run_name}: {r.data.tags[tracking.REASON_TAG]}" for r in runs
               if tracking.REASON_TAG in r.data.tags]
    if reasons:
        lines += ["", "Skipped or failed:", *reasons]
    if any(r.data.tags.get("emulated") == "true" for r in runs):
        lines += ["", "emulated=true: no real low-precision kernel on this target; "
                  "latency is NOT that of the scheme (numerics and size are)."]
    return "\n".join(lines)


HIGHER_IS_BETTER = ("acc/", "acc_norm/", "exact_match/")
LOWER_IS_BETTER = ("ppl_token_wikitext2_w", "perplexity/", "word_perplexity/", "byte_perplexity/",
                   "bits_per_byte/")


def baseline_run(runs, choice: str = "auto"):
    """The run others are compared to: ``auto`` picks the finished point with the
    most bits per weight (the highest precision); otherwise the point whose
    scheme tag equals ``choice`` (e.g. ``bf16``). None if there is none."""
    done = [r for r in runs if r.data.tags.get(tracking.OUTCOME_TAG) == "finished"]
    if choice != "auto":
        return next((r for r in done if r.data.tags.get("scheme") == choice), None)
    with_bits = [r for r in done if "size/bits_per_weight" in r.data.metrics]
    return max(with_bits, key=lambda r: r.data.metrics["size/bits_per_weight"], default=None)


def recovery(metrics: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``recovery/<metric>``: score / baseline score, oriented so that 1.0 means
    fully recovered and < 1 means worse (perplexities are inverted), as in
    llm-compressor's recovery gate (>= 0.95 to ship)."""
    out = {}
    for key, value in metrics.items():
        b = base.get(key)
        if b is None or key.endswith("_windows"):
            continue
        if key.startswith(HIGHER_IS_BETTER) and b > 0:
            out[f"recovery/{key}"] = value / b
        elif key.startswith(LOWER_IS_BETTER) and value > 0:
            out[f"recovery/{key}"] = b / value
    return out


# --- decision report -------------------------------------------------------

DEFAULT_BUDGETS = (0.01, 0.05)


def decision_metric(runs, choice: str = "auto") -> str:
    """``auto``: token-level perplexity recovery when measured (thousands of
    tokens: far less noisy than a task accuracy over ~100 documents, which can
    rise by chance), else the first accuracy recovery, else top-1 agreement
    with the reference (needs no labels)."""
    if choice != "auto":
        return choice
    keys = sorted({k for r in runs for k in r.data.metrics})
    for prefix in ("recovery/ppl_token_wikitext2_w", "recovery/acc_norm/", "recovery/acc/"):
        hit = [k for k in keys if k.startswith(prefix)]
        if hit:
            return hit[0]
    return "fid/top1_agree"


def loss_of(metrics: dict[str, float], metric: str) -> float | None:
    """Relative loss in [0, 1] for recovery/agreement metrics; KL as is."""
    v = metrics.get(metric)
    if v is None:
        return None
    if metric.startswith("recovery/") or metric == "fid/top1_agree":
        return max(0.0, 1.0 - v)
    return v


def points(runs, metric: str, cost: str) -> list[Point]:
    out = []
    for r in runs:
        m = r.data.metrics
        loss = loss_of(m, metric)
        if r.data.tags.get(tracking.OUTCOME_TAG) == "finished" and loss is not None and cost in m:
            out.append(Point(r.info.run_name, m[cost], loss, r.data.tags.get("emulated") == "true"))
    return out


def decide(runs, metric: str, budgets=DEFAULT_BUDGETS) -> tuple[str, dict[float, Recommendation]]:
    """Markdown: frontiers and the fastest real point within each budget."""
    lat = points(runs, metric, "lat/tpot_ms_p50")
    mem = points(runs, metric, "size/weight_mb")
    kl = metric.startswith(("fid/kl", "kvfid/kl"))
    unit = "" if kl else " (relative loss)"
    lines = [f"Decision metric: `{metric}`{unit}; loss = "
             + ("the KL value" if kl else "1 - value") + "; latency = decode TPOT P50.", ""]
    lines.append("Frontier, loss vs decode latency: " + ", ".join(
        f"{p.name} ({p.cost:.2f} ms, {p.loss:.3g})" for p in frontier([p for p in lat if not p.emulated])))
    lines.append("Frontier, loss vs weight memory: " + ", ".join(
        f"{p.name} ({p.cost:.1f} MiB, {p.loss:.3g})" for p in frontier(mem)))
    recs = {}
    for b in budgets:
        rec = fastest_within(lat, b)
        recs[b] = rec
        what = f"KL <= {b:g}" if kl else f"{b:.0%} loss"
        if rec.point is None:
            lines.append(f"- Within {what}: no real point qualifies.")
        else:
            lines.append(f"- Fastest within {what}: **{rec.point.name}** — {rec.point.cost:.2f} ms/token, "
                         f"loss {rec.point.loss:.3g} (margin {rec.margin:.3g}; {rec.candidates} qualified)")
    if any(p.emulated for p in lat):
        lines.append("- Emulated points are never recommended: their latency is not that of the scheme.")
    return "\n".join(lines), recs


def build(client, experiment_id: str, parent_id: str, metric: str = "auto",
          budgets=DEFAULT_BUDGETS, out_dir: Path | None = None, log_to_run: bool = True) -> str:
    """Table + frontier + recommendations for one sweep; PNG/HTML plots in
    ``out_dir``; with ``log_to_run`` all of it goes to the parent run and the
    recommended child runs get a ``quantlab.recommended.<budget>`` tag."""
    runs, reused = tracking.sweep_runs(client, experiment_id, parent_id)
    runs += reused
    tags = client.get_run(parent_id).data.tags
    metric = decision_metric(runs, metric)
    text, recs = decide(runs, metric, budgets)
    sweep = tags.get(tracking.SWEEP_TAG, "?")
    body = f"# Sweep {sweep} ({parent_id})\n\n{table(runs, {r.info.run_id for r in reused})}\n\n{text}\n"
    out = Path(out_dir or tempfile.mkdtemp(prefix="quantlab-report-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(body)
    panels = {c: points(runs, metric, c) for c in ("lat/tpot_ms_p50", "size/weight_mb")}
    label = metric if metric.startswith(("fid/kl", "kvfid/kl")) else f"loss = 1 - {metric}"
    title = f"quantlab sweep {sweep}"
    if any(panels.values()):
        plots.png(panels, label, out / "pareto.png", title)
        plots.html(panels, label, out / "pareto.html", title)
    if log_to_run:
        for f in ("report.md", "pareto.png", "pareto.html"):
            if (out / f).is_file():
                client.log_artifact(parent_id, str(out / f))
        by_name = {r.info.run_name: r.info.run_id for r in runs}
        for b, rec in recs.items():
            if rec.point is not None:
                tracking.set_tags(client, by_name[rec.point.name], {f"quantlab.recommended.{b:g}": "true"})
                tracking.set_tags(client, parent_id, {f"recommended.{b:g}": rec.point.name})
    return body


def _find_parent(client, experiment_id: str, sweep: str) -> str:
    runs = client.search_runs([experiment_id], filter_string="tags.`quantlab.role` = 'sweep'",
                              order_by=["attributes.start_time DESC"], max_results=1000)
    for r in runs:
        if sweep in ("latest", r.info.run_id, r.data.tags.get(tracking.SWEEP_TAG)):
            return r.info.run_id
    names = sorted({r.data.tags.get(tracking.SWEEP_TAG, "?") for r in runs})
    raise UserError(f"no sweep {sweep!r} in this store; sweeps: {', '.join(names) or 'none'} (or a parent run id)")


def main(argv: list[str] | None = None) -> int:
    """``python -m quantlab.report [--sweep latest|NAME|RUN_ID] ...``"""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m quantlab.report", description=main.__doc__)
    ap.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    ap.add_argument("--experiment", default="quantlab")
    ap.add_argument("--sweep", default="latest", help="latest, a sweep name, or a parent run id")
    ap.add_argument("--metric", default="auto", help="decision metric (auto, fid/kl_mean, recovery/acc/...)")
    ap.add_argument("--budgets", default="0.01,0.05", help="comma-separated loss budgets")
    ap.add_argument("--out", default=None, help="directory for report.md, pareto.png, pareto.html")
    ap.add_argument("--no-log", action="store_true", help="do not write to the parent run")
    args = ap.parse_args(argv)
    from quantlab.config import TrackingConfig

    try:
        client, exp = tracking.connect(TrackingConfig(uri=args.tracking_uri, experiment=args.experiment,
                                                      artifact_root=None))
        parent = _find_parent(client, exp, args.sweep)
    except UserError as e:
        print(f"quantlab.report: {e}", file=sys.stderr)
        return 2
    budgets = tuple(float(b) for b in args.budgets.split(","))
    print(build(client, exp, parent, args.metric, budgets, Path(args.out) if args.out else None,
                not args.no_log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
