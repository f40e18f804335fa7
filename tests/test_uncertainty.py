"""Error bars and paired tests against independent computations (scipy), and
the decision rule that uses their pessimistic bound."""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from quantlab import decision, report, tracking, uncertainty
from quantlab.errors import UserError
from quantlab.pareto import Point, fastest_within
from quantlab.probes import fidelity, perplexity
from quantlab.records import PointRecord
from quantlab.uncertainty import mcnemar_p, mean_stderr, paired


@given(st.integers(0, 40), st.integers(0, 40))
def test_mcnemar_matches_scipy_binomial_test(b, c):
    want = 1.0 if b + c == 0 else stats.binomtest(b, b + c, 0.5).pvalue
    assert mcnemar_p(b, c) == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=50)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=50))
def test_mean_stderr_matches_scipy_sem(xs):
    assert mean_stderr(xs) == pytest.approx(float(stats.sem(xs)), rel=1e-9, abs=1e-12)


def test_paired_binary_counts_discordant_documents():
    point = [1, 1, 0, 0, 1, 0, 1, 1]
    base = [1, 0, 0, 1, 1, 1, 1, 0]  # point-only right: 2, base-only right: 2
    p = paired(point, base, binary=True)
    assert p.diff == 0.0 and p.p_value == 1.0 and not p.significant and p.n == 8
    strong = paired([0] * 30, [1] * 30, binary=True)
    assert strong.diff == -1.0 and strong.significant
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired([1, 0], [1], binary=True)


def test_fidelity_ppl_ratio_and_delta_p_against_hand_computation():
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(12, 13), -1)  # 3 windows of 4 positions
    q = torch.log_softmax(ref + 0.3 * torch.randn(12, 13), -1)
    targets = torch.randint(0, 13, (3, 3))
    out = fidelity.compare(ref, q, targets, windows=3)
    pos = [(w * 4 + t, targets[w, t]) for w in range(3) for t in range(3)]  # each window's last position predicts nothing
    nll_r = [-ref[i, j].item() for i, j in pos]
    nll_q = [-q[i, j].item() for i, j in pos]
    assert out["fid/ln_ppl_ratio"] == pytest.approx(math.log(math.exp(np.mean(nll_q)) / math.exp(np.mean(nll_r))))
    assert out["fid/ln_ppl_ratio_stderr_tokens"] == pytest.approx(float(stats.sem(np.subtract(nll_r, nll_q))))
    dp = [math.exp(-a) - math.exp(-b) for a, b in zip(nll_q, nll_r)]
    assert out["fid/dp_token_mean"] == pytest.approx(np.mean(dp))
    p = ref.double().exp()
    kl = (p * (ref.double() - q.double())).sum(-1).numpy()
    assert out["fid/kl_median"] == pytest.approx(float(np.median(kl)))
    assert out["fid/kl_p999"] == pytest.approx(float(np.percentile(kl, 99.9)))
    assert out["fid/kl_mean_stderr_tokens"] == pytest.approx(float(stats.sem(kl)))
    assert out["fid/windows"] == 3  # the unit: the window
    assert out["fid/kl_mean_stderr"] == pytest.approx(float(stats.sem(kl.reshape(3, 4).mean(1))))
    same = fidelity.compare(ref, ref.clone(), targets, windows=3)
    assert same["fid/ln_ppl_ratio"] == 0.0 and same["fid/kl_mean_stderr"] == 0.0
    with pytest.raises(ValueError, match="need one fewer"):
        fidelity.compare(ref, q, targets[:2], windows=3)


