"""The decision's text and picks: the declared decision read back, the loss
half (closed testing over points and budgets), the latency half (the
re-timing's claim, :mod:`quantlab.retime`), post hoc marks, and the
sentences that say what each pick rests on."""
from __future__ import annotations

import dataclasses

from quantlab import metric_names, point, retime, tracking, uncertainty
from quantlab.config import DecisionConfig
from quantlab.errors import UserError
from quantlab.metric_names import BW_FLOOR, BW_OVERHEAD, TOP1, TPOT_P50 as TPOT
from quantlab.pareto import Point, Recommendation, fastest_within, frontier
from quantlab.report.metric import decision_metric, points
from quantlab.report.table import CONTENDED, NOT_SIGNIFICANT


DEFAULT_BUDGETS = (0.01, 0.05)


SKIPPED_TAG = "retime.skipped"  # on a sweep parent: why nothing was re-timed (quantlab.retiming)


# What a budget's pick maximises: (metric, sign so that lower cost wins, words, unit).
OBJECTIVES = {"tpot": (metric_names.TPOT_P50, 1.0, "the lowest decode TPOT P50", "ms/token"),
              "capacity": (metric_names.CAPACITY_LOWER, -1.0, "the highest capacity under the SLOs (the lower bound "
                           "of the load probe's knee)", "req/s under the SLOs")}


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
    timed = [r for r in runs if r.done and r.tags.get(point.EMULATED_TAG) != "true"
             and point.CONTENDED_TAG not in r.tags
             and {TPOT, BW_OVERHEAD, BW_FLOOR} <= r.metrics.keys()]
    floor = [r.metrics[BW_FLOOR] for r in timed]
    if len(timed) < 2 or max(floor) - min(floor) <= 1e-9:
        return ""
    tpot = [r.metrics[TPOT] for r in timed]
    over = [r.metrics[BW_OVERHEAD] for r in timed]
    f0, t0 = sum(floor) / len(floor), sum(tpot) / len(tpot)
    slope = sum((f - f0) * (t - t0) for f, t in zip(floor, tpot)) / sum((f - f0) ** 2 for f in floor)
    if slope >= 0.5 or min(o / t for o, t in zip(over, tpot)) < 0.5:
        return ""
    targets = sorted({r.tags.get("target", "?") for r in timed})
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
        return "capacity" if any(r.done and OBJECTIVES["capacity"][0] in r.metrics
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
    instance_sd: float = 0.0  # each engine's allowed offset from its scheme's speed (decision.retime_instance_sd)


def with_latency(rec: Recommendation, latency: LatencyHalf,
                 figures: dict[str, float]) -> tuple[Recommendation, retime.Claim | None]:
    """The loss half's pick ``rec`` after the latency half: the re-timing's
    claim over its qualified points (:func:`quantlab.retime.claim`, ``figures``
    the tie-break's value by point name) and its pick put in with the margin
    at that point's own level; ``(rec, None)`` where nothing was re-timed or
    nothing qualified. The report and :func:`quantlab.api.fastest_within` both pick through it."""
    if latency.retimed is None or rec.point is None:
        return rec, None
    said = retime.claim([p.name for p in rec.qualified], latency.retimed, latency.alpha, latency.tie_break, figures,
                        latency.instance_sd)
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
    lat = points(runs, metric, TPOT, base, items)
    # a point whose load met the SLOs at no rate (knee or its lower bound 0) has no capacity to offer
    ranked = [dataclasses.replace(p, cost=sign * p.cost) for p in points(runs, metric, key, base, items)
              if by != "capacity" or p.cost > 0]
    mem = points(runs, metric, metric_names.WEIGHT_MB, base, items)
    kl = (s := metric_names.spec(metric)) is not None and s.loss == "value"
    n_real = len([p for p in ranked if not p.emulated])
    against = "" if s is None or s.loss != "relative" or base is None else f" against {base.name}"
    retimed = by == "tpot" and latency.retimed is not None
    untested = "not re-timed: " + latency.why if by == "tpot" else "a capacity is not re-timed"
    lines = [f"Decision rule: loss on `{metric}`{against} = "
             + ("the KL value" if kl else "1 - top-1 agreement" if metric == TOP1 else
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
    sizes = {r.name: r.metrics.get(TIE_BREAKS.get(latency.tie_break, ""), float("inf")) for r in runs}
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
TIE_BREAKS = {"size": metric_names.WEIGHT_MB, "bits": metric_names.BITS_PER_WEIGHT}


def draws_text(tags: dict[str, str]) -> str:
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


def declared(tags: dict[str, str]) -> DecisionConfig | None:
    """The decision a sweep parent recorded at launch, or None (a sweep from
    before declarations). A sweep from before re-timing was declared has
    ``retime_rounds`` 0 and the tie-break ``latency``; one from before the
    instance allowance was declared allows none."""
    t = point.DECLARED_TAGS
    if not all(tags.get(t[k]) for k in ("metric", "budgets", "alpha")):
        return None
    return DecisionConfig(metric=tags[t["metric"]], budgets=[float(b) for b in tags[t["budgets"]].split(",")],
                          alpha=float(tags[t["alpha"]]), latency_share=float(tags.get(t["latency_share"], 0.5)),
                          retime_rounds=int(tags.get(t["retime_rounds"], 0)),
                          retime_points=int(tags.get(t["retime_points"], 4)),
                          tie_break=tags.get(t["tie_break"], "latency"),
                          retime_instance_sd=float(tags.get(t["retime_instance_sd"], 0.0)))


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
        parent = (tracker.tags(r.origin) or {}).get(point.PARENT_TAG)
        if parent not in seen:
            seen[parent] = declared(tracker.tags(parent) or {}) if parent else None
        first = seen[parent]
        if said is None or first is None or \
                (first.metric, list(first.budgets), first.alpha) != (said.metric, list(said.budgets), said.alpha):
            late.append(r.name)
    if not late:
        return ""
    return (f"declared after {', '.join(late)} {'was' if len(late) == 1 else 'were'} measured (reused from a sweep "
            f"that declared another decision, or none)")


def declaration_text(said: DecisionConfig) -> str:
    text = f"metric {said.metric}, budgets {', '.join(f'{b:g}' for b in said.budgets)}, alpha {said.alpha:g}"
    if not said.retime_rounds:
        return text + ", no re-timing"
    return text + (f" ({1 - said.latency_share:.0%} to the loss half, {said.latency_share:.0%} to the latency "
                   f"half), {said.retime_rounds} re-timing rounds of at most {said.retime_points} points, "
                   f"tie-break {said.tie_break}"
                   + (f", engine-instance sd {said.retime_instance_sd:.1%}" if said.retime_instance_sd else ""))


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
    return LatencyHalf(retime.Retimed.from_json(path.read_text()), alpha, tie, instance_sd=said.retime_instance_sd)


def _loss_text(p: Point, level: float | None = None) -> str:
    """The loss and its one-sided bound at ``level``, the error its test
    used (None: the 95 % bound)."""
    if p.loss_upper is None:
        return f"{p.loss:.3g} (no uncertainty logged: estimate only)"
    if level is None:
        return f"{p.loss:.3g} (95% one-sided upper bound {p.loss_upper:.3g}; {p.method})"
    return f"{p.loss:.3g} (one-sided upper bound {p.bound_at(level):.3g} at error {level:.3g}, the level its " \
           f"test used; {p.method})"
