"""Pareto frontier and "the fastest point within an accuracy budget".

Points are ``(name, cost, loss)`` with both coordinates to be minimised:
cost is a latency or a memory figure, loss is KL divergence or a relative
accuracy loss (1 - recovery). ``loss_upper`` is the loss's one-sided 95 %
upper bound and ``p_value(budget)`` the p-value of "loss >= budget"; a budget
is met by the points whose hypotheses Holm's step-down rule rejects across
every real point compared at that budget (family-wise error <= 5 % per
budget). A point without a bound (an estimate only) has p = 1: never a pick.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quantlab.uncertainty import LEVEL, holm


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

    def p_at(self, budget: float) -> float:
        if self.p_value is not None:
            return self.p_value(budget)
        return 0.0 if self.loss_upper is not None and self.loss_upper <= budget else 1.0

    @property
    def upper(self) -> float:
        return self.loss if self.loss_upper is None else self.loss_upper


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
    margin: float  # budget - pessimistic loss of the chosen point (>= 0); nan when none qualifies
    candidates: int
    # faster points whose estimate is within the budget but whose bound is not:
    # the metric cannot tell whether they qualify
    undecided: tuple[Point, ...] = ()
    # qualified points that lost on a cost timed beside other work: contention only
    # inflates a cost, so the timing cannot tell whether they would have won
    contended: tuple[Point, ...] = ()
    # qualified points that lost on a cost whose requests' range overlaps the pick's:
    # the timing does not order them (a repeat of the sweep may pick either)
    close: tuple[Point, ...] = ()


def fastest_within(points: list[Point], budget: float, include_emulated: bool = False,
                   alpha: float = 1.0 - LEVEL) -> Recommendation:
    """The lowest-cost point among those shown to lose less than ``budget``:
    Holm's rule over the p-values of "loss >= budget" of every compared point
    (family-wise error at most ``alpha``, whatever their dependence). Emulated
    points are excluded by default: their latency is not that of the scheme.
    A contended winner stays the pick (its cost is if anything lower);
    contended losers are listed, since their true cost may beat it, and so
    are losers whose requests' costs overlap the pick's (``close``)."""
    real = [p for p in points if include_emulated or not p.emulated]
    passed = holm([p.p_at(budget) for p in real], alpha)
    ok = [p for p, yes in zip(real, passed) if yes]
    best = min(ok, key=lambda p: (p.cost, p.upper, p.name)) if ok else None
    undecided = tuple(sorted((p for p, yes in zip(real, passed) if not yes and p.loss <= budget
                              and (best is None or p.cost < best.cost)), key=lambda p: (p.cost, p.name)))
    if best is None:
        return Recommendation(None, budget, float("nan"), 0, undecided)
    contended = tuple(sorted((p for p in ok if p.contended and p is not best), key=lambda p: (p.cost, p.name)))
    close = tuple(sorted((p for p in ok if p is not best and not p.contended and overlap(p, best)),
                         key=lambda p: (p.cost, p.name)))
    return Recommendation(best, budget, budget - best.upper, len(ok), undecided, contended, close)


def overlap(a: Point, b: Point) -> bool:
    """The two points' request cost ranges overlap (False when either has none)."""
    return a.cost_range is not None and b.cost_range is not None and \
        a.cost_range[0] <= b.cost_range[1] and b.cost_range[0] <= a.cost_range[1]
