"""Adaptive perplexity: the spending schedule, the stopping rule, and the
report's anytime-valid bound, whose false-qualification rate under the very
stopping rule the probe applies stays at the stated level."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantlab import decision, sequential
from quantlab.probes import perplexity

METRIC = "ppl_token_wikitext2_w256_first8"


@given(cap=st.integers(1, 200), chunk=st.integers(1, 50), alpha=st.floats(1e-4, 0.5))
@settings(max_examples=60, deadline=None)
def test_the_looks_spend_exactly_alpha_by_the_cap(cap, chunk, alpha):
    looks = sequential.schedule(cap, chunk)
    assert looks[-1] == cap and looks == sorted(set(looks)) and all(0 < n <= cap for n in looks)
    lv = sequential.levels(alpha, looks, cap)
    assert sum(lv) == pytest.approx(alpha, rel=1e-9) and all(a > 0 for a in lv)
    assert sequential.spent(alpha, 0) == 0 and sequential.spent(alpha, 1) == pytest.approx(alpha)


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError, match="cap >= 1 and chunk >= 1"):
        sequential.schedule(0, 1)


class WindowEngine:
    """An engine whose NLLs are given: window ``i`` is the row ``[i, i, ...]``."""

    def __init__(self, nll: np.ndarray):
        self.nll, self.scored = nll, 0

    def token_logprobs(self, ids):
        self.scored += len(ids)
        return (torch.from_numpy(-self.nll[ids[:, 0].numpy()]),)


def _windows(n: int, window: int = 256) -> torch.Tensor:
    return torch.arange(n)[:, None].expand(n, window).clone()


def _trial(rng, delta: float, sigma: float = 0.4, cap: int = 16, budgets=(0.05,), alpha=0.05, score_all=False):
    """One point against a reference: per-token NLL differences ``delta`` plus
    AR(1) noise (rho 0.3: neighbouring tokens are correlated, which the
    window means absorb), windows independent."""
    ref = rng.uniform(2.0, 4.0, size=(cap, 255))
    e = rng.normal(0.0, sigma, size=ref.shape)
    for i in range(1, ref.shape[1]):
        e[:, i] = 0.3 * e[:, i - 1] + math.sqrt(1 - 0.09) * e[:, i]
    point = ref + delta + e
    eng = WindowEngine(point)
    stopped = perplexity.adaptive_nll(eng, _windows(cap), ref, 1, budgets, alpha, score_all)
    return stopped, ref, eng


def _loss(stopped, ref, cap=16, adaptive=True):
    nll = stopped.nll
    metrics = {METRIC: math.exp(nll.mean()), f"{METRIC}_windows": float(len(nll))}
    if adaptive:
        metrics.update({f"{METRIC}_adaptive_cap": float(cap), f"{METRIC}_adaptive_chunk": 1.0})
    base = {METRIC: math.exp(ref.mean()), f"{METRIC}_windows": float(cap)}
    return decision.loss(METRIC, metrics, {METRIC: list(nll.ravel())}, base, {METRIC: list(ref.ravel())})


def test_a_clear_point_stops_early_and_an_unclear_one_reaches_the_cap():
    rng = np.random.default_rng(0)
    clear, _, eng = _trial(rng, delta=0.0, sigma=0.05, budgets=(0.01, 0.05), alpha=0.005)
    assert len(clear.nll) == 8 and eng.scored == 8 and clear.reason.startswith("decided at 8 of 16")
    assert "within 0.01, 0.05" in clear.reason and clear.upper <= 0.01
    far, _, _ = _trial(rng, delta=0.5, sigma=0.05, budgets=(0.01, 0.05), alpha=0.005)  # loss ~39 %
    assert len(far.nll) == 8 and "within none" in far.reason and far.lower > 0.05
    edge, _, _ = _trial(rng, delta=-math.log(0.95), sigma=0.4, budgets=(0.05,), alpha=0.005)
    assert len(edge.nll) == 16 and edge.reason == "cap of 16 windows reached"
    full, _, eng = _trial(rng, delta=0.0, sigma=0.05, budgets=(0.05,), score_all=True)
    assert len(full.nll) == 16 and full.reason.startswith("baseline candidate")


def test_the_report_bounds_an_adaptive_point_over_its_looks():
    """The same windows bound as a fixed design are narrower than as an
    adaptive one (which could have stopped at any look); the method says which."""
    stopped, ref, _ = _trial(np.random.default_rng(1), delta=0.02, score_all=True)
    fixed, seq = _loss(stopped, ref, adaptive=False), _loss(stopped, ref, adaptive=True)
    assert fixed.value == pytest.approx(seq.value)
    assert seq.upper > fixed.upper > seq.value
    assert seq.bound.method.startswith("anytime-valid over 9 looks") and "paired t on 16 windows" in \
        fixed.bound.method
    # a baseline that stopped early (a sweep without float points): paired on the windows both scored
    short = perplexity.Stopped(stopped.nll[:10], "", 0, 1)
    lo = decision.loss(METRIC, {METRIC: math.exp(ref.mean()), f"{METRIC}_windows": 16.0},
                       {METRIC: list(ref.ravel())},
                       {METRIC: 1.0, f"{METRIC}_windows": 10.0, f"{METRIC}_adaptive_cap": 16.0,
                        f"{METRIC}_adaptive_chunk": 1.0}, {METRIC: list(short.nll.ravel())})
    assert lo.bound.method.startswith("anytime-valid over 3 looks")


@pytest.mark.parametrize("budget,sigma", [(0.01, 0.1), (0.05, 0.4)])
def test_false_qualification_under_the_stopping_rule_is_at_most_alpha(budget, sigma):
    """A point whose true loss is exactly the budget, stopped by the probe's own
    rule at a generous per-point alpha (0.05: the most a stop can exploit),
    then bounded by the report: qualifies in at most 5 % of trials (+ 2 se of
    the simulation), stops included."""
    rng = np.random.default_rng(7)
    delta = -math.log(1.0 - budget)
    trials, qualified, early = 400, 0, 0
    for _ in range(trials):
        stopped, ref, _ = _trial(rng, delta, sigma=sigma, budgets=(budget,))
        qualified += _loss(stopped, ref).upper <= budget
        early += len(stopped.nll) < 16
    assert qualified / trials <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)
    assert early > 0  # the rule did stop early in some trials


def test_an_error_rate_or_budget_of_1_or_more_is_refused():
    from quantlab.config_check import validate
    from quantlab.probes.configs import PerplexityProbeConfig

    with pytest.raises(ValueError, match="adaptive_alpha=1.5.*each below 1"):
        validate(PerplexityProbeConfig(adaptive_alpha=1.5), "probe.perplexity.")
    with pytest.raises(ValueError, match=r"adaptive_budgets=\[0.01, 5.0\]"):
        validate(PerplexityProbeConfig(adaptive_budgets=[0.01, 5.0]), "probe.perplexity.")


def test_the_sequential_bound_is_the_least_look_bound_held_at_the_estimate():
    """Looks that disagree (an early prefix said far more than the whole: an
    event of probability at most alpha, or drifting items) never leave a
    bound below the estimate it is reported beside: max(least bound, estimate),
    valid whenever the union bound is, and monotone in alpha."""
    bounds = {10: -0.05, 20: 0.08}
    look = lambda n, level: bounds[n]  # noqa: E731
    assert sequential.upper(0.05, [10, 20], 20, look) == -0.05
    assert sequential.upper(0.05, [10, 20], 20, look, estimate=0.03) == 0.03
    assert sequential.upper(0.05, [10, 20], 20, look, estimate=-0.1) == -0.05
    assert sequential.effective(-0.2, -0.05, 0.03) == (-0.2, 0.03)
    assert sequential.effective(0.05, 0.3, 0.03) == (0.03, 0.3)


@given(seed=st.integers(0, 2**32 - 1), delta=st.floats(-0.02, 0.08), tau=st.sampled_from([0.0, 0.01, 0.03]),
       budget=st.sampled_from([0.01, 0.02, 0.05]), adaptive=st.booleans())
@settings(max_examples=60, deadline=None)
def test_holm_and_the_printed_bound_never_disagree(seed, delta, tau, budget, adaptive):
    """The report prints the 95 % bound and decides by Holm on the p-value:
    for one point they agree by construction (the p-value inverts a bound
    monotone in alpha), adaptive or fixed, whatever the windows do."""
    from quantlab.pareto import Point, fastest_within

    rng = np.random.default_rng(seed)
    ref = rng.uniform(2.0, 4.0, size=(16, 63))
    point = ref + delta + tau * rng.standard_normal((16, 1)) + 0.1 * rng.standard_normal(ref.shape)
    eng = WindowEngine(point)
    stopped = perplexity.adaptive_nll(eng, _windows(16, 64), ref, 2, (0.01, 0.05), 0.05) if adaptive else \
        perplexity.Stopped(point, "", 0, 1)
    metric = "ppl_token_wikitext2_w64_rand16"
    nll = stopped.nll
    metrics = {metric: math.exp(nll.mean()), f"{metric}_windows": float(len(nll))}
    if adaptive:
        metrics.update({f"{metric}_adaptive_cap": 16.0, f"{metric}_adaptive_chunk": 2.0})
    lo = decision.loss(metric, metrics, {metric: list(nll.ravel())},
                       {metric: math.exp(ref.mean()), f"{metric}_windows": 16.0}, {metric: list(ref.ravel())})
    picked = fastest_within([Point("p", 1.0, lo.value, False, lo.upper, lo.bound.p_value)], budget).point
    assert (picked is not None) == (lo.upper <= budget)
    assert lo.bound.upper_at(0.01) >= lo.bound.upper_at(0.05) >= lo.bound.upper_at(0.2)
    assert lo.upper >= lo.bound.value - 1e-12