def test_loss_upper_bound_from_paired_items():
    rng = np.random.default_rng(0)
    base_nll = rng.gamma(2.0, 1.5, 4000)
    point_nll = base_nll + rng.normal(0.01, 0.2, 4000)
    key = "ppl_token_wikitext2_w251_rand16"  # 16 windows of 250 predicted tokens
    bm = {key: math.exp(base_nll.mean())}
    pm = {key: math.exp(point_nll.mean())}
    lo = decision.loss(key, pm, {key: list(point_nll)}, bm, {key: list(base_nll)})
    d = point_nll - base_nll
    assert lo.bounded and lo.value == pytest.approx(1 - math.exp(-d.mean()))
    # one-sided 95 %: t on the means of the 16 windows (the unit), 15 df
    means = d.reshape(16, 250).mean(1)
    want = d.mean() + stats.t.ppf(0.95, 15) * stats.sem(means)
    assert lo.upper == pytest.approx(1 - math.exp(-want), rel=1e-9)
    assert "paired t on 16 windows" == lo.bound.method
    assert lo.value == pytest.approx(1 - bm[key] / pm[key])  # same as the recovery definition
    unbounded = decision.loss(key, pm, {}, bm, {})  # no items, no standard errors: estimate only
    assert not unbounded.bounded and unbounded.upper == math.inf and unbounded.bound.p_value(0.99) == 1.0
    whole = "ppl_token_wikitext2_w2048"
    odd = decision.loss(whole, {whole: pm[key]}, {whole: list(point_nll)}, {whole: bm[key]},
                        {whole: list(base_nll)})  # items that are no whole windows
    assert odd.upper == 1.0 and "cannot tell" in odd.bound.method
    acc_b, acc_p = [1] * 60 + [0] * 40, [1] * 55 + [0] * 45
    am = decision.loss("recovery/acc/t", {"acc/t": 0.55}, {"acc/t": acc_p, "doc_ids/t": list(range(100))},
                       {"acc/t": 0.60}, {"acc/t": acc_b, "doc_ids/t": list(range(100))})
    assert am.value == pytest.approx(1 - 0.55 / 0.60) and am.upper > am.value
    assert am.upper == pytest.approx(uncertainty.tango_upper(5, 0, 100, 0.05) / 0.60)
    other_docs = decision.loss("acc/t", {"acc/t": 0.55}, {"acc/t": acc_p, "doc_ids/t": list(range(1, 101))},
                               {"acc/t": 0.60}, {"acc/t": acc_b, "doc_ids/t": list(range(100))})
    assert not other_docs.bounded  # not the same documents: never paired


def test_no_discordant_documents_still_leave_a_bound_of_order_3_over_n():
    """#31 finding 2: no paired item differs -> the normal bound was 0 (every
    budget met); Tango's score bound is z^2 / (n + z^2), never 0."""
    zq = NormalDist().inv_cdf(0.95)
    for n in (50, 200, 1000):
        assert uncertainty.tango_upper(0, 0, n, 0.05) == pytest.approx(zq**2 / (n + zq**2), rel=1e-9)
    same = [1.0] * 24 + [0.0] * 26
    lo = decision.loss("acc/t", {"acc/t": 0.48}, {"acc/t": same, "doc_ids/t": list(range(50))},
                       {"acc/t": 0.48}, {"acc/t": same, "doc_ids/t": list(range(50))})
    assert lo.value == 0.0 and lo.upper == pytest.approx(zq**2 / (50 + zq**2) / 0.48)
    assert lo.upper > 0.1  # 50 documents cannot show a loss under 1 % or 5 %
    # top-1: 128 positions in 8 windows, none disagreeing (but not identical log-probabilities):
    # Wilson's bound k / (1 + k), k = t(0.95, 7 df)^2 / 128
    top = decision.loss("fid/top1_agree", {"fid/top1_agree": 1.0, "fid/top1_agree_stderr": 0.0,
                                           "fid/top1_agree_stderr_tokens": 0.0, "fid/tokens": 128.0,
                                           "fid/windows": 8.0, "fid/identical": 0.0}, {}, {}, {})
    k = stats.t.ppf(0.95, 7) ** 2 / 128
    assert top.value == 0.0 and top.upper == pytest.approx(k / (1 + k), rel=1e-9) and 0.025 < top.upper < 0.03


@settings(max_examples=60, deadline=None)
@given(lost=st.integers(0, 30), gained=st.integers(0, 30), extra=st.integers(0, 300))
def test_tango_bound_inverts_the_score_test(lost, gained, extra):
    """At the returned bound the score statistic equals -z (the bound is the
    edge of the one-sided acceptance region), and the bound is above the
    estimate and grows with the level."""
    n = lost + gained + extra + 1
    u = uncertainty.tango_upper(lost, gained, n, 0.05)
    assert u >= (lost - gained) / n
    assert uncertainty.tango_upper(lost, gained, n, 0.01) >= u
    if u < 1.0:
        assert uncertainty._tango_z(u, lost, gained, n) == pytest.approx(-NormalDist().inv_cdf(0.95), abs=1e-6)


