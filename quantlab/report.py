"""Per-sweep report read back from MLflow: table, recovery, Pareto frontier,
"the fastest point within a budget", plots. Its command line (``quantlab
report``) is :mod:`quantlab.report_cli`."""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

from quantlab import decision, metric_names, plots, point, retime, scaling, serving_report, tracking, uncertainty
from quantlab.config import DecisionConfig
from quantlab.errors import UserError
from quantlab.measurement import TIME_PREFIX
from quantlab.pareto import Point, Recommendation, fastest_within, frontier

# (header, metric or tag key, format); a metric with a standard error (see
# STDERR) prints as "value±se".
COLUMNS = (
    ("point", "name", "{}"),
    ("outcome", "tag:" + point.OUTCOME_TAG, "{}"),
    ("emulated", "tag:" + point.EMULATED_TAG, "{}"),
    ("MiB", "size/weight_mb", "{:.1f}"),
    ("bits/w", "size/bits_per_weight", "{:.2f}"),
    ("KL mean", "fid/kl_mean", "{:.2e}"),
    ("top1", "fid/top1_agree", "{:.3f}"),
    ("KV KL", "kvfid/kl_mean", "{:.2e}"),  # decoding through the point's cache vs without one
    ("TTFT p50 ms", "lat/ttft_ms_p50", "{:.1f}"),
    ("TPOT p50 ms", "lat/tpot_ms_p50", "{:.2f}"),
    ("TPOT p99 ms", "lat/tpot_ms_p99", "{:.2f}"),
    ("decode tok/s", "tput/decode_tok_s", "{:.1f}"),
    ("peak RSS MiB", "mem/peak_rss_mb", "{:.0f}"),
)
NOT_SIGNIFICANT = "~"
CONTENDED = "†"  # beside a timing taken while other processes used the cores (tag point.CONTENDED_TAG)
# columns whose figure a contended timing inflates
TIMED = ("lat/", "tput/", "load/")


def stderr_of(metrics: dict[str, float], key: str) -> float | None:
    """The standard error logged beside ``key`` (absolute units), if any."""
    se = decision.logged_stderr(metrics, key)
    if se is not None and metric_names.lower(key) and metric_names.ranked(key):
        return metrics[key] * se  # delta method: se(PPL) = PPL * se(ln PPL)
    return se


def _cell(run, key: str, fmt: str, note: str, reused: bool) -> str:
    if key == "name":
        return run.info.run_name + note
    if key == "tag:" + point.OUTCOME_TAG and reused:
        return "reused"
    if key.startswith("tag:"):
        return run.data.tags.get(key[4:], "-")
    value = run.data.metrics.get(key)
    if value is None:
        return "-"
    se = stderr_of(run.data.metrics, key)
    if se is None:
        return fmt.format(value)
    return fmt.format(value) + "±" + (f"{se:.1e}" if fmt == "{:.2e}" else fmt.format(se))


