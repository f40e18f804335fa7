"""Pareto frontier and "the fastest point within an accuracy budget".

Points are ``(name, cost, loss)`` with both coordinates to be minimised:
cost is a latency or a memory figure, loss is KL divergence or a relative
accuracy loss (1 - recovery).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    name: str
    cost: float
    loss: float
    emulated: bool = False


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
    margin: float  # budget - loss of the chosen point (>= 0); nan when none qualifies
    candidates: int


def fastest_within(points: list[Point], budget: float, include_emulated: bool = False) -> Recommendation:
    """The lowest-cost point whose loss is at most ``budget``. Emulated points
    are excluded by default: their latency is not that of the scheme."""
    ok = [p for p in points if p.loss <= budget and (include_emulated or not p.emulated)]
    if not ok:
        return Recommendation(None, budget, float("nan"), 0)
    best = min(ok, key=lambda p: (p.cost, p.loss, p.name))
    return Recommendation(best, budget, budget - best.loss, len(ok))
