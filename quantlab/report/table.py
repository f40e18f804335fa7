"""The report's table: one row per point with its error bars, the paired
comparisons against the baseline, the baseline itself and recovery, and
where each point's time went."""
from __future__ import annotations


from quantlab import decision, metric_names, point, uncertainty
from quantlab.measurement import TIME_PREFIX


# (header, tag key, format): the columns before the metrics', which their probes declare (metric_names.columns); a
# metric with a standard error prints as "value±se"
POINT_COLUMNS = (
    ("point", "name", "{}"),
    ("outcome", "tag:" + point.OUTCOME_TAG, "{}"),
    ("emulated", "tag:" + point.EMULATED_TAG, "{}"),
)


NOT_SIGNIFICANT = "~"


CONTENDED = "†"  # beside a timing taken while other processes used the cores (tag point.CONTENDED_TAG)


def stderr_of(metrics: dict[str, float], key: str) -> float | None:
    """The standard error logged beside ``key`` (absolute units), if any."""
    se = decision.logged_stderr(metrics, key)
    if se is not None and metric_names.lower(key) and metric_names.ranked(key):
        return metrics[key] * se  # delta method: se(PPL) = PPL * se(ln PPL)
    return se


def _cell(run, key: str, fmt: str, note: str, reused: bool) -> str:
    if key == "name":
        return run.name + note
    if key == "tag:" + point.OUTCOME_TAG and reused:
        return "reused"
    if key.startswith("tag:"):
        return run.tags.get(key[4:], "-")
    value = run.metrics.get(key)
    if value is None:
        return "-"
    se = stderr_of(run.metrics, key)
    if se is None:
        return fmt.format(value)
    return fmt.format(value) + "±" + (f"{se:.1e}" if fmt == "{:.2e}" else fmt.format(se))


