"""Standard errors, paired tests and upper confidence bounds for the figures a
decision rests on.

Conventions:
- the standard error of a mean is the sample standard deviation (``ddof=1``)
  over sqrt(n); for 0/1 outcomes that is lm-eval's ``acc_stderr``;
- **units**: the unit is what was drawn independently. lm-eval documents
  are independent units; tokens are not (a window's tokens share their
  context), and neither are blocks of one window or article (windows differ
  from each other: another article, another topic). So every token-level
  figure (perplexity, KL, top-1 agreement) is scored on ``W`` windows drawn
  at random and gets its standard error from the *window means*, the
  interval a t-interval on ``W - 1`` degrees of freedom; with fewer than
  ``MIN_UNITS`` units there is no bound at all ("cannot tell": an upper
  bound of infinity). Block means (:func:`block_stderr`, contiguous blocks
  of at most ``BLOCK`` tokens) remain for one sequence's own spread (the
  cache probe); the per-token figure is kept, labelled ``*_tokens``, as a
  secondary;
- two points evaluated on the same items are compared *paired*: the mean of
  the per-item differences, and for 0/1 outcomes the exact McNemar test on
  the discordant items (the ``~`` marks, two-sided, ``ALPHA`` per comparison);
- every upper bound on a loss is **one-sided at** ``LEVEL`` (95 %): paired
  0/1 items by Tango's score interval for a difference of paired proportions
  (Tango 1998, Stat Med 17:891; zero discordant items over n give about
  z^2 / n, never 0); token-level losses by the t-interval on block means,
  top-1 disagreement by Wilson's score bound at the effective sample size
  (t quantile on the windows); without per-item values, an unpaired normal bound from both
  runs' standard errors.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from scipy import special, stats

LEVEL = 0.95
ALPHA = 0.05
BLOCK = 128
MIN_BLOCKS = 4
MIN_UNITS = 8  # fewer independent units than this: no bound ("cannot tell")


def z(alpha: float) -> float:
    """The standard normal quantile a one-sided ``alpha`` bound uses."""
    return NormalDist().inv_cdf(1.0 - alpha)


def mean_stderr(x: Sequence[float] | np.ndarray) -> float:
    """Standard error of the mean; 0 for fewer than two items."""
    a = np.asarray(x, dtype=np.float64)
    return float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else 0.0


def block_count(n: int) -> int:
    """How many contiguous blocks ``n`` items are split into: blocks of at
    most ``BLOCK`` items, at least ``MIN_BLOCKS`` where there are that many."""
    return max(min(MIN_BLOCKS, n), math.ceil(n / BLOCK))


def block_means(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """Means of the :func:`block_count` contiguous blocks of ``x`` (order kept)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        return a
    return np.array([c.mean() for c in np.array_split(a, block_count(a.size))])


def block_stderr(x: Sequence[float] | np.ndarray) -> tuple[float, int]:
    """``(standard error of the mean from block means, number of blocks)``."""
    means = block_means(x)
    return mean_stderr(means), int(means.size)


