"""Pareto frontier and "the fastest point within an accuracy budget".

Points are ``(name, cost, loss)`` with both coordinates to be minimised:
cost is a latency or a memory figure, loss is KL divergence or a relative
accuracy loss (1 - recovery). ``loss_upper`` is the loss's pessimistic (95 %)
bound; a budget is met only when that bound is within it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    name: str
    cost: float
    loss: float
    emulated: bool = False
    loss_upper: float | None = None  # None: no uncertainty known, the estimate is the bound

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


def fastest_within(points: list[Point], budget: float, include_emulated: bool = False) -> Recommendation:
    """The lowest-cost point whose pessimistic loss is at most ``budget``.
    Emulated points are excluded by default: their latency is not that of the scheme."""
    real = [p for p in points if include_emulated or not p.emulated]
    ok = [p for p in real if p.upper <= budget]
    best = min(ok, key=lambda p: (p.cost, p.upper, p.name)) if ok else None
    undecided = tuple(sorted((p for p in real if p.loss <= budget < p.upper
                              and (best is None or p.cost < best.cost)), key=lambda p: (p.cost, p.name)))
    if best is None:
        return Recommendation(None, budget, float("nan"), 0, undecided)
    return Recommendation(best, budget, budget - best.upper, len(ok), undecided)