def table(runs, reused: set[str] = frozenset(), base=None, items: dict | None = None) -> str:
    """Markdown table, one row per run; missing values are ``-``, never 0.
    Runs in ``reused`` were finished by an earlier sweep and shown as such.
    With ``base`` and per-run ``items``, accuracy and perplexity cells whose
    paired difference from the baseline is not significant carry ``~``."""
    items = items or {}
    columns = [*POINT_COLUMNS, *metric_names.columns({k for r in runs for k in r.metrics})]
    rows = [[h for h, _, _ in columns]]
    for r in runs:
        note = " (baseline)" if base is not None and r.id == base.id else ""
        row = [_cell(r, k, f, note, r.id in reused) for _, k, f in columns]
        if base is not None and r.id != base.id:
            for i, (_, k, _) in enumerate(columns):
                pair = decision.compare(k, items.get(r.id, {}), items.get(base.id, {}))
                if pair is not None and not pair.significant:
                    row[i] += " " + NOT_SIGNIFICANT
        if point.CONTENDED_TAG in r.tags:
            row = [c + CONTENDED if metric_names.timed(k) and c != "-" else c for c, (_, k, _) in zip(row, columns)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["", "value±se: standard error over the unit drawn independently (accuracies: documents; "
              "perplexity (delta method): the articles its random windows fell in, cluster-robust over their "
              "windows (articles differ from each other; a population of text is articles like these); KL and "
              "top1: the windows, whose tokens are correlated)."]
    if base is not None:
        lines.append(f"{NOT_SIGNIFICANT}: not significantly different from the baseline {base.name} "
                     f"(paired on the same items: exact McNemar for accuracies, t on the window means of "
                     f"per-token NLL differences for perplexity; two-sided p >= {uncertainty.ALPHA}, per comparison).")
    contended = [f"- {r.name}: {r.tags[point.CONTENDED_TAG]}" for r in runs
                 if point.CONTENDED_TAG in r.tags]
    if contended:
        lines += ["", f"{CONTENDED}: timed while other processes used the cores (CPU time of other processes "
                  "during the timing, steal included): the figure is inflated, not comparable with unmarked "
                  "ones, and a pick never rests on it without saying so.", *contended]
    origins = [f"- {r.name}: measured by run {r.origin}, "
               f"host {r.tags.get(point.HOST_FINGERPRINT_TAG, r.tags.get(point.HOST_CPU_TAG, '?'))}"
               for r in runs if r.id in reused]
    if origins:
        lines += ["", "Reused from earlier runs (same config, code and data; timings only from this host):",
                  *origins]
    reasons = [f"- {r.name}: {r.tags[point.REASON_TAG]}" for r in runs
               if point.REASON_TAG in r.tags]
    if reasons:
        lines += ["", "Skipped or failed:", *reasons]
    stops = [f"- {r.name}: {r.tags[point.PPL_STOP_TAG]}" for r in runs
             if point.PPL_STOP_TAG in r.tags]
    if stops:
        lines += ["", "Adaptive perplexity (windows scored until every budget was decided against the reference "
                  "model; such a point's bound is anytime-valid over its looks, see the decision rule):", *stops]
    stops = [f"- {r.name}: {r.tags[point.ACC_STOP_TAG]}" for r in runs
             if point.ACC_STOP_TAG in r.tags]
    if stops:
        lines += ["", "Adaptive lm-eval (each task's documents scored in their draw order until every budget was "
                  "decided against the reference model; its bound is anytime-valid over its looks):", *stops]
    mixes = [f"- {r.name}: {r.tags[point.GGUF_TYPES_TAG]}" for r in runs
             if point.GGUF_TYPES_TAG in r.tags]
    if mixes:
        lines += ["", "llama.cpp's tensor types (share of the matrix weights; a type other than the point's is "
                  "llama.cpp's fallback for matrices whose rows are not whole 256-weight super-blocks):", *mixes]
    if any(r.tags.get(point.EMULATED_TAG) == "true" for r in runs):
        lines += ["", "emulated=true: no real low-precision kernel on this target; "
                  "latency is NOT that of the scheme (numerics and size are)."]
    return "\n".join(lines)


def paired_table(runs, base, items: dict) -> str:
    """Each point against the baseline on the same items: the difference, its
    standard error and p-value per accuracy/perplexity metric."""
    b_items = items.get(base.id, {})
    keys = sorted(k for k in b_items if metric_names.ranked(k))
    lines = []
    for r in runs:
        if r.id == base.id or not r.done:
            continue
        cells = []
        for k in keys:
            pair = decision.compare(k, items.get(r.id, {}), b_items)
            if pair is None:
                continue
            what = "ln PPL ratio" if metric_names.lower(k) else "diff"
            mark = "" if pair.significant else f" {NOT_SIGNIFICANT}"
            cells.append(f"{k}: {what} {pair.diff:+.4f}±{pair.stderr:.4f} (p={pair.p_value:.2g}, n={pair.n}){mark}")
        if cells:
            lines.append(f"- {r.name}: " + "; ".join(cells))
    if not lines:
        return ""
    return "\n".join([f"Against the baseline {base.name}, paired on the same documents/tokens "
                      f"(point - baseline ± se):", *lines])


def baseline_run(runs, choice: str = "auto"):
    """The run others are compared to: ``auto`` picks the finished point with the
    most bits per weight (the highest precision), preferring bf16 over fp16 at
    equal bits (the dtype models are trained and shipped in); otherwise the
    point whose scheme tag equals ``choice`` (e.g. ``bf16``). None if there is none."""
    done = [r for r in runs if r.done]
    if choice != "auto":
        return next((r for r in done if r.tags.get(point.SCHEME_TAG) == choice), None)
    with_bits = [r for r in done if metric_names.BITS_PER_WEIGHT in r.metrics]
    return max(with_bits, key=lambda r: (r.metrics[metric_names.BITS_PER_WEIGHT],
                                         r.tags.get(point.SCHEME_TAG) == "bf16", r.name), default=None)


def recovery(metrics: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``recovery/<metric>``: score / baseline score, oriented so that 1.0 means
    fully recovered and < 1 means worse (perplexities are inverted), as in
    llm-compressor's recovery gate (>= 0.95 to ship)."""
    out = {}
    for key, value in metrics.items():
        b = base.get(key)
        if b is None or decision.auxiliary(key):
            continue
        if not metric_names.ranked(key):
            continue
        if metric_names.higher(key) and b > 0:
            out[f"{metric_names.RECOVERY}{key}"] = value / b
        elif metric_names.lower(key) and value > 0:
            out[f"{metric_names.RECOVERY}{key}"] = b / value
    return out


def time_table(runs, reused: set[str] = frozenset()) -> str:
    """Wall seconds each point spent per stage (``time/<stage>_s``), stages in
    pipeline order, and the sweep's sum: where a sweep's time goes. Reused
    points show the time of the run that measured them, marked."""
    timed = [r for r in runs if f"{TIME_PREFIX}point_s" in r.metrics]
    if not timed:
        return ""
    order = ("model", "reference", "apply", "engine", "fidelity", "perplexity", "accuracy", "cache", "kv_position",
             "passkey", "latency", "load", "point")
    stages = [s for s in order if any(f"{TIME_PREFIX}{s}_s" in r.metrics for r in timed)]
    head = ["point", *("total" if s == "point" else s for s in stages)]
    rows = [[r.name + (" (reused)" if r.id in reused else ""),
             *(f"{r.metrics[k]:.1f}" if (k := f"{TIME_PREFIX}{s}_s") in r.metrics else "-"
               for s in stages)] for r in timed]
    fresh = [r for r in timed if r.id not in reused]
    rows.append(["sum (measured here)", *(f"{sum(r.metrics.get(f'{TIME_PREFIX}{s}_s', 0.0) for r in fresh):.1f}"
                                          for s in stages)])
    lines = ["Where the time went (wall seconds per stage; apply includes calibration):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
