"""What a point loses against the sweep's baseline, with a one-sided upper
confidence bound (:class:`quantlab.uncertainty.Bound`).

The decision metric's loss is relative and oriented so that 0 means nothing
lost: ``1 - point / baseline`` for accuracies (the baseline's accuracy taken
as known), ``1 - PPL(baseline) / PPL(point)`` for perplexities (both as
llm-compressor's recovery), ``1 - agreement`` for top-1 agreement with the
reference, and the value itself for KL divergence.

Bounds, each one-sided at ``uncertainty.LEVEL`` (see :mod:`quantlab.uncertainty`):
- both runs logged per-item values (``items.json``) on the same items:
  accuracies by Tango's score bound on the paired documents, perplexities by
  the t-interval on the window means of the paired per-token NLL differences,
  cluster-robust over the windows' articles where both runs logged them
  (``articles/<metric>``: the article is the unit, so the claim covers
  articles like these, not these windows), else the window the unit (fewer
  than ``uncertainty.MIN_UNITS`` units: no bound, "cannot tell");
- without them, where both runs logged standard errors: the unpaired normal
  bound (``"unpaired"``: wider than a paired one would be);
- KL and top-1 from the point's own fidelity statistics (window standard
  errors; top-1 by Wilson's score bound at the effective n, t on the
  windows; fewer than ``MIN_UNITS`` windows: no bound);
- else the estimate alone (``bounded`` false: p = 1, never a pick).
The baseline's own loss is exactly 0, and so is the fidelity loss of a point
whose log-probabilities equal the reference's on every position
(``fid/identical``: shown by its outputs, not assumed from its scheme).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from quantlab import sequential, uncertainty
from quantlab import metric_names
from quantlab.metric_names import ARTICLES, AUXILIARY, CLUSTERS, DOC_IDS, IDENTICAL
from quantlab.uncertainty import Bound, Paired, paired


@dataclass(frozen=True)
class Loss:
    value: float
    bound: Bound
    bounded: bool

    @property
    def upper(self) -> float:
        return self.bound.upper


def auxiliary(key: str) -> bool:
    """``key`` is logged beside a metric (its se, block or window count)."""
    return key.endswith(AUXILIARY)


def base_metric(metric: str) -> str:
    """``recovery/acc/x`` and ``acc/x`` name the same decision."""
    return metric.removeprefix(metric_names.RECOVERY)


def aligned(metric: str, items: dict, base_items: dict) -> tuple[list, list] | None:
    """``metric``'s per-item values of the point and of the baseline on the
    same items, in the point's order, or None when either run lacks them or
    they were not measured on the same items. Documents are paired by id (an
    adaptive point scored a prefix of its draw order); every document of the
    point must be among the baseline's."""
    a, b = items.get(metric), base_items.get(metric)
    if not a or not b:
        return None
    task = metric.partition("/")[2]
    ids, base_ids = items.get(f"{DOC_IDS}{task}"), base_items.get(f"{DOC_IDS}{task}")
    if task and ids != base_ids:
        by_id = dict(zip(base_ids or [], b))
        if not ids or not all(i in by_id for i in ids):
            return None
        b = [by_id[i] for i in ids]
    return (a, b) if len(a) == len(b) else None


def window_size(metric: str) -> int | None:
    """The window length a perplexity metric's name says (``..._w256_rand16`` -> 256)."""
    found = re.search(r"_w(\d+)(?:_|$)", metric)
    return int(found.group(1)) if found else None


def windows_of(metric: str, n_items: int) -> int:
    """How many windows ``n_items`` per-token values of a perplexity metric
    came from (``window - 1`` predicted tokens each); 0 where that does not divide."""
    w = window_size(metric)
    return n_items // (w - 1) if w and w > 1 and n_items % (w - 1) == 0 else 0


def compare(metric: str, items: dict, base_items: dict) -> Paired | None:
    """Paired ``point - baseline`` on ``metric``'s items (token NLL for
    perplexities, the window the unit; 0/1 for accuracies; see
    :func:`aligned`), or None."""
    pair = aligned(metric, items, base_items)
    if pair is None:
        return None
    spec = metric_names.spec(metric)
    if spec is None or spec.direction == "info" or not spec.items:
        return None
    tokens = spec.items == "tokens"
    return paired(*pair, binary=spec.direction == "higher", tokens=tokens,
                  windows=(windows_of(metric, len(pair[0])) or 1) if tokens else 0,
                  clusters=articles(metric, items, base_items) if tokens else None)