def test_without_items_the_bound_is_unpaired_from_both_standard_errors():
    """#31 finding 6: both runs logged their standard errors but no per-item
    values; the bound used to equal the estimate."""
    key = "ppl_token_wikitext2_w1024"
    pm, bm = {key: 20.4, f"{key}_ln_stderr": 0.01}, {key: 20.0, f"{key}_ln_stderr": 0.012}
    lo = decision.loss(key, pm, {}, bm, {})
    d, se = math.log(20.4 / 20.0), math.hypot(0.01, 0.012)
    assert lo.bounded and lo.bound.method.startswith("unpaired")
    assert lo.upper == pytest.approx(1 - math.exp(-(d + NormalDist().inv_cdf(0.95) * se)))
    acc = decision.loss("acc/t", {"acc/t": 0.55, "acc_stderr/t": 0.05}, {}, {"acc/t": 0.6, "acc_stderr/t": 0.049},
                        {})
    assert acc.upper == pytest.approx((0.05 + NormalDist().inv_cdf(0.95) * math.hypot(0.05, 0.049)) / 0.6)


def test_token_standard_errors_come_from_windows():
    """Correlated tokens: the window-means standard error is wider than the
    per-token one, which is kept as a labelled secondary."""
    rng = np.random.default_rng(1)
    e = np.empty(2048)
    e[0] = 0
    for i in range(1, e.size):  # AR(1), rho 0.8
        e[i] = 0.8 * e[i - 1] + rng.normal()
    out = perplexity.summary((3 + 0.1 * e).reshape(16, 128), "ppl_token_wikitext2_w129_rand16")
    key = "ppl_token_wikitext2_w129_rand16"
    assert out[f"{key}_windows"] == 16 and out[f"{key}_ln_stderr"] > 2 * out[f"{key}_ln_stderr_tokens"]
    assert out[f"{key}_ln_stderr"] == pytest.approx(stats.sem((0.1 * e).reshape(16, 128).mean(1)))


def test_holm_step_down():
    assert uncertainty.holm([0.01, 0.04, 0.03], 0.05) == [True, False, False]  # 0.01 <= .05/3; .03 > .05/2
    assert uncertainty.holm([0.01, 0.02, 0.03], 0.05) == [True, True, True]
    assert uncertainty.holm([], 0.05) == []


def test_false_qualification_rate_is_at_most_the_stated_level():
    """At both budgets a point that in truth loses exactly the budget
    qualifies in at most 5 % of trials (plus Monte-Carlo slack: 150 trials,
    3 se) through the report's path, for accuracy, top-1 (windows that
    differ) and perplexity (16 random windows, shifted or not, adaptive or
    fixed) losses; a 1.5 %-loss accuracy point at n 50 never qualifies for
    1 %; 8 points at the budget at once (Holm) qualify together no more
    often. Fixed seed; ``benchmarks/decision_calibration.py`` prints the grid."""
    from benchmarks import decision_calibration as cal

    rng = np.random.default_rng(7)
    slack = 0.05 + 3 * math.sqrt(0.05 * 0.95 / 150)
    for b in cal.BUDGETS:
        for design, tau in (("fixed16", 0.0), ("fixed16", 0.02), ("adaptive", 0.02)):
            p, _ = cal.rate(lambda: cal.perplexity_loss(rng, design, b, 1.0, tau, "ar0.3"), b, 150)
            assert p <= slack, (design, tau, b)
        assert cal.rate(lambda: cal.top1_loss(rng, b, 1.0, 0.02), b, 150)[0] <= slack
        assert cal.rate(lambda: cal.accuracy_loss(rng, b, 1.0), b, 150)[0] <= slack
    assert cal.rate(lambda: cal.accuracy_loss(rng, 0.01, 1.5, n=50), 0.01, 150)[0] == 0.0
    family = 0
    for _ in range(100):
        pts = [Point(f"p{i}", float(i), lo.value, False, lo.upper, lo.bound.p_value)
               for i in range(8) if (lo := cal.accuracy_loss(rng, 0.05, 1.0)) is not None]
        family += fastest_within(pts, 0.05).point is not None
    assert family / 100 <= slack


