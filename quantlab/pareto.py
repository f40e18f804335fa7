"""Pareto frontier and "the fastest point within an accuracy budget".

Points are ``(name, cost, loss)`` with both coordinates to be minimised:
cost is a latency or a memory figure, loss is KL divergence or a relative
accuracy loss (1 - recovery). ``loss_upper`` is the loss's one-sided 95 %
upper bound, ``upper_at(alpha)`` the bound at any level and
``p_value(budget)`` the p-value of "loss >= budget".

The loss half: the hypotheses "point i loses >= b", over every real point
and every budget b of the family, are tested by closed testing with
Bonferroni local tests (:func:`levels`): at the smallest budget that is
Holm's step-down rule, at a larger one a point is tested beside the others'
p-values at the smallest budget. The family-wise error over all points *and*
budgets together is at most ``alpha`` (one number, not one per budget). Each
point is tested at its own level: its bound printed at that level is within
the budget exactly when it qualifies, so a printed margin is never negative.
A point without a bound (an estimate only) has p = 1: never a pick.

The latency half ("fastest" among the qualified) is :mod:`quantlab.retime`'s.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quantlab.uncertainty import LEVEL


@dataclass(frozen=True)
class Point:
    name: str
    cost: float
    loss: float
    emulated: bool = False
    loss_upper: float | None = None  # None: no bound known (an estimate only): never qualifies
    p_value: Callable[[float], float] | None = None  # None: 0 when loss_upper is within the budget, else 1
    method: str = ""  # what the bound resamples, for the report
    contended: bool = False  # its cost was timed beside other work (inflated: a latency up, a capacity down)
    cost_range: tuple[float, float] | None = None  # least and greatest of its requests' costs (None: one request)
    upper_at: Callable[[float], float] | None = None  # its bound at any level (None: loss_upper, at LEVEL only)

    def p_at(self, budget: float) -> float:
        if self.p_value is not None:
            return self.p_value(budget)
        return 0.0 if self.loss_upper is not None and self.loss_upper <= budget else 1.0

    @property
    def upper(self) -> float:
        return self.loss if self.loss_upper is None else self.loss_upper

    def bound_at(self, alpha: float) -> float:
        """The one-sided ``1 - alpha`` upper bound on its loss (the 95 % one
        where no other level is known; the estimate where it has no bound)."""
        return self.upper_at(alpha) if self.upper_at is not None and self.loss_upper is not None else self.upper


def dominates(a: Point, b: Point) -> bool:
    """``a`` is no worse than ``b`` on both axes and strictly better on one."""
    return a.cost <= b.cost and a.loss <= b.loss and (a.cost < b.cost or a.loss < b.loss)


def frontier(points: list[Point]) -> list[Point]:
    """Non-dominated points, sorted by cost. Points with identical coordinates
    do not dominate each other, so ties all stay on the frontier."""
    front = [p for p in points if not any(dominates(q, p) for q in points)]
    return sorted(front, key=lambda p: (p.cost, p.loss, p.name))


@dataclass(frozen=True)
class Recommendation:
    point: Point | None
    budget: float
    margin: float  # budget - the chosen point's bound at its level (>= 0); nan when none qualifies
    candidates: int
    level: float = 1.0 - LEVEL  # the one-sided error at which the chosen point's bound was tested
    # faster points whose estimate is within the budget but whose bound is not:
    # the metric cannot tell whether they qualify
    undecided: tuple[Point, ...] = ()
    # qualified points that lost on a cost timed beside other work: contention only
    # inflates a cost, so the timing cannot tell whether they would have won
    contended: tuple[Point, ...] = ()
    # qualified points that lost on a cost whose requests' range overlaps the pick's:
    # the timing does not order them (a repeat of the sweep may pick either)
    close: tuple[Point, ...] = ()
    qualified: tuple[Point, ...] = ()  # every point shown within the budget, by cost
    levels: dict[str, float] | None = None  # point name -> the error level it was tested at


def levels(points: list[Point], budget: float, budgets=(), alpha: float = 1.0 - LEVEL) -> list[float]:
    """The error level each point's "loss >= ``budget``" is tested at, so
    that the family-wise error over every point and every budget of
    ``budgets`` (``budget`` among them) is at most ``alpha``. Closed testing
    of the hypotheses (point, budget) with Bonferroni local tests: an
    intersection that holds point j to budget b_j is rejected when some
    ``p_j(b_j) <= alpha / |points in it|``; the hardest intersection holding
    point i to ``budget`` adds the others at the smallest budget (their
    largest p-values), so i's level is ``alpha / (s + 1)`` for the largest s
    at which the s largest of those p-values all exceed ``alpha / (s + 1)``.
    With one budget this is Holm's step-down rule."""
    low = min((*budgets, budget))
    q = [p.p_at(low) for p in points]
    out = []
    for i in range(len(points)):
        others = sorted(q[:i] + q[i + 1:])
        worst = max((s for s in range(1, len(others) + 1) if others[len(others) - s] > alpha / (s + 1)), default=0)
        out.append(alpha / (worst + 1))
    return out


def fastest_within(points: list[Point], budget: float, include_emulated: bool = False,
                   alpha: float = 1.0 - LEVEL, budgets=()) -> Recommendation:
    """The lowest-cost point among those shown to lose less than ``budget``
    at the level :func:`levels` gives it (family-wise error at most
    ``alpha`` over the points and ``budgets``, whatever their dependence;
    no ``budgets``: this budget alone, Holm's rule). Emulated points are
    excluded by default: their latency is not that of the scheme.
    A contended winner stays the pick (its cost is if anything lower);
    contended losers are listed, since their true cost may beat it, and so
    are losers whose requests' costs overlap the pick's (``close``)."""
    real = [p for p in points if include_emulated or not p.emulated]
    at = levels(real, budget, budgets, alpha)
    passed = [p.bound_at(a) <= budget if p.upper_at is not None and p.loss_upper is not None
              else p.p_at(budget) <= a for p, a in zip(real, at)]  # the printed bound is the test
    level = {p.name: a for p, a in zip(real, at)}
    ok = [p for p, yes in zip(real, passed) if yes]
    best = min(ok, key=lambda p: (p.cost, p.upper, p.name)) if ok else None
    undecided = tuple(sorted((p for p, yes in zip(real, passed) if not yes and p.loss <= budget
                              and (best is None or p.cost < best.cost)), key=lambda p: (p.cost, p.name)))
    if best is None:
        return Recommendation(None, budget, float("nan"), 0, undecided=undecided, levels=level)
    contended = tuple(sorted((p for p in ok if p.contended and p is not best), key=lambda p: (p.cost, p.name)))
    close = tuple(sorted((p for p in ok if p is not best and not p.contended and overlap(p, best)),
                         key=lambda p: (p.cost, p.name)))
    return Recommendation(best, budget, budget - best.bound_at(level[best.name]), len(ok), level[best.name],
                          undecided, contended, close, tuple(sorted(ok, key=lambda p: (p.cost, p.name))), level)


def overlap(a: Point, b: Point) -> bool:
    """The two points' request cost ranges overlap (False when either has none)."""
    return a.cost_range is not None and b.cost_range is not None and \
        a.cost_range[0] <= b.cost_range[1] and b.cost_range[0] <= a.cost_range[1]