def articles(metric: str, items: dict, base_items: dict, first: int | None = None) -> list | None:
    """Each window's article (``articles/<metric>``), where both runs logged
    the same: the cluster a bound over "articles like these" resamples;
    None otherwise (the window is the unit). ``first``: of the first that
    many windows only, where both logged at least that many alike (an
    adaptive point logs a prefix of the baseline's draw)."""
    a, b = items.get(f"{ARTICLES}{metric}"), base_items.get(f"{ARTICLES}{metric}")
    if first is not None:
        a, b = (a[:first], b[:first]) if a and b and min(len(a), len(b)) >= first else (None, None)
    return a if a and a == b else None


def _unit_text(units: int, what: str) -> str:
    if units < uncertainty.MIN_UNITS:
        return f"{units} {what}, fewer than {uncertainty.MIN_UNITS}: cannot tell"
    return f"t on {units} {what}"


def _clamp(f):
    return lambda alpha: max(0.0, f(alpha))


def relative(ln_ratio: float) -> float:
    """1 - PPL(base) / PPL(point) from ln(PPL(point) / PPL(base)) (no overflow)."""
    return 1.0 - math.exp(min(-ln_ratio, 700.0))


def logged_stderr(metrics: dict, metric: str) -> float | None:
    """The standard error a run logged beside ``metric``, on the scale the
    loss uses: of ln PPL for perplexities (``<metric>_ln_stderr``), else of
    the value itself (``acc_stderr/<task>``, ``fid/kl_mean_stderr``)."""
    if metric_names.lower(metric) and metric_names.ranked(metric):
        return metrics.get(f"{metric}_ln_stderr")
    name, _, task = metric.partition("/")
    return metrics.get(f"{name}_stderr/{task}", metrics.get(f"{metric}_stderr"))


def loss(metric: str, metrics: dict, items: dict, base_metrics: dict, base_items: dict,
         is_base: bool = False) -> Loss | None:
    """The point's loss on ``metric`` against the baseline; None if
    unmeasured, or for a metric no probe declares a loss for (information
    only: :mod:`quantlab.metric_names`). ``is_base``: the point is the
    baseline (loss exactly 0, for metrics measured against it)."""
    metric = base_metric(metric)
    v, spec = metrics.get(metric), metric_names.spec(metric)
    if v is None or spec is None or spec.direction == "info":
        return None
    if metric.startswith(metric_names.ZERO_WHEN_IDENTICAL) and metrics.get(IDENTICAL) == 1.0:
        return Loss(0.0, uncertainty.exact(0.0, "identical log-probabilities to the reference"), True)
    if spec.loss != "relative":  # against the reference: the point's own statistics
        return _against_reference(metric, v, spec, metrics)
    if is_base:
        return Loss(0.0, uncertainty.exact(0.0, "the baseline"), True)
    b = base_metrics.get(metric)
    if b is None or b <= 0 or v <= 0:
        return None
    lower = spec.direction == "lower"
    if spec.items == "tokens" and (f"{metric}_adaptive_cap" in metrics or f"{metric}_adaptive_cap" in base_metrics):
        return _sequential(metric, metrics, items, base_metrics, base_items)
    if not lower and spec.items == "documents" and f"{metric}_adaptive_cap" in metrics:
        return _sequential_docs(metric, metrics, items, base_items, b)
    pair = compare(metric, items, base_items)
    if pair is not None and lower:  # mean per-item NLL difference = ln(PPL(point) / PPL(base))
        if spec.items == "tokens":
            clustered = articles(metric, items, base_items) is not None
            upper = uncertainty.unit_upper
            unit = _unit_text(pair.units, "articles, cluster-robust over their windows" if clustered else "windows")
        else:
            upper, unit = uncertainty.t_upper, f"t on {pair.units} documents"
        return Loss(max(0.0, relative(pair.diff)),
                    Bound(relative(pair.diff), _clamp(lambda a: relative(
                        upper(pair.diff, pair.stderr, pair.units, a))), f"paired {unit}"), True)
    if pair is not None and (groups := clusters(metric, items, base_items)) is not None:
        return _clustered(pair, aligned(metric, items, base_items), groups, b)
    if pair is not None:
        return Loss(max(0.0, -pair.diff / b), Bound(-pair.diff / b, _clamp(
            lambda a: uncertainty.tango_upper(pair.lost, pair.gained, pair.n, a) / b),
            f"paired Tango score on {pair.n} documents"), True)
    est = 1 - b / v if lower else 1 - v / b
    se_p, se_b = logged_stderr(metrics, metric), logged_stderr(base_metrics, metric)
    if se_p is None or se_b is None:
        return Loss(max(0.0, est), uncertainty.unbounded(max(0.0, est), "estimate only"), False)
    se = math.hypot(se_p, se_b)
    if lower:  # ln PPL difference, unpaired
        d = math.log(v / b)
        bound = _clamp(lambda a: relative(d + uncertainty.z(a) * se))
    else:
        bound = _clamp(lambda a: (b - v + uncertainty.z(a) * se) / b)
    return Loss(max(0.0, est), Bound(est, bound, "unpaired normal (no per-item values)"), True)