def table(runs, reused: set[str] = frozenset(), base=None, items: dict | None = None) -> str:
    """Markdown table, one row per run; missing values are ``-``, never 0.
    Runs in ``reused`` were finished by an earlier sweep and shown as such.
    With ``base`` and per-run ``items``, accuracy and perplexity cells whose
    paired difference from the baseline is not significant carry ``~``."""
    items = items or {}
    shown = {k for _, k, _ in COLUMNS}
    extra = sorted({k for r in runs for k in r.data.metrics
                    if k not in shown and (s := metric_names.spec(k)) is not None and s.column})
    columns = [*COLUMNS, *((metric_names.spec(k).column.format(name=k), k, metric_names.spec(k).fmt) for k in extra)]
    if any("load/knee_rps" in r.data.metrics for r in runs):
        columns += [("capacity under SLOs req/s", "load/knee_rps", "{:.2f}"),
                    (f"capacity {uncertainty.LEVEL:.0%} lower bound", "load/knee_rps_lower", "{:.2f}")]
    rows = [[h for h, _, _ in columns]]
    for r in runs:
        note = " (baseline)" if base is not None and r.info.run_id == base.info.run_id else ""
        row = [_cell(r, k, f, note, r.info.run_id in reused) for _, k, f in columns]
        if base is not None and r.info.run_id != base.info.run_id:
            for i, (_, k, _) in enumerate(columns):
                pair = decision.compare(k, items.get(r.info.run_id, {}), items.get(base.info.run_id, {}))
                if pair is not None and not pair.significant:
                    row[i] += " " + NOT_SIGNIFICANT
        if point.CONTENDED_TAG in r.data.tags:
            row = [c + CONTENDED if k.startswith(TIMED) and c != "-" else c for c, (_, k, _) in zip(row, columns)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["", "value±se: standard error over the unit drawn independently (accuracies: documents; "
              "perplexity (delta method): the articles its random windows fell in, cluster-robust over their "
              "windows (articles differ from each other; a population of text is articles like these); KL and "
              "top1: the windows, whose tokens are correlated)."]
    if base is not None:
        lines.append(f"{NOT_SIGNIFICANT}: not significantly different from the baseline {base.info.run_name} "
                     f"(paired on the same items: exact McNemar for accuracies, t on the window means of "
                     f"per-token NLL differences for perplexity; two-sided p >= {uncertainty.ALPHA}, per comparison).")
    contended = [f"- {r.info.run_name}: {r.data.tags[point.CONTENDED_TAG]}" for r in runs
                 if point.CONTENDED_TAG in r.data.tags]
    if contended:
        lines += ["", f"{CONTENDED}: timed while other processes used the cores (CPU time of other processes "
                  "during the timing, steal included): the figure is inflated, not comparable with unmarked "
                  "ones, and a pick never rests on it without saying so.", *contended]
    origins = [f"- {r.info.run_name}: measured by run {tracking.origin(r)}, "
               f"host {r.data.tags.get(point.HOST_FINGERPRINT_TAG, r.data.tags.get(point.HOST_CPU_TAG, '?'))}"
               for r in runs if r.info.run_id in reused]
    if origins:
        lines += ["", "Reused from earlier runs (same config, code and data; timings only from this host):",
                  *origins]
    reasons = [f"- {r.info.run_name}: {r.data.tags[point.REASON_TAG]}" for r in runs
               if point.REASON_TAG in r.data.tags]
    if reasons:
        lines += ["", "Skipped or failed:", *reasons]
    stops = [f"- {r.info.run_name}: {r.data.tags[point.PPL_STOP_TAG]}" for r in runs
             if point.PPL_STOP_TAG in r.data.tags]
    if stops:
        lines += ["", "Adaptive perplexity (windows scored until every budget was decided against the reference "
                  "model; such a point's bound is anytime-valid over its looks, see the decision rule):", *stops]
    stops = [f"- {r.info.run_name}: {r.data.tags[point.ACC_STOP_TAG]}" for r in runs
             if point.ACC_STOP_TAG in r.data.tags]
    if stops:
        lines += ["", "Adaptive lm-eval (each task's documents scored in their draw order until every budget was "
                  "decided against the reference model; its bound is anytime-valid over its looks):", *stops]
    mixes = [f"- {r.info.run_name}: {r.data.tags[point.GGUF_TYPES_TAG]}" for r in runs
             if point.GGUF_TYPES_TAG in r.data.tags]
    if mixes:
        lines += ["", "llama.cpp's tensor types (share of the matrix weights; a type other than the point's is "
                  "llama.cpp's fallback for matrices whose rows are not whole 256-weight super-blocks):", *mixes]
    if any(r.data.tags.get(point.EMULATED_TAG) == "true" for r in runs):
        lines += ["", "emulated=true: no real low-precision kernel on this target; "
                  "latency is NOT that of the scheme (numerics and size are)."]
    return "\n".join(lines)


def paired_table(runs, base, items: dict) -> str:
    """Each point against the baseline on the same items: the difference, its
    standard error and p-value per accuracy/perplexity metric."""
    b_items = items.get(base.info.run_id, {})
    keys = sorted(k for k in b_items if metric_names.ranked(k))
    lines = []
    for r in runs:
        if r.info.run_id == base.info.run_id or not tracking.done(r):
            continue
        cells = []
        for k in keys:
            pair = decision.compare(k, items.get(r.info.run_id, {}), b_items)
            if pair is None:
                continue
            what = "ln PPL ratio" if metric_names.lower(k) else "diff"
            mark = "" if pair.significant else f" {NOT_SIGNIFICANT}"
            cells.append(f"{k}: {what} {pair.diff:+.4f}±{pair.stderr:.4f} (p={pair.p_value:.2g}, n={pair.n}){mark}")
        if cells:
            lines.append(f"- {r.info.run_name}: " + "; ".join(cells))
    if not lines:
        return ""
    return "\n".join([f"Against the baseline {base.info.run_name}, paired on the same documents/tokens "
                      f"(point - baseline ± se):", *lines])


def baseline_run(runs, choice: str = "auto"):
    """The run others are compared to: ``auto`` picks the finished point with the
    most bits per weight (the highest precision), preferring bf16 over fp16 at
    equal bits (the dtype models are trained and shipped in); otherwise the
    point whose scheme tag equals ``choice`` (e.g. ``bf16``). None if there is none."""
    done = [r for r in runs if tracking.done(r)]
    if choice != "auto":
        return next((r for r in done if r.data.tags.get(point.SCHEME_TAG) == choice), None)
    with_bits = [r for r in done if "size/bits_per_weight" in r.data.metrics]
    return max(with_bits, key=lambda r: (r.data.metrics["size/bits_per_weight"],
                                         r.data.tags.get(point.SCHEME_TAG) == "bf16", r.info.run_name), default=None)


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
            out[f"recovery/{key}"] = value / b
        elif metric_names.lower(key) and value > 0:
            out[f"recovery/{key}"] = b / value
    return out


# --- decision report -------------------------------------------------------

DEFAULT_BUDGETS = (0.01, 0.05)
SKIPPED_TAG = "retime.skipped"  # on a sweep parent: why nothing was re-timed (quantlab.retiming)
# What a budget's pick maximises: (metric, sign so that lower cost wins, words, unit).
OBJECTIVES = {"tpot": ("lat/tpot_ms_p50", 1.0, "the lowest decode TPOT P50", "ms/token"),
              "capacity": ("load/knee_rps_lower", -1.0, "the highest capacity under the SLOs (the lower bound "
                           "of the load probe's knee)", "req/s under the SLOs")}


def decision_metric(runs, choice: str = "auto", base=None, items: dict | None = None, budgets=(),
                    alpha: float = uncertainty.ALPHA) -> str:
    """The metric a decision is made on (:func:`auto_metric`'s)."""
    return auto_metric(runs, choice, base, items, budgets, alpha)[0]


def auto_metric(runs, choice: str = "auto", base=None, items: dict | None = None, budgets=(),
                alpha: float = uncertainty.ALPHA) -> tuple[str, str]:
    """``(metric, why metrics before it were passed over)``. ``auto``:
    token-level perplexity when measured (thousands of tokens: far less
    noisy than a task accuracy over ~100 documents), else an accuracy, else
    top-1 agreement with the reference (needs no labels); with the baseline
    run ``base`` and ``budgets`` given, a metric whose design cannot decide
    any budget is passed over, said in one line: a point identical to the
    baseline on every item would still be bounded above the largest budget
    (:func:`best_case`)."""
    if choice != "auto":
        return decision.base_metric(choice), ""
    keys = sorted({k for r in runs for k in r.data.metrics if not decision.auxiliary(k)})
    order = [k for prefix in ("ppl_token_wikitext2_w", "acc_norm/", "acc/") for k in keys if k.startswith(prefix)]
    order += ["fid/top1_agree"] if "fid/top1_agree" in keys or not order else []
    why = []
    for k in order:
        best = best_case(k, base, items, alpha) if base is not None and budgets else 0.0
        if best <= max(budgets, default=math.inf):
            return k, "; ".join(why)
        why.append(f"auto passed over {k}: a point identical to the baseline on every item would be bounded at "
                   f"{best:.3g}, above the largest budget {max(budgets):g}, so it cannot decide any")
    return order[0], (f"no measured metric can decide a budget ({'; '.join(why)}): {order[0]} is shown, and no "
                      f"point can qualify on it")


def information_only(runs, metric: str, base, items: dict | None, budgets, alpha: float) -> str:
    """One sentence naming the measured metrics other than ``metric`` (the
    ones :func:`auto_metric` weighs) whose design cannot decide any of
    ``budgets`` (:func:`best_case` above the largest), so that reading them as
    a verdict is ruled out in the report itself; '' when there are none."""
    if base is None or not budgets:
        return ""
    keys = sorted({k for r in runs for k in r.data.metrics if not decision.auxiliary(k)} - {metric})
    weak = [(k, b) for k in keys if k.startswith(("ppl_token_wikitext2_w", "acc_norm/", "acc/", "fid/top1_agree"))
            and (b := best_case(k, base, items, alpha)) > max(budgets)]
    if not weak:
        return ""
    return (f" Information only here, since a point identical to the baseline on every item would still be bounded "
            f"above the largest budget {max(budgets):g}: " + ", ".join(f"{k} ({'no bound' if math.isinf(b) else f'at {b:.3g}'})" for k, b in weak) + ".")


def best_case(metric: str, base, items: dict | None, alpha: float) -> float:
    """The bound at ``alpha`` of a point identical to the baseline ``base``
    on every item of ``metric`` (its loss exactly 0 as measured): the least
    any point of this design can be shown to lose."""
    m, own = base.data.metrics, (items or {}).get(base.info.run_id, {})
    lo = decision.loss(metric, m, own, m, own)
    return lo.bound.upper_at(alpha) if lo is not None and lo.bounded else math.inf


def run_loss(run, metric: str, base=None, items: dict | None = None) -> decision.Loss | None:
    """The finished ``run``'s loss on ``metric`` against the baseline run
    ``base`` (see :mod:`quantlab.decision`); None when it has none."""
    if not tracking.done(run):
        return None
    items = items or {}
    is_base = base is not None and run.info.run_id == base.info.run_id
    return decision.loss(metric, run.data.metrics, items.get(run.info.run_id, {}),
                         base.data.metrics if base is not None else {},
                         items.get(base.info.run_id, {}) if base is not None else {}, is_base)


# a cost's spread over the requests that timed it: the least and the greatest request's figure
RANGES = {"lat/tpot_ms_p50": ("lat/tpot_ms_req_lo", "lat/tpot_ms_req_hi")}


def points(runs, metric: str, cost: str, base=None, items: dict | None = None) -> list[Point]:
    """Finished runs with both a loss (see :func:`run_loss`) and ``cost``
    (and its request range, :data:`RANGES`, where logged)."""
    out, span = [], RANGES.get(cost)
    for r in runs:
        m = r.data.metrics
        if cost not in m:
            continue
        lo = run_loss(r, metric, base, items)
        if lo is not None:
            out.append(Point(r.info.run_name, m[cost], lo.value, r.data.tags.get(point.EMULATED_TAG) == "true",
                             lo.upper if lo.bounded else None, lo.bound.p_value if lo.bounded else None,
                             lo.bound.method, point.CONTENDED_TAG in r.data.tags,
                             (m[span[0]], m[span[1]]) if span and set(span) <= m.keys() else None,
                             lo.bound.upper_at if lo.bounded else None))
    return out


def _loss_text(p: Point, level: float | None = None) -> str:
    """The loss and its one-sided bound at ``level``, the error its test
    used (None: the 95 % bound)."""
    if p.loss_upper is None:
        return f"{p.loss:.3g} (no uncertainty logged: estimate only)"
    if level is None:
        return f"{p.loss:.3g} (95% one-sided upper bound {p.loss_upper:.3g}; {p.method})"
    return f"{p.loss:.3g} (one-sided upper bound {p.bound_at(level):.3g} at error {level:.3g}, the level its " \
           f"test used; {p.method})"


# what would separate schemes an engine's per-step overhead hides, by the points' target
SEPARATES = {"cpu": "target=llamacpp (llama.cpp's CPU kernels)",
             "cuda": "target=cuda target.compile=true target.compile_mode=reduce-overhead target.static_cache=512 "
                     "(CUDA graphs) or target=vllm target.device=cuda",
             "vllm": "a larger model, or target=llamacpp on a CPU", "llamacpp": "a larger model"}


def overhead_note(runs) -> str:
    """One line when the real, uncontended points' TPOT P50 does not follow
    their bytes (the least-squares slope of TPOT on ``bw/floor_ms``, the
    step's bytes at the measured peak, is under 0.5: less than half of a byte
    saving shows as time) and overhead (``bw/overhead_ms``) is most of every
    step: the latency column then measures the engine, not the schemes;
    names the target that would separate them. '' otherwise (fewer than two
    points, or all reading the same bytes)."""
    timed = [r for r in runs if tracking.done(r) and r.data.tags.get(point.EMULATED_TAG) != "true"
             and point.CONTENDED_TAG not in r.data.tags
             and {"lat/tpot_ms_p50", "bw/overhead_ms", "bw/floor_ms"} <= r.data.metrics.keys()]
    floor = [r.data.metrics["bw/floor_ms"] for r in timed]
    if len(timed) < 2 or max(floor) - min(floor) <= 1e-9:
        return ""
    tpot = [r.data.metrics["lat/tpot_ms_p50"] for r in timed]
    over = [r.data.metrics["bw/overhead_ms"] for r in timed]
    f0, t0 = sum(floor) / len(floor), sum(tpot) / len(tpot)
    slope = sum((f - f0) * (t - t0) for f, t in zip(floor, tpot)) / sum((f - f0) ** 2 for f in floor)
    if slope >= 0.5 or min(o / t for o, t in zip(over, tpot)) < 0.5:
        return ""
    targets = sorted({r.data.tags.get("target", "?") for r in timed})
    better = "; ".join(f"{t}: {SEPARATES[t]}" for t in targets if t in SEPARATES) or "another engine"
    return (f"Latency within overhead: TPOT P50 spans {min(tpot):.2f}-{max(tpot):.2f} ms "
            f"({max(tpot) / min(tpot):.2f}x) across {len(timed)} real points whose bytes alone would take "
            f"{min(floor):.2f}-{max(floor):.2f} ms (slope {slope:.2f} ms per ms of bytes), and each step spends "
            f"{min(over):.2f}-{max(over):.2f} ms beyond reading its bytes at the measured peak (`bw/overhead_ms`): "
            f"here the latency column measures the engine ({', '.join(targets)}), not the schemes' bytes; "
            f"{better} would separate them.")


def objective(runs, choice: str = "auto") -> str:
    """``auto``: ``capacity`` when a finished run measured it (a serving
    sweep), else ``tpot``; otherwise ``choice``, checked."""
    if choice == "auto":
        return "capacity" if any(tracking.done(r) and OBJECTIVES["capacity"][0] in r.data.metrics
                                 for r in runs) else "tpot"
    if choice not in OBJECTIVES:
        raise UserError(f"unknown objective {choice!r}; valid: auto, {', '.join(OBJECTIVES)}")
    return choice


def loss_half(runs, base, items: dict, said) -> dict[float, Recommendation]:
    """Per budget of decision ``said`` (a :class:`quantlab.config.DecisionConfig`),
    the points shown within it on its metric, by decode TPOT: what the
    re-timing takes its candidates from (:mod:`quantlab.retiming`)."""
    metric = decision_metric(runs, said.metric, base, items, said.budgets, said.halves()[0])
    pts = points(runs, metric, OBJECTIVES["tpot"][0], base, items)
    return {b: fastest_within(pts, b, alpha=said.halves()[0], budgets=said.budgets) for b in said.budgets}


@dataclasses.dataclass(frozen=True)
class LatencyHalf:
    """What "fastest" rests on: the re-timing (None: not re-timed, ``why``),
    its share of the error and the declared tie-break."""

    retimed: retime.Retimed | None = None
    alpha: float = 0.0
    tie_break: str = "latency"
    why: str = "decision.retime_rounds=0"


def with_latency(rec: Recommendation, latency: LatencyHalf,
                 figures: dict[str, float]) -> tuple[Recommendation, retime.Claim | None]:
    """The loss half's pick ``rec`` after the latency half: the re-timing's
    claim over its qualified points (:func:`quantlab.retime.claim`, ``figures``
    the tie-break's value by point name) and its pick put in with the margin
    at that point's own level; ``(rec, None)`` where nothing was re-timed or
    nothing qualified. The report and :func:`quantlab.api.fastest_within` both pick through it."""
    if latency.retimed is None or rec.point is None:
        return rec, None
    said = retime.claim([p.name for p in rec.qualified], latency.retimed, latency.alpha, latency.tie_break, figures)
    if said is not None and said.pick != rec.point.name:
        chosen = next(p for p in rec.qualified if p.name == said.pick)
        rec = dataclasses.replace(rec, point=chosen, margin=rec.budget - chosen.bound_at(rec.levels[chosen.name]),
                                  level=rec.levels[chosen.name])
    return rec, said


def decide(runs, metric: str, budgets=DEFAULT_BUDGETS, base=None, items: dict | None = None, by: str = "tpot",
           alpha: float = uncertainty.ALPHA, post_hoc: dict[float, str] | None = None,
           latency: LatencyHalf = LatencyHalf()) -> tuple[str, dict[float, Recommendation]]:
    """Markdown: the decision rule, frontiers and, per budget, the pick.
    The loss half: the real points shown within the budget by closed testing
    over every real point and budget at family-wise ``alpha``
    (:func:`quantlab.pareto.fastest_within`). The latency half (objective
    ``tpot``): the re-timed candidates' claim (:func:`quantlab.retime.claim`
    at ``latency.alpha``), else the least TPOT P50 by estimate, untested;
    objective ``capacity``: the highest capacity by estimate.
    ``post_hoc``: budget -> why its pick was not declared at launch (said
    beside it)."""
    post_hoc = post_hoc or {}
    key, sign, words, unit = OBJECTIVES[by]
    lat = points(runs, metric, "lat/tpot_ms_p50", base, items)
    # a point whose load met the SLOs at no rate (knee or its lower bound 0) has no capacity to offer
    ranked = [dataclasses.replace(p, cost=sign * p.cost) for p in points(runs, metric, key, base, items)
              if by != "capacity" or p.cost > 0]
    mem = points(runs, metric, "size/weight_mb", base, items)
    kl = (s := metric_names.spec(metric)) is not None and s.loss == "value"
    n_real = len([p for p in ranked if not p.emulated])
    against = "" if kl or metric.startswith("fid/") or base is None else f" against {base.info.run_name}"
    retimed = by == "tpot" and latency.retimed is not None
    untested = "not re-timed: " + latency.why if by == "tpot" else "a capacity is not re-timed"
    lines = [f"Decision rule: loss on `{metric}`{against} = "
             + ("the KL value" if kl else "1 - top-1 agreement" if metric == "fid/top1_agree" else
                "1 - point/baseline (perplexity: 1 - baseline/point)")
             + f"; a point meets a budget when \"loss >= budget\" is rejected by closed testing over the "
               f"{n_real} real points and the {len(budgets)} budget{'s' if len(budgets) > 1 else ''} together "
               f"(Holm's step-down rule at the smallest budget): family-wise error <= {alpha:.3g} over all of "
               f"them. Each point's bound is printed at the error its test used, so a pick's margin is never "
               f"negative (paired over the same items where both runs logged them, its unit and method beside "
               f"it; a loss with no bound, or fewer than {uncertainty.MIN_UNITS} units, never qualifies). Among "
               f"those, {words} wins"
             + (f": the qualified points re-timed side by side at the end of the sweep, each comparison at error "
                f"{latency.alpha:.3g} over all of them, the tie-break `{latency.tie_break}` among the ones the "
                f"re-timing cannot separate. The decision's error: {alpha:.3g} (loss) + {latency.alpha:.3g} "
                f"(latency) = {alpha + latency.alpha:.3g}, for the pick's loss and its latency claim together, "
                f"at every budget at once." if retimed else
                f" by the sweep's estimate, untested ({untested}): the decision's error {alpha:.3g} covers the loss "
                f"half only.")
             + f" `{NOT_SIGNIFICANT}` marks are per comparison (not corrected for multiplicity).", ""]
    lines.append("Frontier, loss vs decode latency: " + ", ".join(
        f"{p.name} ({p.cost:.2f} ms{CONTENDED if p.contended else ''}, {p.loss:.3g})"
        for p in frontier([p for p in lat if not p.emulated])))
    if note := overhead_note(runs):
        lines.append(note)
    lines.append("Frontier, loss vs weight memory: " + ", ".join(
        f"{p.name} ({p.cost:.1f} MiB, {p.loss:.3g})" for p in frontier(mem)))
    recs = {}
    sizes = {r.info.run_name: r.data.metrics.get(TIE_BREAKS.get(latency.tie_break, ""), float("inf")) for r in runs}
    for b in budgets:
        rec = fastest_within(ranked, b, alpha=alpha, budgets=budgets)
        what = (f"KL <= {b:g}" if kl else f"{b:.0%} loss") + (f" (post hoc: {post_hoc[b]})" if b in post_hoc else "")
        rec, said = with_latency(rec, latency if retimed else LatencyHalf(), sizes)
        recs[b] = rec
        if rec.point is None and not ranked and mem:
            lines.append(f"- Within {what}: nothing to rank: no point measured {key} (its probe was off), so "
                         f"none is picked; the losses above still stand.")
        elif rec.point is None:
            lines.append(f"- Within {what}: no real point qualifies.")
        else:
            best = ("Fastest" if said is None or not said.tied else "Pick") if by == "tpot" else "Most capacity"
            lines.append(f"- {best} within {what}: **{rec.point.name}** — {sign * rec.point.cost:.2f} {unit}, "
                         f"loss {_loss_text(rec.point, rec.level)} (margin {rec.margin:.3g}; {rec.candidates} "
                         f"qualified)")
        if said is not None:
            lines += retime.claim_lines(said, latency.tie_break)
            for p in rec.undecided:
                lines.append(_undecided_line(p, b, what, sign, unit, rec, n_real))
            continue
        if rec.contended:
            lines.append("  - cannot tell on " + ("latency" if by == "tpot" else "capacity") + ": "
                         + ", ".join(f"{p.name} ({sign * p.cost:.2f} {unit}{CONTENDED})" for p in rec.contended)
                         + " also qualified but were timed beside other work, which only makes a point look "
                         "worse; re-time them on idle cores (`force=true`, the points alone) before taking this "
                         "pick over them.")
        if rec.close:
            r = rec.point.cost_range
            lines.append("  - close on latency: " + ", ".join(
                f"{p.name} ({p.cost:.2f} {unit}, +{p.cost / rec.point.cost - 1:.1%}; requests "
                f"{p.cost_range[0]:.2f}-{p.cost_range[1]:.2f})" for p in rec.close)
                + f" also qualified, and their requests' TPOTs overlap the pick's ({r[0]:.2f}-{r[1]:.2f} {unit}): "
                "this timing does not order them, and a repeat of the sweep may pick either; more "
                "`probe.latency.repeats` would.")
        for p in rec.undecided:
            lines.append(_undecided_line(p, b, what, sign, unit, rec, n_real))
    if any(p.emulated for p in ranked):
        lines.append("- Emulated points are never recommended: their latency is not that of the scheme.")
    return "\n".join(lines), recs


# the tie-break's figure of a point, lower wins (decision.tie_break)
TIE_BREAKS = {"size": "size/weight_mb", "bits": "size/bits_per_weight"}


def _draws_text(tags: dict[str, str]) -> str:
    """Where the sweep's evaluation draws (windows, documents, keys) came
    from, and how to repeat them: '' for a sweep from before the seed was recorded."""
    if (seed := tags.get(point.EVAL_SEED_TAG)) is None:
        return ""
    source = tags.get(point.EVAL_SEED_FROM_TAG, "pinned")
    how = {"pinned": "pinned", "drawn": "drawn for this sweep, so another sweep is an independent look"}.get(
        source, f"kept from the unfinished sweep {source.removeprefix('resumed ')}")
    return f" Evaluation draws (windows, documents, keys): seed {seed}, {how}; eval_seed={seed} repeats them."


def _undecided_line(p: Point, b: float, what: str, sign: float, unit: str, rec: Recommendation, n: int) -> str:
    level = (rec.levels or {}).get(p.name, uncertainty.ALPHA)
    return (f"  - cannot tell: {p.name} is better ({sign * p.cost:.2f} {unit}) with loss {_loss_text(p, level)}; "
            f"the estimate is within {what}, but \"loss >= {b:g}\" has p = {p.p_at(b):.3g}, above the {level:.3g} "
            f"its test over the {n} points compared needs. More items (accuracy limit, perplexity windows, "
            f"fidelity tokens) would decide.")


def _tokens(n: str) -> int:
    """The inverse of :func:`quantlab.probes.kv_position.tokens_name`: ``1k`` -> 1024."""
    return int(n[:-1]) * 1024 if n.endswith("k") else int(n)


def _bucket_start(key: str) -> int:
    return _tokens(key.split("_")[-2])


def kv_position_series(runs) -> dict[str, list[tuple[float, float, float]]]:
    """Per point that ran the position probe: ``(bucket midpoint, KL, se)`` per bucket."""
    out = {}
    for r in runs:
        m = r.data.metrics
        if not tracking.done(r) or "kvpos/windows" not in m:
            continue
        out[r.info.run_name] = [((_tokens(k.split("_")[-2]) + _tokens(k.split("_")[-1])) / 2, m[k],
                                 m.get(k + "_stderr", 0.0))
                                for k in m if k.startswith("kvpos/kl_") and not k.endswith("_stderr")]
    return out


def kv_position_table(runs) -> str:
    """Markdown: each point's KV-cache KL by position bucket (± se over
    windows) and the first bucket whose bound passed the tolerance; '' when
    no point ran the position probe."""
    timed = [r for r in runs if tracking.done(r) and "kvpos/windows" in r.data.metrics]
    if not timed:
        return ""
    keys = sorted({k for r in timed for k in r.data.metrics if k.startswith("kvpos/kl_") and not k.endswith("_stderr")},
                  key=_bucket_start)
    head = ["point", *(k.removeprefix("kvpos/kl_").replace("_", "-") for k in keys), "first bucket over"]
    rows = [[r.info.run_name, *(f"{r.data.metrics[k]:.2e}±{r.data.metrics.get(k + '_stderr', float('nan')):.1e}"
                                if k in r.data.metrics else "-" for k in keys),
             r.data.tags.get("kvpos.first_over", "-")] for r in timed]
    lines = ["KV cache by position (KL against the uncached pass per bucket of positions, ± se over windows; "
             "the first bucket whose one-sided 95 % bound passes probe.kv_position.tolerance):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def passkey_table(runs) -> str:
    """Markdown: each point's passkey accuracy by prompt length with its
    95 % Wilson interval, the same engine's accuracy without a cache, and the
    key's NLL through the cache minus without it (± se over trials); ''
    when no point ran the passkey probe."""
    done = [r for r in runs if tracking.done(r) and "passkey/trials" in r.data.metrics]
    if not done:
        return ""
    keys = sorted({k for r in done for k in r.data.metrics
                   if k.startswith("passkey/acc_") and k.removeprefix("passkey/acc_").rstrip("k").isdigit()},
                  key=lambda k: _tokens(k.removeprefix("passkey/acc_")))
    head = ["point", *(f"{k.removeprefix('passkey/acc_')} tokens" for k in keys), "without cache",
            "key NLL cached - uncached"]

    def cell(m, k):
        return f"{m[k]:.2f} [{m[k + '_lower']:.2f}, {m[k + '_upper']:.2f}]" if k in m else "-"

    rows = [[r.info.run_name, *(cell(r.data.metrics, k) for k in keys),
             f"{r.data.metrics['passkey/acc_nocache']:.2f}" if "passkey/acc_nocache" in r.data.metrics else "-",
             f"{r.data.metrics['passkey/dnll']:+.3f}±{r.data.metrics.get('passkey/dnll_stderr', float('nan')):.3f}"
             if "passkey/dnll" in r.data.metrics else "-"] for r in done]
    lines = ["Passkey retrieval (greedy decoding finds the key, by prompt length over every depth, 95 % Wilson "
             "interval; the same engine without a cache; the key's NLL in nats through the cache minus without "
             "it, ± se over trials; acc/passkey is a decision metric: --metric acc/passkey):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def time_table(runs, reused: set[str] = frozenset()) -> str:
    """Wall seconds each point spent per stage (``time/<stage>_s``), stages in
    pipeline order, and the sweep's sum: where a sweep's time goes. Reused
    points show the time of the run that measured them, marked."""
    timed = [r for r in runs if f"{TIME_PREFIX}point_s" in r.data.metrics]
    if not timed:
        return ""
    order = ("model", "reference", "apply", "engine", "fidelity", "perplexity", "accuracy", "cache", "kv_position",
             "passkey", "latency", "load", "point")
    stages = [s for s in order if any(f"{TIME_PREFIX}{s}_s" in r.data.metrics for r in timed)]
    head = ["point", *("total" if s == "point" else s for s in stages)]
    rows = [[r.info.run_name + (" (reused)" if r.info.run_id in reused else ""),
             *(f"{r.data.metrics[k]:.1f}" if (k := f"{TIME_PREFIX}{s}_s") in r.data.metrics else "-"
               for s in stages)] for r in timed]
    fresh = [r for r in timed if r.info.run_id not in reused]
    rows.append(["sum (measured here)", *(f"{sum(r.data.metrics.get(f'{TIME_PREFIX}{s}_s', 0.0) for r in fresh):.1f}"
                                          for s in stages)])
    lines = ["Where the time went (wall seconds per stage; apply includes calibration):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def next_steps(runs, recs: dict[float, Recommendation], sweep: str, parent_id: str, out: Path,
               logged: bool) -> str:
    """Run ids, the export command of each recommendation, and where the
    report's files went."""
    lines = ["Runs: " + ", ".join(f"{r.info.run_name} {tracking.origin(r)}" for r in runs if tracking.done(r))]
    for b, rec in recs.items():
        if rec.point is not None:
            lines.append(f"- export the {b:g} pick: `python -m quantlab.export --sweep {sweep} --budget {b:g} "
                         f"--out exports/{sweep}-{b:g}`")
    where = f"Files: {', '.join(['report.md', *(('pareto.png', 'pareto.html') if recs else ())])} in {out}"
    lines.append(where + (f", and as artifacts of the parent run {parent_id}." if logged else "."))
    return "\n".join(lines)


def declared(tags: dict[str, str]) -> DecisionConfig | None:
    """The decision a sweep parent recorded at launch, or None (a sweep from
    before declarations). A sweep from before re-timing was declared has
    ``retime_rounds`` 0 and the tie-break ``latency``."""
    t = point.DECLARED_TAGS
    if not all(tags.get(t[k]) for k in ("metric", "budgets", "alpha")):
        return None
    return DecisionConfig(metric=tags[t["metric"]], budgets=[float(b) for b in tags[t["budgets"]].split(",")],
                          alpha=float(tags[t["alpha"]]), latency_share=float(tags.get(t["latency_share"], 0.5)),
                          retime_rounds=int(tags.get(t["retime_rounds"], 0)),
                          retime_points=int(tags.get(t["retime_points"], 4)),
                          tie_break=tags.get(t["tie_break"], "latency"))


def post_hoc(runs, said: DecisionConfig | None, metric: str, budgets, alpha: float, base=None,
             items: dict | None = None) -> dict[float, str]:
    """Budget -> why its decision was not the one declared at launch
    (another metric, a budget not declared, another alpha); empty where all
    of it was declared."""
    if said is None:
        return {b: "the sweep declared no decision at launch" for b in budgets}
    why = []
    if metric != decision_metric(runs, said.metric, base, items, said.budgets, said.halves()[0]):
        why.append(f"metric {metric}, declared {said.metric}")
    if alpha != said.alpha:
        why.append(f"alpha {alpha:g}, declared {said.alpha:g}")
    out = {}
    for b in budgets:
        reasons = why + ([] if b in said.budgets else
                         [f"budget not declared ({', '.join(f'{x:g}' for x in said.budgets)})"])
        if reasons:
            out[b] = "; ".join(reasons)
    return out


def measured_before(tracker: tracking.Tracker, reused, said: DecisionConfig | None) -> str:
    """Why this sweep's decision was declared after some of its points were
    measured: the reused points whose measuring sweep declared another
    metric, budgets or alpha (or none: measured alone, or before
    declarations); '' where there are none."""
    late, seen = [], {}
    for r in reused:
        parent = tracker.get(tracking.origin(r)).data.tags.get(point.PARENT_TAG)
        if parent not in seen:
            seen[parent] = declared(tracker.get(parent).data.tags) if parent else None
        first = seen[parent]
        if said is None or first is None or \
                (first.metric, list(first.budgets), first.alpha) != (said.metric, list(said.budgets), said.alpha):
            late.append(r.info.run_name)
    if not late:
        return ""
    return (f"declared after {', '.join(late)} {'was' if len(late) == 1 else 'were'} measured (reused from a sweep "
            f"that declared another decision, or none)")


def sweep_data(tracker: tracking.Tracker, parent_id: str):
    """``(runs, reused, parent_tags, baseline_run, items)`` of one sweep:
    its child runs (the runs it reused last, and also in ``reused``), the
    baseline (the one the sweep named, else :func:`baseline_run`) and each
    finished run's per-item scores (read from the run that measured it)."""
    runs, reused = tracker.sweep_runs(parent_id)
    runs += reused
    tags = tracker.get(parent_id).data.tags
    base = next((r for r in runs if r.info.run_name == tags.get(point.BASELINE_TAG)), None) or baseline_run(runs)
    items = {r.info.run_id: tracker.items(tracking.origin(r)) for r in runs if tracking.done(r)}
    return runs, reused, tags, base, items


def build(tracker: tracking.Tracker, parent_id: str, metric: str | None = None,
          budgets=None, out_dir: Path | None = None, log_to_run: bool = True,
          by: str = "auto", alpha: float | None = None) -> str:
    """Table + frontier + recommendations (by objective ``by``, see
    :func:`objective`) for one sweep; PNG/HTML plots in ``out_dir``; with
    ``log_to_run`` all of it goes to the parent run (tag ``recommended.by``)
    and the recommended child runs get a ``quantlab.recommended.<budget>`` tag.
    ``metric``, ``budgets``, ``alpha``: None takes what the sweep declared at
    launch (:func:`declared`; else auto, 1 % and 5 %, 0.05); a choice that
    differs is said "post hoc" beside its picks and in a parent tag per budget."""
    runs, reused, tags, base, items = sweep_data(tracker, parent_id)
    said = declared(tags)
    budgets = tuple(budgets or (said.budgets if said else DEFAULT_BUDGETS))
    alpha = alpha if alpha is not None else (said.alpha if said else uncertainty.ALPHA)
    split = dataclasses.replace(said or DecisionConfig(retime_rounds=0), alpha=alpha).halves()
    metric, passed_over = auto_metric(runs, metric or (said.metric if said else "auto"), base, items, budgets,
                                      split[0])
    late = post_hoc(runs, said, metric, budgets, alpha, base, items)
    if before := measured_before(tracker, reused, said):
        late = {b: "; ".join(filter(None, (late.get(b), before))) for b in budgets}
    by = objective(runs, by)
    latency = latency_half(tracker, parent_id, tags, said, split[1])
    if any(tracking.done(r) and metric in r.data.metrics for r in runs):
        text, recs = decide(runs, metric, budgets, base, items, by, split[0], late, latency)
    else:  # nothing to put on an accuracy axis (model=shape, probe=latency): no pick, no Pareto plot
        text, recs = (f"No point measured {metric}: a latency-only sweep (random weights or probe=latency), so no "
                      f"point is picked by loss and none is plotted against one."), {}
    text = (f"Declared at launch: {_declaration_text(said)}." if said else
            "Declared at launch: nothing (a sweep from before declarations: every pick is post hoc).") + \
        (f" The metric: {passed_over}." if passed_over else "") + \
        information_only(runs, metric, base, items, budgets, split[0]) + _draws_text(tags) + "\n\n" + text
    sweep = tags.get(point.SWEEP_TAG, "?")
    paired_text = paired_table(runs, base, items) if base is not None else ""
    times = time_table(runs, {r.info.run_id for r in reused})
    kv_positions = kv_position_table(runs)
    retrieval = passkey_table(runs)
    out = Path(out_dir or tempfile.mkdtemp(prefix="quantlab-report-"))
    out.mkdir(parents=True, exist_ok=True)
    if series := kv_position_series(runs):
        plots.kv_position_png(series, out / "kv_position.png", f"quantlab sweep {sweep}: KV cache error by position")
        kv_positions += "\n\n![KL by position](kv_position.png)"
    body = (f"# Sweep {sweep} ({parent_id})\n\n{table(runs, {r.info.run_id for r in reused}, base, items)}\n\n"
            + (paired_text + "\n\n" if paired_text else "") + f"{text}\n\n"
            + (kv_positions + "\n\n" if kv_positions else "") + (retrieval + "\n\n" if retrieval else "")
            + (times + "\n\n" if times else "") + next_steps(runs, recs, sweep, parent_id, out, log_to_run) + "\n")
    serving, serving_files = serving_report.section(tracker, runs, out, f"quantlab sweep {sweep}: load")
    if serving:
        body += "\n" + serving + "\n"
    by_size, size_files = scaling.section(runs, out)
    by_context, context_files = scaling.context_section(runs, out)
    for extra in (by_size, by_context):
        if extra:
            body += "\n" + extra + "\n"
    (out / "report.md").write_text(body)
    panels = {c: points(runs, metric, c, base, items) if recs else [] for c in ("lat/tpot_ms_p50", "size/weight_mb")}
    label = metric if (s := metric_names.spec(metric)) is not None and s.loss == "value" else \
        f"relative loss on {metric}"
    title = f"quantlab sweep {sweep}"
    if any(panels.values()):
        plots.png(panels, label, out / "pareto.png", title)
        plots.html(panels, label, out / "pareto.html", title)
    if log_to_run:
        parent = tracker.run(parent_id)
        for f in ("report.md", "pareto.png", "pareto.html", "kv_position.png", *serving_files, *size_files,
                  *context_files):
            if (out / f).is_file():
                parent.log_files(out / f)
        by_name = {r.info.run_name: r.info.run_id for r in runs}
        for p in panels["size/weight_mb"]:  # the loss as a metric: the UI's charts plot it against latency
            child = tracker.run(by_name[p.name])
            child.log_metrics({"decision/loss": p.loss, "decision/loss_upper": p.upper})
            child.set_tags({"decision.metric": metric})
        parent.set_tags({point.RECOMMENDED_BY_TAG: by})
        for b, rec in recs.items():
            if rec.point is not None:
                name_tag, id_tag = point.recommended_tags(b)
                tracker.run(by_name[rec.point.name]).set_tags({point.recommended_point_tag(b): "true"})
                parent.set_tags({name_tag: rec.point.name, id_tag: by_name[rec.point.name],
                                 point.post_hoc_tag(b): late.get(b, "no")})
    return body


def point_report(tracker: tracking.Tracker, run_id: str, out_dir: Path | None = None,
                 log_to_run: bool = True) -> str:
    """The report of a point run alone (``quantlab run`` without ``-m``): its
    row of the table and where its time went; no loss and no pick, since
    nothing was measured beside it. ``report.md`` in ``out_dir`` and, with
    ``log_to_run``, on the run."""
    run = tracker.get(run_id)
    times = time_table([run])
    body = (f"# Point {run.info.run_name} ({run_id})\n\n"
            "A point run alone: no other point to compare it with, so no loss and no pick. A sweep decides: "
            "`quantlab run -m scheme/weights=bf16,int8,...` or `quantlab run +sweep=NAME`.\n\n"
            f"{table([run])}\n\n" + (times + "\n\n" if times else ""))
    out = Path(out_dir or tempfile.mkdtemp(prefix="quantlab-report-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(body)
    if log_to_run:
        tracker.run(run_id).log_files(out / "report.md")
    return body + f"Files: report.md in {out}" + (f", and as an artifact of the run {run_id}." if log_to_run else ".")


def _declaration_text(said: DecisionConfig) -> str:
    text = f"metric {said.metric}, budgets {', '.join(f'{b:g}' for b in said.budgets)}, alpha {said.alpha:g}"
    if not said.retime_rounds:
        return text + ", no re-timing"
    return text + (f" ({1 - said.latency_share:.0%} to the loss half, {said.latency_share:.0%} to the latency "
                   f"half), {said.retime_rounds} re-timing rounds of at most {said.retime_points} points, "
                   f"tie-break {said.tie_break}")


def latency_half(tracker: tracking.Tracker, parent_id: str, tags: dict, said: DecisionConfig | None,
                  alpha: float) -> LatencyHalf:
    """The sweep's re-timing as its parent logged it (:mod:`quantlab.retiming`),
    with the latency half's share of the error; why none where none."""
    tie = said.tie_break if said else "latency"
    if said is None or not said.retime_rounds:
        return LatencyHalf(tie_break=tie, why="the sweep declared no re-timing (decision.retime_rounds=0)")
    path = tracker.download(parent_id, retime.ARTIFACT)
    if path is None:
        return LatencyHalf(tie_break=tie, why=tags.get(SKIPPED_TAG, "the sweep logged no re-timing"))
    return LatencyHalf(retime.Retimed.from_json(path.read_text()), alpha, tie)


if __name__ == "__main__":  # python -m quantlab.report: the command line is quantlab.report_cli
    from quantlab.report_cli import main

    raise SystemExit(main())
