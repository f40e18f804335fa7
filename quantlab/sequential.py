"""Evaluation that stops when the decision is made: a confidence sequence on
a point's loss, built from looks at a growing prefix of its items.

The design (:func:`schedule`): items are scored in looks of ``chunk`` units
(perplexity windows) up to a ``cap`` (the fixed design's count). Look ``k``
sees the first ``n_k`` units, information fraction ``t_k = n_k / cap``.

The error is spent by Lan and DeMets' Pocock-type spending function
(Lan & DeMets 1983, Biometrika 70:659):
``A(t) = alpha ln(1 + (e - 1) t)``, ``A(1) = alpha``: it spends early, which
is what a rule that wants to stop early needs (the O'Brien-Fleming type
spends ~3e-8 of 0.05 at an eighth of the items, so no early look could
decide). Look ``k``'s bound is taken at level
``A(t_k) - A(t_{k-1})``, and the looks are joined by the union bound
(Bonferroni across looks), not by the exact multivariate-normal boundaries of
a group-sequential test: conservative, but valid whatever the dependence
between looks and whatever rule chose when to stop. So the running minimum
of the looks' upper bounds is an **anytime-valid** upper bound at level
``1 - alpha``: P(any look's bound falls below the true loss) <= sum of the
levels = ``alpha``. The same holds for the running maximum of lower bounds.

:func:`decided` is the stopping rule: a point stops when, for every budget,
the running upper bound is within it (inside) or the running lower bound is
above it (outside); else at the cap.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from quantlab import uncertainty


def schedule(cap: int, chunk: int, first: int = 1) -> list[int]:
    """Units seen at each look: ``chunk, 2 chunk, ..., cap`` (the last look at
    the cap), none before ``first`` units (a look with fewer units than a
    bound needs would spend error and decide nothing)."""
    if cap < 1 or chunk < 1:
        raise ValueError(f"a schedule needs cap >= 1 and chunk >= 1 (got cap {cap}, chunk {chunk})")
    start = min(first, cap)
    return sorted({max(min(k * chunk, cap), start) for k in range(1, math.ceil(cap / chunk) + 1)})


def spent(alpha: float, t: float) -> float:
    """The Pocock-type spending function: error spent by information
    fraction ``t`` of a one-sided ``alpha`` (0 at t = 0, ``alpha`` at t = 1)."""
    return alpha * math.log(1.0 + (math.e - 1.0) * min(max(t, 0.0), 1.0))


def levels(alpha: float, looks: Sequence[int], cap: int) -> list[float]:
    """Each look's share of ``alpha``: the spending function's increments
    (they add up to ``alpha`` when the last look is at the cap)."""
    out, before = [], 0.0
    for n in looks:
        now = spent(alpha, n / cap)
        out.append(max(now - before, 1e-300))
        before = now
    return out


def upper(alpha: float, looks: Sequence[int], cap: int, look_upper: Callable[[int, float], float],
          estimate: float = -math.inf) -> float:
    """The anytime-valid ``1 - alpha`` upper bound after ``looks``:
    ``max(min_k look_upper(n_k, level_k), estimate)`` (``estimate``: the last
    look's). Where the least bound falls below the estimate the looks
    disagree (an early prefix said more than the whole does): the estimate
    is the bound then. Valid (it fails only when some look's bound does),
    monotone in ``alpha``, never below the estimate."""
    bounds = [look_upper(n, a) for n, a in zip(looks, levels(alpha, looks, cap))]
    return max(min(bounds), estimate)


def effective(run_lower: float, run_upper: float, estimate: float) -> tuple[float, float]:
    """The bounds a stopping rule decides on after a look: the running ones
    (``run_lower``: the greatest lower bound so far, ``run_upper``: the least
    upper), each held on the far side of the look's ``estimate`` (see
    :func:`upper`): the same rule the report bounds by."""
    return min(run_lower, estimate), max(run_upper, estimate)


def decided(lower: float, upper_: float, budgets: Sequence[float]) -> bool:
    """Every budget decided: the loss is surely within it (``upper_ <= b``) or surely above it (``lower > b``)."""
    return all(upper_ <= b or lower > b for b in budgets)


def mean_bounds(diffs: np.ndarray, windows: int, alpha: float,
                clusters: Sequence | None = None) -> tuple[float, float]:
    """One-sided ``1 - alpha`` lower and upper bounds of the mean of per-token
    differences over ``windows`` equal windows (a t-interval on the window
    means, see :mod:`quantlab.uncertainty`; unbounded below ``MIN_UNITS``);
    with ``clusters`` (each window's article), cluster-robust over them, the
    articles the units."""
    mean = float(np.mean(diffs))
    se, units = uncertainty.window_stderr(diffs, windows, clusters)
    hi = uncertainty.unit_upper(mean, se, units, alpha)
    return 2 * mean - hi, hi