def clusters(metric: str, items: dict, base_items: dict) -> list | None:
    """Each item's cluster (``clusters/<task>``: items that share structure,
    such as the passkey trials of one length and depth), where both runs
    logged the same in the same order; None otherwise (items independent)."""
    task = metric.partition("/")[2]
    a, b = items.get(f"{CLUSTERS}{task}"), base_items.get(f"{CLUSTERS}{task}")
    same = items.get(f"{DOC_IDS}{task}") == base_items.get(f"{DOC_IDS}{task}")
    return a if a and a == b and same and len(a) == len(items.get(metric, ())) else None


def _clustered(pair: Paired, values: tuple[list, list], groups: list, base_acc: float) -> Loss:
    """The relative loss of a 0/1 metric whose items come in clusters:
    Tango's score bound at the effective number of items, ``n`` over the
    design effect (the cluster-robust variance of the paired differences
    over the plain one), kept between the number of clusters and ``n``;
    with no item differing the design effect cannot be estimated, so the
    clusters count (the items of one cluster may fail together). Fewer than
    ``uncertainty.MIN_UNITS`` clusters: no bound."""
    d = [x - y for x, y in zip(*values)]
    n, c = len(d), len(set(groups))
    if c < uncertainty.MIN_UNITS:
        return Loss(max(0.0, -pair.diff / base_acc), uncertainty.unbounded(
            -pair.diff / base_acc, f"{c} clusters of {n} items, fewer than {uncertainty.MIN_UNITS}: cannot tell"),
            True)
    se_c, se_i = uncertainty.cluster_stderr(d, groups)[0], uncertainty.mean_stderr(d)
    n_eff = float(c) if pair.lost + pair.gained == 0 or se_c == 0 else min(float(n), max(c, n * (se_i / se_c) ** 2))
    s = n_eff / n
    return Loss(max(0.0, -pair.diff / base_acc), Bound(-pair.diff / base_acc, _clamp(
        lambda a: uncertainty.tango_upper(pair.lost * s, pair.gained * s, n_eff, a) / base_acc),
        f"paired Tango score at effective n {n_eff:.0f} of {n} items in {c} clusters"), True)


def _windows(metric: str, spec, metrics: dict) -> int:
    """A metric's windows: ``<metric>_windows`` where the probe logs them,
    else the count its declaration names (``spec.windows``), else 1."""
    return int(metrics.get(f"{metric}_windows", metrics.get(spec.windows, 1)))


def _against_reference(metric: str, v: float, spec, metrics: dict) -> Loss:
    """The loss of a metric measured against the reference model: a
    divergence (``value``: the metric itself, bounded by t on the windows of
    its logged standard error) or an agreement (``complement``: 1 - it; an
    agreement over positions, ``spec.positions``, by Wilson's score bound,
    :func:`_agreement`)."""
    if spec.positions:
        return _agreement(metric, v, spec, metrics)
    kind = spec.loss
    lost = v if kind == "value" else max(0.0, 1 - v)
    se = metrics.get(f"{metric}_stderr")
    m = _windows(metric, spec, metrics)
    if se is None:
        return Loss(lost, uncertainty.unbounded(lost, "estimate only"), False)
    upper = lambda a: uncertainty.unit_upper(lost, se, m, a)  # noqa: E731
    return Loss(lost, Bound(lost, upper if kind == "value" else _clamp(upper), _unit_text(m, "windows")), True)


def _agreement(metric: str, agree: float, spec, metrics: dict) -> Loss:
    """1 - agreement (top-1 agreement with the reference: the share of
    positions, ``spec.positions`` counts them, whose greedy token agrees);
    bound: Wilson's score bound at the effective sample size
    (n over the design effect of the blocks), with a t quantile on the
    blocks' degrees of freedom, so zero disagreements never give a bound of 0.
    A t-interval on the block means was anti-conservative for this
    right-skewed proportion (7.3 % false qualification at n 1000, 5 % budget:
    a low block mean comes with a low block spread); the score bound measured
    4.4 % (``benchmarks/decision_calibration.py``)."""
    lost = max(0.0, 1 - agree)
    se, n = metrics.get(f"{metric}_stderr"), metrics.get(spec.positions)
    if se is None or not n:
        return Loss(lost, uncertainty.unbounded(lost, "estimate only"), False)
    m = int(metrics.get(spec.windows, 1))
    se_tok = metrics.get(f"{metric}_stderr_tokens", se)
    n_eff = n / max(1.0, (se / se_tok) ** 2) if se_tok > 0 else n
    bound = (lambda a: uncertainty.wilson_upper(lost, n_eff, a, m)) if m >= uncertainty.MIN_UNITS else \
        (lambda _a: 1.0)
    return Loss(lost, Bound(lost, bound, f"Wilson score at effective n {n_eff:.0f} of {int(n)} positions, "
                                         + _unit_text(m, "windows")), True)