def test_the_calibration_prints_the_windows_an_adaptive_design_scored(capsys):
    """A 64-window cap: a point at 1.5x the 5 % budget (sigma 0.3) is called
    over it early, so its trials score fewer windows than the cap; an unknown
    design is refused naming the valid ones."""
    from benchmarks import decision_calibration as cal

    scored: list[int] = []
    rng = np.random.default_rng(3)
    for _ in range(20):
        cal.perplexity_loss(rng, "adaptive64", 0.05, 1.5, 0.0, "ar0.3", scored)
    assert len(scored) == 20 and max(scored) <= 64 and sum(scored) / 20 < 48
    assert cal.main(["--trials", "4", "--quick", "--designs", "fixed64", "--no-other"]) == 0
    out = capsys.readouterr().out
    assert "| perplexity | fixed64 | ar0.3 | 0 | 0.05 |" in out and "64.0 / 64.0 / 64.0 |" in out
    assert "| top-1 |" not in out
    with pytest.raises(SystemExit):
        cal.main(["--designs", "fixed32"])
    assert "unknown design fixed32; valid: first2, fixed16, adaptive, fixed64, adaptive64" in capsys.readouterr().err


def test_budget_uses_the_pessimistic_bound_and_says_when_it_cannot_tell():
    pts = [Point("bf16", 30, 0.0, loss_upper=0.0), Point("int8", 22, 0.004, loss_upper=0.007),
           Point("int4", 15, 0.008, loss_upper=0.02)]
    r = fastest_within(pts, 0.01)
    assert r.point.name == "int8" and r.margin == pytest.approx(0.003)
    assert [p.name for p in r.undecided] == ["int4"]  # estimate within 1 %, bound not
    assert fastest_within(pts, 0.05).point.name == "int4" and not fastest_within(pts, 0.05).undecided


def _run(name, bits, metrics, scheme=None):
    return PointRecord(name, name, metrics={"size/bits_per_weight": bits, **metrics},
                       tags={tracking.OUTCOME_TAG: "finished", "scheme": scheme or name})


def test_report_marks_non_significant_differences_and_names_the_rule():
    docs = list(range(100))
    base_items = {"acc/t": [1.0] * 60 + [0.0] * 40, "doc_ids/t": docs}
    near = {"acc/t": [1.0] * 58 + [0.0] * 42, "doc_ids/t": docs}  # 2 documents differ: noise
    far = {"acc/t": [1.0] * 20 + [0.0] * 80, "doc_ids/t": docs}  # 40 differ: real
    runs = [_run("bf16", 16, {"acc/t": 0.60, "acc_stderr/t": 0.049, "lat/tpot_ms_p50": 30}),
            _run("int8", 8, {"acc/t": 0.58, "acc_stderr/t": 0.05, "lat/tpot_ms_p50": 20}),
            _run("int4", 4, {"acc/t": 0.20, "acc_stderr/t": 0.04, "lat/tpot_ms_p50": 10})]
    items = {"bf16": base_items, "int8": near, "int4": far}
    text = report.table.table(runs, base=runs[0], items=items)
    row = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "0.580±0.050 ~" in row["int8"] and "~" not in row["int4"] and "bf16 (baseline)" in row
    assert "0.600±0.049" in row["bf16 (baseline)"]
    body, recs = report.verdict.decide(runs, "acc/t", (0.05,), runs[0], items)
    assert "closed testing over the 3 real points and the 1 budget together (Holm's step-down rule" in body
    assert "printed at the error its test used" in body
    assert "against bf16" in body and "per comparison" in body
    # int8's estimate (3.3 % loss) is within 5 %, its bound is not: nothing qualifies
    # but bf16, and the report says it cannot tell about int8
    assert recs[0.05].point.name == "bf16" and [p.name for p in recs[0.05].undecided] == ["int8"]
    assert "cannot tell: int8" in body
    p_int8 = recs[0.05].undecided[0].p_at(0.05)
    level = recs[0.05].levels["int8"]  # Holm: int8's p is the least of the two above 0 (bf16's), so 0.05 / 2
    assert level == pytest.approx(0.025)
    assert f"but \"loss >= 0.05\" has p = {p_int8:.3g}, above the {level:.3g} its test over the 3 points" in body
    assert p_int8 > 0.025
    assert "int8: acc/t: diff -0.0200" in report.table.paired_table(runs, runs[0], items)


def test_auto_baseline_prefers_bf16_over_fp16_at_equal_bits():
    runs = [_run("fp16@cpu", 16, {}, "fp16"), _run("bf16@cpu", 16, {}, "bf16"), _run("int8@cpu", 8, {}, "int8")]
    assert report.table.baseline_run(runs).name == "bf16@cpu"
    assert report.table.baseline_run(list(reversed(runs))).name == "bf16@cpu"