def group_means(x: Sequence[float] | np.ndarray, groups: int) -> np.ndarray:
    """Means of ``x`` cut into ``groups`` equal consecutive parts (the windows
    a token-level figure was scored on, in the order they were scored)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if groups < 1 or a.size % groups:
        raise ValueError(f"{a.size} items do not split into {groups} equal windows")
    return a.reshape(groups, -1).mean(axis=1)


def unit_stderr(x: Sequence[float] | np.ndarray, groups: int) -> float:
    """Standard error of the mean of ``x`` from its :func:`group_means`."""
    return mean_stderr(group_means(x, groups))


def window_stderr(x: Sequence[float] | np.ndarray, windows: int,
                  clusters: Sequence | None = None) -> tuple[float, int]:
    """``(standard error of the mean, units)`` of per-token values ``x`` scored
    on ``windows`` equal windows: the windows the units, or, with
    ``clusters`` (each window's article), cluster-robust over them
    (:func:`cluster_stderr`), the clusters the units."""
    if clusters is not None:
        return cluster_stderr(group_means(x, windows), clusters)
    return unit_stderr(x, windows), windows


def cluster_stderr(x: Sequence[float] | np.ndarray, clusters: Sequence) -> tuple[float, int]:
    """``(standard error of the mean of the units x, number of clusters)``,
    cluster-robust by the jackknife over clusters (CR3: the spread of the
    mean with each cluster left out in turn, times (C - 1) / C): the units
    of one cluster (the windows of one article) may be alike, so the
    clusters are what a population of them was drawn as. CR1 (the summed
    residuals' sandwich) qualified a point at the budget 6.4 % of the time
    with ~35 articles of unequal size (``benchmarks/decision_calibration.py``);
    the jackknife is wider where one cluster sways the mean. One unit a
    cluster gives the plain standard error; 0 for a single cluster."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size != len(clusters):
        raise ValueError(f"{a.size} units but {len(clusters)} cluster labels")
    labels = {c: i for i, c in enumerate(dict.fromkeys(clusters))}
    if len(labels) < 2:
        return 0.0, len(labels)
    idx = np.array([labels[c] for c in clusters])
    sums, sizes = np.bincount(idx, weights=a, minlength=len(labels)), np.bincount(idx, minlength=len(labels))
    left_out = (a.sum() - sums) / (a.size - sizes)
    c = len(labels)
    return float(math.sqrt((c - 1) / c * float(((left_out - left_out.mean()) ** 2).sum()))), c


def unit_upper(mean: float, se: float, units: int, alpha: float) -> float:
    """One-sided ``1 - alpha`` upper bound of a mean over ``units`` randomly
    drawn units (t on ``units - 1`` df); infinite below ``MIN_UNITS`` units:
    so few cannot show how much the units differ."""
    if units < MIN_UNITS:
        return math.inf
    return t_upper(mean, se, units, alpha)


def quantile(alpha: float, units: int) -> float:
    """The one-sided ``1 - alpha`` quantile a bound from ``units`` independent
    units takes: Student's t on ``units - 1`` degrees of freedom, normal when
    ``units`` is 0 (unknown), infinite for one unit (no spread to estimate)."""
    if units <= 0:
        return z(alpha)
    # scipy.special's inverse t: the same number as stats.t.ppf, ~50x faster (p-values bisect on it)
    return math.inf if units < 2 else float(special.stdtrit(units - 1, 1.0 - alpha))


def t_upper(mean: float, se: float, units: int, alpha: float) -> float:
    """One-sided ``1 - alpha`` upper bound of a mean from ``units`` independent
    units (the :func:`quantile` of ``units``)."""
    return mean + quantile(alpha, units) * se if se > 0 else mean


def wilson_upper(p: float, n: float, alpha: float, units: int = 0) -> float:
    """One-sided ``1 - alpha`` Wilson score bound of a proportion ``p`` over
    ``n`` (effective) trials: the largest ``p0`` with ``(p - p0) /
    sqrt(p0 (1 - p0) / n)`` above the lower quantile. The variance is taken
    at ``p0``, not at ``p``, which is what keeps a right-skewed proportion
    from bounding itself low when it happens to be observed low. With
    ``units`` >= 2 the quantile is Student's t on ``units - 1`` degrees of
    freedom (``n`` was estimated from that many units); one unit: 1."""
    q = quantile(alpha, units)
    if n <= 0 or math.isinf(q):
        return 1.0
    k = q * q / n
    root = math.sqrt(max(k * p * (1.0 - p) + k * k / 4.0, 0.0))
    return min(1.0, (p + k / 2.0 + math.copysign(root, q)) / (1.0 + k))


def _tango_z(loss: float, lost: int, gained: int, n: int) -> float:
    """Tango's score statistic for H0: P(lost) - P(gained) = ``loss``."""
    w = -lost - gained + loss * (2 * n - lost + gained)
    q = (-w + math.sqrt(max(w * w + 8.0 * n * gained * loss * (1.0 - loss), 0.0))) / (4.0 * n)
    var = n * (2.0 * q + loss * (1.0 - loss))
    return (lost - gained - n * loss) / math.sqrt(var) if var > 0 else (math.inf if lost - gained > n * loss else
                                                                         -math.inf if lost - gained < n * loss
                                                                         else 0.0)


def tango_upper(lost: int, gained: int, n: int, alpha: float) -> float:
    """One-sided ``1 - alpha`` upper bound of P(lost) - P(gained) for paired
    0/1 items: ``lost`` items only the baseline got right, ``gained`` only the
    point (Tango's score interval, inverted by bisection)."""
    if n <= 0:
        return 1.0
    target = -z(alpha)
    lo, hi = max((lost - gained) / n, -1.0), 1.0
    if _tango_z(hi - 1e-12, lost, gained, n) >= target:
        return 1.0
    for _ in range(48):  # to ~1e-14
        mid = (lo + hi) / 2
        if _tango_z(mid, lost, gained, n) >= target:
            lo = mid
        else:
            hi = mid
    return hi


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for ``b`` items only the first point got
    right and ``c`` only the second got right (binomial test of b vs c at 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class Paired:
    """``point - baseline`` over the same items."""

    diff: float  # mean of the per-item differences
    stderr: float  # its standard error (block means for token items)
    n: int
    p_value: float  # McNemar for 0/1 items, t on the units otherwise
    units: int = 0  # independent units behind ``stderr`` (documents, or blocks of tokens)
    lost: int = 0  # 0/1 items: only the baseline right
    gained: int = 0  # 0/1 items: only the point right

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA


def paired(point: Sequence[float], base: Sequence[float], binary: bool = False, tokens: bool = False,
           windows: int = 0, clusters: Sequence | None = None) -> Paired:
    """Paired comparison of per-item values (same items, same order).
    ``windows``: the items are the tokens of that many equal windows, in
    order (standard error from the window means, the windows the units;
    with ``clusters``, each window's cluster, cluster-robust over them, the
    clusters the units: :func:`cluster_stderr`);
    ``tokens`` without ``windows``: consecutive tokens of one text (block
    means); otherwise each item is an independent unit (a document)."""
    a, b = np.asarray(point, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired comparison needs equal, non-empty item lists ({a.size} vs {b.size})")
    d = a - b
    if windows:
        se, units = window_stderr(d, windows, clusters)
    else:
        se, units = block_stderr(d) if tokens else (mean_stderr(d), int(d.size))
    if binary:
        gained, lost = int(((a > 0.5) & (b < 0.5)).sum()), int(((a < 0.5) & (b > 0.5)).sum())
        return Paired(float(d.mean()), se, int(a.size), mcnemar_p(gained, lost), units, lost, gained)
    if se == 0.0:
        p = 1.0 if d.mean() == 0.0 else 0.0
    elif units >= 2:
        p = float(2.0 * stats.t.sf(abs(d.mean() / se), units - 1))
    else:
        p = math.erfc(abs(d.mean() / se) / math.sqrt(2.0))
    return Paired(float(d.mean()), se, int(a.size), p, units)


@dataclass(frozen=True)
class Bound:
    """A loss estimate and its one-sided upper confidence bound at any level.

    ``upper_at(alpha)``: the ``1 - alpha`` upper bound (non-increasing in
    ``alpha``); ``method``: what it resamples and how, in words for the report.
    """

    value: float
    upper_at: Callable[[float], float]
    method: str

    @property
    def upper(self) -> float:
        return self.upper_at(1.0 - LEVEL)

    def p_value(self, budget: float) -> float:
        """The one-sided p-value of "loss >= ``budget``": the smallest alpha at
        which the bound is within ``budget`` (1 when it never is). Agrees with
        the printed bound by construction: ``p <= ALPHA`` exactly when
        ``upper <= budget`` (the bisection's last step cannot cross it)."""
        if self.upper_at(1.0 - 1e-12) > budget:
            return 1.0
        lo, hi = 1e-12, 1.0 - 1e-12  # upper_at(hi) <= budget
        if self.upper_at(lo) <= budget:
            return lo
        for _ in range(30):  # on log alpha: to a relative 1e-7, more than Holm's thresholds need
            mid = math.sqrt(lo * hi)
            if self.upper_at(mid) <= budget:
                hi = mid
            else:
                lo = mid
        within = self.upper_at(ALPHA) <= budget
        return min(hi, ALPHA) if within else max(hi, math.nextafter(ALPHA, 1.0))


def exact(value: float, method: str) -> Bound:
    """A loss known without sampling error (the baseline against itself)."""
    return Bound(value, lambda _alpha: value, method)


def unbounded(value: float, method: str) -> Bound:
    """An estimate with no bound (no standard error, no per-item values):
    its upper bound is infinite at every level, so its p-value is 1 and no
    budget is ever met on it, whoever asks."""
    return Bound(value, lambda _alpha: math.inf, method)


def holm(p_values: Sequence[float], alpha: float = 1.0 - LEVEL) -> list[bool]:
    """Holm's step-down rule: which hypotheses are rejected with the
    family-wise error rate at most ``alpha`` (any dependence)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    out = [False] * len(p_values)
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - rank):
            break
        out[i] = True
    return out
