"""Frontier and recommendation on hand-made points."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from quantlab.pareto import Point, dominates, fastest_within, frontier

PTS = [
    Point("fp32", 60, 0.0), Point("bf16", 35, 0.001), Point("int8", 24, 0.004),
    Point("int4", 20, 0.28), Point("nf4", 28, 0.25),  # nf4 dominated by int4? no: int4 faster but worse
    Point("slow-bad", 70, 0.5),  # dominated by everything
    Point("fp8", 290, 0.017, emulated=True),
]


def test_frontier_excludes_dominated_points():
    names = [p.name for p in frontier(PTS)]
    assert names == ["int4", "int8", "bf16", "fp32"]  # nf4 (28, .25) is dominated by int8 (24, .004)
    assert "slow-bad" not in names and "fp8" not in names


def test_ties_stay_on_frontier():
    pts = [Point("a", 1, 1), Point("b", 1, 1), Point("c", 2, 2)]
    assert [p.name for p in frontier(pts)] == ["a", "b"]


def test_recommendation_moves_with_budget():
    assert fastest_within(PTS, 0.0).point.name == "fp32"
    assert fastest_within(PTS, 0.002).point.name == "bf16"
    r = fastest_within(PTS, 0.01)
    assert r.point.name == "int8" and math.isclose(r.margin, 0.006) and r.candidates == 3
    assert fastest_within(PTS, 1.0).point.name == "int4"
    assert fastest_within([Point("x", 1, 5)], 0.1).point is None


def test_emulated_points_not_recommended_unless_asked():
    pts = [Point("emu", 1, 0.0, emulated=True), Point("real", 5, 0.0)]
    assert fastest_within(pts, 0.1).point.name == "real"
    assert fastest_within(pts, 0.1, include_emulated=True).point.name == "emu"


coords = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=30)


@given(coords)
def test_frontier_properties(cs):
    pts = [Point(str(i), c, l) for i, (c, l) in enumerate(cs)]
    front = frontier(pts)
    assert front
    for p in front:  # nothing dominates a frontier point
        assert not any(dominates(q, p) for q in pts)
    for p in pts:  # every point off the frontier is dominated by one on it
        if p not in front:
            assert any(dominates(q, p) for q in front)
    # along the frontier, cost rises and loss falls
    assert all(a.cost <= b.cost and a.loss >= b.loss for a, b in zip(front, front[1:]))