def test_capacity_objective_picks_the_most_requests_under_the_slo_within_budget():
    # int4 is fastest per token but loses 10 %; int8 serves more than bf16 under the SLO;
    # fp8 met the SLO at no rate (knee 0) and is never recommended by capacity
    metric = "ppl_token_wikitext2_w1024"
    se = {f"{metric}_ln_stderr": 1e-4}  # logged standard errors: an unpaired bound (without, no point qualifies)
    runs = [_run("bf16", 16, {metric: 20.0, **se, "lat/tpot_ms_p50": 30, "load/knee_rps_lower": 1.4}),
            _run("int8", 8, {metric: 20.1, **se, "lat/tpot_ms_p50": 25, "load/knee_rps_lower": 1.9}),
            _run("fp8", 8, {metric: 20.0, **se, "lat/tpot_ms_p50": 24, "load/knee_rps_lower": 0.0}),
            _run("int4", 4, {metric: 22.2, **se, "lat/tpot_ms_p50": 10, "load/knee_rps_lower": 2.7})]
    assert report.verdict.objective(runs) == "capacity" and report.verdict.objective(runs[:0]) == "tpot"
    body, recs = report.verdict.decide(runs, metric, (0.01, 0.2), runs[0], {}, by="capacity")
    assert recs[0.01].point.name == "int8" and recs[0.2].point.name == "int4"
    assert "Most capacity within 1% loss: **int8** — 1.90 req/s under the SLOs" in body
    assert "highest capacity under the SLOs (the lower bound of the load probe's knee)" in body
    _, by_tpot = report.verdict.decide(runs, metric, (0.01,), runs[0], {}, by="tpot")
    assert by_tpot[0.01].point.name == "fp8"
    with pytest.raises(UserError, match="unknown objective 'qps'; valid: auto, tpot, capacity"):
        report.verdict.objective(runs, "qps")


def test_contended_timings_are_marked_and_the_pick_says_when_it_rests_on_one():
    """#31 finding 10: bf16 and fp16 timed beside other work (TPOT 709 and
    193 ms against int8's 81 ms idle) were ranked without a mark."""
    from quantlab import point

    def contended(r):
        r.tags[point.CONTENDED_TAG] = "latency timed beside 1.40 cores of other work (2 cores)"
        return r

    ppl = "ppl_token_wikitext2_w1024"
    se = {f"{ppl}_ln_stderr": 1e-4}
    runs = [contended(_run("bf16", 16, {ppl: 20.0, **se, "lat/tpot_ms_p50": 709.0})),
            contended(_run("fp16", 16, {ppl: 20.0, **se, "lat/tpot_ms_p50": 193.0})),
            _run("int8", 8, {ppl: 20.05, **se, "lat/tpot_ms_p50": 81.0}),
            _run("int4", 4, {ppl: 23.0, **se, "lat/tpot_ms_p50": 40.0})]
    text = report.table.table(runs)
    row = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "709.00†" in row["bf16"] and "193.00†" in row["fp16"] and "81.00 " in row["int8"]
    assert "16.00†" not in row["bf16"]  # sizes and losses are not timings
    assert "- fp16: latency timed beside 1.40 cores of other work (2 cores)" in text
    body, recs = report.verdict.decide(runs, ppl, (0.01,), runs[0], {}, by="tpot")
    assert recs[0.01].point.name == "int8" and [p.name for p in recs[0.01].contended] == ["fp16", "bf16"]
    assert "cannot tell on latency: fp16 (193.00 ms/token†), bf16 (709.00 ms/token†) also qualified" in body
    # a contended winner stays the pick (contention only inflates its cost) and raises no doubt of its own
    runs[2].tags[point.CONTENDED_TAG] = "x"
    for r in runs[:2]:
        del r.tags[point.CONTENDED_TAG]
    body, recs = report.verdict.decide(runs, ppl, (0.01,), runs[0], {}, by="tpot")
    assert recs[0.01].point.name == "int8" and recs[0.01].contended == () and "cannot tell on latency" not in body


