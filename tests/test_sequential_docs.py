"""Adaptive lm-eval documents: the stopping rule on paired 0/1 scores, the
report's anytime-valid bound over the point's looks (paired by document id),
and its false-qualification rate under the probe's own stopping rule."""
from __future__ import annotations

import math

import numpy as np
import pytest

from quantlab import decision
from quantlab.probes import accuracy, accuracy_adaptive

TASK = "arc_easy_local"
METRIC = f"acc/{TASK}"


def _docs(rng, n: int, ref_acc: float, loss: float):
    """Reference and point 0/1 scores over ``n`` documents: the point loses
    ``loss`` (relative) of the reference's right answers, with as many
    discordant documents again going each way (noise that cancels)."""
    ref = (rng.random(n) < ref_acc).astype(float)
    point = ref.copy()
    right, wrong = np.flatnonzero(ref == 1), np.flatnonzero(ref == 0)
    flip = rng.random(n)
    point[right[flip[right] < loss + 0.05]] = 0  # lost: loss + 5 % of right answers
    point[wrong[flip[wrong] < 0.05 * ref_acc / (1 - ref_acc)]] = 1  # gained: as many as the 5 % noise
    return ref, point


def _run(ref, point, chunk: int, budgets, alpha: float, score_all: bool = False):
    order = list(range(len(ref)))
    reference = {TASK: {"acc": {d: float(ref[d]) for d in order}}}
    calls = []

    def run_docs(want):
        calls.append(sum(len(d) for d in want.values()))
        return {t: {"acc": {d: float(point[d]) for d in docs}} for t, docs in want.items()}

    stops = accuracy_adaptive.evaluate(run_docs, {TASK: order}, reference, chunk, budgets, alpha, score_all)
    return stops[TASK], calls


def _loss(stop, ref, cap: int, chunk: int):
    items = accuracy_adaptive.as_items({TASK: stop})
    base_items = {METRIC: list(ref), f"doc_ids/{TASK}": [float(d) for d in range(len(ref))]}
    metrics = {METRIC: float(np.mean(items[METRIC])), f"{METRIC}_adaptive_cap": float(cap),
               f"{METRIC}_adaptive_chunk": float(chunk)}
    return decision.loss(METRIC, metrics, items, {METRIC: float(np.mean(ref))}, base_items)


def test_a_clear_point_stops_early_a_broken_one_too_and_an_edge_one_reaches_the_cap():
    rng = np.random.default_rng(0)
    ref, same = _docs(rng, 2000, 0.6, 0.0)
    same = ref.copy()  # the reference's twin: nothing discordant
    stop, calls = _run(ref, same, 200, [0.05], 0.005)
    assert stop.reason.startswith("decided at") and len(stop.docs) < 2000 and sum(calls) == len(stop.docs)
    _, broken = _docs(rng, 2000, 0.6, 0.3)
    stop, _ = _run(ref, broken, 200, [0.05], 0.005)
    assert stop.reason.startswith("decided at") and len(stop.docs) <= 400
    _, edge = _docs(rng, 2000, 0.6, 0.05)
    stop, _ = _run(ref, edge, 200, [0.05], 0.005)
    assert stop.reason == "cap of 2000 documents reached" and len(stop.docs) == 2000
    stop, _ = _run(ref, same, 200, [0.05], 0.005, score_all=True)
    assert stop.reason.startswith("baseline candidate") and len(stop.docs) == 2000


def test_the_report_bounds_an_adaptive_point_over_its_looks_paired_by_document():
    """Its bound is wider than the fixed design's on the same documents, its
    method says so, and documents are paired by id whatever their order."""
    rng = np.random.default_rng(1)
    ref, point = _docs(rng, 400, 0.6, 0.02)
    stop, _ = _run(ref, point, 50, [0.05], 0.005, score_all=True)
    seq = _loss(stop, ref, 400, 50)
    order = rng.permutation(400)  # the baseline's documents in another order
    fixed = decision.loss(METRIC, {METRIC: float(point.mean())},
                          {METRIC: list(point), f"doc_ids/{TASK}": [float(d) for d in range(400)]},
                          {METRIC: float(ref.mean())},
                          {METRIC: list(ref[order]), f"doc_ids/{TASK}": [float(d) for d in order]})
    assert fixed.value == pytest.approx(seq.value) and seq.upper > fixed.upper > seq.value
    assert seq.bound.method.startswith(
        "anytime-valid over 8 looks (50, 100, 150, 200, 250, 300, 350, 400 documents; cap 400), paired Tango")
    assert fixed.bound.method.startswith("paired Tango score on 400 documents")


@pytest.mark.parametrize("n", [200, 1000])
def test_false_qualification_under_the_stopping_rule_is_at_most_alpha(n):
    """A point whose true relative loss is exactly the budget (5 %), stopped
    by the probe's own rule at a generous alpha (0.05), then bounded by the
    report: qualifies in at most 5 % of trials (+ 2 se), stops included."""
    rng = np.random.default_rng(7)
    trials, qualified, early, chunk = 300, 0, 0, n // 8
    for _ in range(trials):
        ref, point = _docs(rng, n, 0.6, 0.05)
        stop, _ = _run(ref, point, chunk, [0.05], 0.05)
        qualified += _loss(stop, ref, n, chunk).upper <= 0.05
        early += len(stop.docs) < n
    assert qualified / trials <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)
    assert early > 0  # the rule did stop early in some trials


def test_documents_come_in_draw_order_and_unsupported_tasks_are_refused():
    order = accuracy.sample_order(500, 50, 3, TASK)
    assert sorted(order) == accuracy.sample_indices(500, 50, 3, TASK) and order != sorted(order)
    assert sorted(accuracy.sample_order(20, None, 3, TASK)) == list(range(20))
    from quantlab.config_check import validate
    from quantlab.probes.configs import AccuracyProbeConfig

    with pytest.raises(ValueError, match=r"lambada_openai_local cannot be scored adaptively .* adaptive tasks: "):
        validate(AccuracyProbeConfig(adaptive=True, tasks=["arc_easy_local", "lambada_openai_local"]),
                 "probe.accuracy.")
    with pytest.raises(ValueError, match="adaptive_alpha=2.0"):
        validate(AccuracyProbeConfig(adaptive_alpha=2.0), "probe.accuracy.")


def test_an_early_prefix_that_says_more_than_the_whole_does_not_set_the_bound():
    """SmolLM2's int4-g64 on ARC-Easy (acc_norm, 200 documents): its first 50
    documents in draw order gained 7 and lost none against fp32, the other 150
    lost 21 and gained 8. The least bound over the looks (at 50: below 0)
    would sit under the final estimate (a loss of 0.06): the last look's bound
    is reported, and the method says so."""
    ref = np.array([0.0] * 7 + [1.0] * 43 + [1.0] * 21 + [0.0] * 8 + [1.0] * 40 + [0.0] * 81)
    point = np.array([1.0] * 7 + [1.0] * 43 + [0.0] * 21 + [1.0] * 8 + [1.0] * 40 + [0.0] * 81)
    stop, _ = _run(ref, point, 25, [0.05], 0.005, score_all=True)
    lo = _loss(stop, ref, 200, 25)
    assert lo.value > 0.05 and lo.upper == lo.value
    assert "an early look's bound fell below the final estimate: the estimate is the bound" in lo.bound.method