def _sequential(metric: str, metrics: dict, items: dict, base_metrics: dict, base_items: dict) -> Loss | None:
    """The loss of a perplexity that one run scored adaptively (it could have
    stopped at any look): paired on the windows both runs scored, bounded by
    the anytime-valid confidence sequence over the looks of that design
    (:mod:`quantlab.sequential`), not by the fixed-design t bound, which a
    data-dependent stop would make too narrow; each look's bound
    cluster-robust over the windows' articles where both runs logged the
    same ones (the articles the unit, as the fixed design's), else t on
    windows."""
    a, b = items.get(metric), base_items.get(metric)
    design = metrics if f"{metric}_adaptive_cap" in metrics else base_metrics
    if not a or not b or not metrics.get(f"{metric}_windows"):
        return None
    per_window = round(len(a) / metrics[f"{metric}_windows"])
    cap, chunk = int(design[f"{metric}_adaptive_cap"]), int(design[f"{metric}_adaptive_chunk"])
    common = min(len(a), len(b)) // per_window
    looks = [n for n in sequential.schedule(cap, chunk, uncertainty.MIN_UNITS) if n <= common]
    if not looks:
        return None
    arts = articles(metric, items, base_items, common)
    pairs = {n: uncertainty.paired(a[:n * per_window], b[:n * per_window], windows=n,
                                   clusters=None if arts is None else arts[:n]) for n in looks}
    diff = pairs[looks[-1]].diff

    def look_upper(n: int, level: float) -> float:
        return uncertainty.unit_upper(pairs[n].diff, pairs[n].stderr, pairs[n].units, level)

    unit = f"cluster-robust over their {pairs[looks[-1]].units} articles" if arts is not None else "paired t on windows"
    return Loss(max(0.0, relative(diff)), Bound(
        relative(diff), _clamp(lambda al: relative(sequential.upper(al, looks, cap, look_upper, diff))),
        f"anytime-valid over {_looks_text(looks, 'windows', cap)}, {unit}"
        + _crossed(looks, cap, look_upper, diff)), True)


def _looks_text(looks: list[int], unit: str, cap: int) -> str:
    """The looks a bound is valid over, as the report prints them: ``2 looks
    (8, 12 windows; cap 16)``."""
    return f"{len(looks)} look{'s' if len(looks) > 1 else ''} ({', '.join(map(str, looks))} {unit}; cap {cap})"


def _crossed(looks, cap: int, look_upper, estimate: float) -> str:
    """A note where the looks' least bound fell below the final estimate at
    the report's level (:func:`quantlab.sequential.upper` then reports the estimate)."""
    alpha = uncertainty.ALPHA
    if sequential.upper(alpha, looks, cap, look_upper, -math.inf) < estimate:
        return "; an early look's bound fell below the final estimate: the estimate is the bound"
    return ""


def _sequential_docs(metric: str, metrics: dict, items: dict, base_items: dict, base_acc: float) -> Loss | None:
    """The relative loss of an accuracy whose documents the point scored
    adaptively (:mod:`quantlab.probes.accuracy_adaptive`): at each look of its
    design, the documents scored so far (a prefix of its draw order) paired
    by id with the baseline's, bounded by Tango's score bound at the look's
    share of the error, the running least bound over the looks
    (anytime-valid), divided by the baseline's accuracy (taken as known)."""
    pair = aligned(metric, items, base_items)
    if pair is None:
        return None
    a, b = pair
    cap, chunk = int(metrics[f"{metric}_adaptive_cap"]), int(metrics[f"{metric}_adaptive_chunk"])
    looks = [n for n in sequential.schedule(cap, chunk) if n <= len(a)]
    if not looks:
        return None

    pairs = {n: uncertainty.paired(a[:n], b[:n], binary=True) for n in looks}
    look_upper = lambda n, level: uncertainty.tango_upper(pairs[n].lost, pairs[n].gained, n, level)  # noqa: E731

    diff = (sum(b) - sum(a)) / len(a)
    return Loss(max(0.0, diff / base_acc), Bound(
        diff / base_acc, _clamp(lambda al: sequential.upper(al, looks, cap, look_upper, diff) / base_acc),
        f"anytime-valid over {_looks_text(looks, 'documents', cap)}, paired Tango score"
        + _crossed(looks, cap, look_upper, diff)), True)