def test_the_pick_names_a_loser_whose_requests_overlap_its_own():
    """Two headline sweeps, one after the other, picked int8 then fp16: their
    TPOTs per request overlapped (the figures below are the first sweep's).
    The pick says so; a point apart from it is not named."""
    ppl = "ppl_token_wikitext2_w1024"
    se = {f"{ppl}_ln_stderr": 1e-4}

    def timed(name, bits, p50, lo, hi):
        return _run(name, bits, {ppl: 20.0, **se, "lat/tpot_ms_p50": p50, "lat/tpot_ms_req_lo": lo,
                                 "lat/tpot_ms_req_hi": hi})
    runs = [timed("fp32", 32, 54.73, 53.9, 55.6), timed("fp16", 16, 27.60, 27.60, 27.68),
            timed("int8", 8, 25.67, 24.77, 28.33), timed("bf16", 16, 46.50, 44.29, 47.51)]
    body, recs = report.verdict.decide(runs, ppl, (0.01,), runs[0], {}, by="tpot")
    assert recs[0.01].point.name == "int8" and [p.name for p in recs[0.01].close] == ["fp16"]
    assert ("close on latency: fp16 (27.60 ms/token, +7.5%; requests 27.60-27.68) also qualified, and their "
            "requests' TPOTs overlap the pick's (24.77-28.33 ms/token)") in body
    del runs[2].metrics["lat/tpot_ms_req_lo"]  # a point timed by one request: no range, nothing said
    body, recs = report.verdict.decide(runs, ppl, (0.01,), runs[0], {}, by="tpot")
    assert recs[0.01].close == () and "close on latency" not in body


def test_the_report_says_when_latency_differences_are_the_engines_overhead():
    """As measured by benchmarks/runtimes.py on an AVX2 EPYC: every scheme at
    0.98-1.02x bf16 on the eager engine, 44-53 ms of a 55-63 ms step beyond
    the bytes; llama.cpp separates the same points. The SmolLM2 smoke sweep
    here (fp32 reads twice fp16's bytes, and its TPOT shows it: slope 1.8)
    says nothing."""
    def timed(name, tpot, floor, target="cpu", **tags):
        r = _run(name, 8, {"lat/tpot_ms_p50": tpot, "bw/floor_ms": floor, "bw/overhead_ms": tpot - floor})
        r.tags.update({"target": target, **tags})
        return r

    flat = [timed("bf16", 60.0, 7.0), timed("int8", 59.0, 9.0), timed("int4", 61.0, 2.0)]
    note = report.verdict.overhead_note(flat)
    assert note.startswith("Latency within overhead: TPOT P50 spans 59.00-61.00 ms (1.03x) across 3 real points")
    assert "whose bytes alone would take 2.00-9.00 ms" in note and "cpu: target=llamacpp" in note
    assert "target.compile_mode=reduce-overhead" in report.verdict.overhead_note([timed("a", 10, 2, "cuda"),
                                                                          timed("b", 10.5, 1, "cuda")])
    smoke = [timed("fp32", 48.53, 19.71), timed("fp16", 39.64, 14.87), timed("bf16", 40.69, 14.87)]
    assert report.verdict.overhead_note(smoke) == ""  # the bytes show: slope 1.8
    spread = [timed("f16", 30.0, 25.0, "llamacpp"), timed("q4", 12.0, 8.0, "llamacpp")]
    assert report.verdict.overhead_note(spread) == ""  # overhead is a small part of each step
    # emulated and contended points do not count; one point alone, or equal bytes, say nothing
    assert report.verdict.overhead_note([flat[0], timed("fp8", 60.5, 3.0, emulated="true")]) == ""
    assert report.verdict.overhead_note([timed("x", 60, 7), timed("y", 61, 7)]) == ""
    body, _ = report.verdict.decide(flat, "lat/tpot_ms_p50", (0.01,), None, {}, by="tpot")
    assert "Latency within overhead" in body



@settings(max_examples=80, deadline=None)
@given(p=st.floats(0.0, 0.5), n=st.floats(20.0, 5000.0), units=st.sampled_from([0, 4, 8, 40]),
       alpha=st.floats(0.01, 0.2))
def test_wilson_bound_inverts_the_score_test_at_its_quantile(p, n, units, alpha):
    up = uncertainty.wilson_upper(p, n, alpha, units)
    q = NormalDist().inv_cdf(1 - alpha) if units == 0 else stats.t.ppf(1 - alpha, units - 1)
    assert p <= up < 1
    assert (up - p) / math.sqrt(up * (1 - up) / n) == pytest.approx(q, rel=1e-6)
    assert uncertainty.wilson_upper(p, n, 1 - alpha, units) <= p  # the lower side, so p-values bisect
    assert uncertainty.wilson_upper(p, n, alpha, 1) == 1.0  # one block: nothing to estimate the spread from


