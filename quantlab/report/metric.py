"""Which metric decides a sweep and each point's loss on it: ``auto``
weighs the measured metrics by what their designs can decide, and the
ones that cannot are named information only."""
from __future__ import annotations

import math

from quantlab import decision, metric_names, point, uncertainty
from quantlab.metric_names import TOP1
from quantlab.pareto import Point


def weighed(runs) -> list[str]:
    """The measured metrics ``auto`` weighs, in its order, as the probes
    declare it (:attr:`quantlab.metric_names.MetricSpec.auto`): token-level
    perplexity, then accuracies (``acc_norm`` before ``acc``), then top-1
    agreement with the reference."""
    return metric_names.auto_order({k for r in runs for k in r.metrics if not decision.auxiliary(k)})


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
    order = weighed(runs) or [TOP1]
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
    weak = [(k, b) for k in weighed(runs) if k != metric and (b := best_case(k, base, items, alpha)) > max(budgets)]
    if not weak:
        return ""
    named = ", ".join(f"{k} ({'no bound' if math.isinf(b) else f'at {b:.3g}'})" for k, b in weak)
    return (f" Information only here, since a point identical to the baseline on every item would still be bounded "
            f"above the largest budget {max(budgets):g}: {named}.")


def best_case(metric: str, base, items: dict | None, alpha: float) -> float:
    """The bound at ``alpha`` of a point identical to the baseline ``base``
    on every item of ``metric`` (its loss exactly 0 as measured): the least
    any point of this design can be shown to lose."""
    m, own = base.metrics, (items or {}).get(base.id, {})
    lo = decision.loss(metric, m, own, m, own)
    return lo.bound.upper_at(alpha) if lo is not None and lo.bounded else math.inf


def run_loss(run, metric: str, base=None, items: dict | None = None) -> decision.Loss | None:
    """The finished ``run``'s loss on ``metric`` against the baseline run
    ``base`` (see :mod:`quantlab.decision`); None when it has none."""
    if not run.done:
        return None
    items = items or {}
    is_base = base is not None and run.id == base.id
    return decision.loss(metric, run.metrics, items.get(run.id, {}),
                         base.metrics if base is not None else {},
                         items.get(base.id, {}) if base is not None else {}, is_base)


# a cost's spread over the requests that timed it: the least and the greatest request's figure
RANGES = {metric_names.TPOT_P50: metric_names.TPOT_RANGE}


def points(runs, metric: str, cost: str, base=None, items: dict | None = None) -> list[Point]:
    """Finished runs with both a loss (see :func:`run_loss`) and ``cost``
    (and its request range, :data:`RANGES`, where logged)."""
    out, span = [], RANGES.get(cost)
    for r in runs:
        m = r.metrics
        if cost not in m:
            continue
        lo = run_loss(r, metric, base, items)
        if lo is not None:
            out.append(Point(r.name, m[cost], lo.value, r.tags.get(point.EMULATED_TAG) == "true",
                             lo.upper if lo.bounded else None, lo.bound.p_value if lo.bounded else None,
                             lo.bound.method, point.CONTENDED_TAG in r.tags,
                             (m[span[0]], m[span[1]]) if span and set(span) <= m.keys() else None,
                             lo.bound.upper_at if lo.bounded else None))
    return out