def test_a_loss_without_a_bound_never_meets_a_budget_whoever_asks():
    """No standard error and no per-item values: the loss is an estimate
    alone, and its bound says so at every level (p = 1 at any budget), not
    only where the report checks ``bounded``."""
    from quantlab import decision

    lo = decision.loss("fid/kl_mean", {"fid/kl_mean": 0.001}, {}, {}, {})
    assert not lo.bounded and lo.value == 0.001
    assert lo.bound.p_value(0.5) == 1.0 and lo.upper == float("inf")
    lo = decision.loss("acc/x", {"acc/x": 0.5}, {}, {"acc/x": 0.5}, {})
    assert not lo.bounded and lo.bound.p_value(0.9) == 1.0


def test_the_report_says_which_measured_metrics_are_information_only():
    """Failing-before for "accuracy at 50 documents can never qualify
    anything": the headline's 50 lm-eval documents bound a point identical
    to the baseline at about 0.14 (Tango at 2.5 %, accuracy 0.5), above every budget, so
    the report names them information only beside the metric it decides on;
    a design that can decide is not named."""
    items = {"bf16": {"acc/t": [1.0, 0.0] * 25, "doc_ids/t": list(range(50)),
                      "acc/big": [1.0, 0.0] * 2000, "doc_ids/big": list(range(4000))}}
    runs = [_run("bf16", 16, {"acc/t": 0.5, "acc/big": 0.5})]
    text = report.metric.information_only(runs, "acc/big", runs[0], items, (0.01, 0.05), 0.025)
    best = report.metric.best_case("acc/t", runs[0], items, 0.025)
    assert 0.05 < best < 0.2 and text.startswith(" Information only here") and f"acc/t (at {best:.3g})" in text
    assert "acc/big" not in text and report.metric.information_only(runs, "acc/t", runs[0], items, (0.2,), 0.025) == ""


def test_auto_passes_over_a_metric_whose_design_cannot_decide_any_budget():
    """Failing-before for "decision.metric=auto picks acc/passkey" on the
    long_context sweep: 12 passkey trials in 6 cells cannot bound any loss
    (fewer than 8 clusters), so auto falls back to top-1 agreement and says
    why in one line; a design that can decide is kept."""
    ids = [f"L{L}-d{d}-t{t}" for L in (512, 2048) for d in (0, 0.5, 1) for t in range(2)]
    cells = [i.rsplit("-", 1)[0] for i in ids]
    items = {"bf16": {"acc/passkey": [1.0] * 12, "doc_ids/passkey": ids, "clusters/passkey": cells}}
    runs = [_run("bf16", 16, {"acc/passkey": 1.0, "fid/top1_agree": 1.0, "fid/identical": 1.0})]
    metric, why = report.metric.auto_metric(runs, "auto", runs[0], items, (0.01, 0.05), 0.025)
    assert metric == "fid/top1_agree" and why.startswith("auto passed over acc/passkey: a point identical to the "
                                                          "baseline on every item would be bounded at inf")
    assert report.metric.decision_metric(runs) == "acc/passkey"  # without the baseline's items: the old order
    many = [f"c{i}" for i in range(12)]  # 12 independent cells: a zero-miss point is bounded at about z^2 / 12
    items["bf16"]["clusters/passkey"] = many
    assert report.metric.best_case("acc/passkey", runs[0], items, 0.025) == pytest.approx(
        uncertainty.tango_upper(0, 0, 12, 0.025))
    docs = {"bf16": {"acc/t": [1.0, 0.0] * 500, "doc_ids/t": list(range(1000))}}
    kept = [_run("bf16", 16, {"acc/t": 0.5})]
    assert report.metric.auto_metric(kept, "auto", kept[0], docs, (0.01, 0.05), 0.025) == ("acc/t", "")
    items["bf16"]["clusters/passkey"] = cells  # nothing can decide: the first is shown, and the report says so
    alone = [_run("bf16", 16, {"acc/passkey": 1.0})]
    metric, why = report.metric.auto_metric(alone, "auto", alone[0], items, (0.01, 0.05), 0.025)
    assert metric == "acc/passkey" and why.startswith("no measured metric can decide a budget (auto passed over "
                                                      "acc/passkey") and why.endswith("no point can qualify on it")
