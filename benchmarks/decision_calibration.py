"""How often the budget decision qualifies a point that in truth loses *at
least* the budget (a false qualification), simulated through the report's own
code path (``decision.loss`` -> ``Bound`` -> ``pareto.fastest_within``).

Three losses, each on the design the probes use:
- ``accuracy``: paired 0/1 documents, baseline accuracy 0.48, the point only
  ever losing documents (the worst case of #31: the old normal bound
  qualified a 1.5 %-loss point for a 1 % budget 70 % of the time at n = 50);
- ``top1``: 1 - top-1 agreement over n positions in runs of correlated
  disagreements (AR(1) flips, rho 0.5);
- ``perplexity``: paired per-token NLL differences, AR(1) with rho 0.3
  (tokens of one text are correlated), n tokens.

The stated level is one-sided 5 % for one point; ``family`` runs 8 points at
the budget at once and counts how often *any* qualifies (Holm's rule).

    python benchmarks/decision_calibration.py [--trials 400] [--seed 0]
"""
from __future__ import annotations

import argparse
import math
from statistics import NormalDist

import numpy as np
import torch

from quantlab import decision
from quantlab.pareto import Point, fastest_within
from quantlab.probes import fidelity

NS = (50, 200, 1000)
MULTIPLES = (1.0, 1.5, 2.0, 3.0)  # true loss as a multiple of the budget (all >= the budget: H0 true)
BUDGETS = (0.01, 0.05)


def _ar1(rng, n: int, rho: float) -> np.ndarray:
    e = rng.standard_normal(n)
    out = np.empty(n)
    out[0] = e[0]
    for i in range(1, n):
        out[i] = rho * out[i - 1] + math.sqrt(1 - rho * rho) * e[i]
    return out


def _accuracy_loss(rng, n: int, rel_loss: float) -> decision.Loss:
    base = (rng.random(n) < 0.48).astype(float)
    point = base.copy()
    point[(base == 1) & (rng.random(n) < rel_loss)] = 0.0  # P(lost) = rel_loss * P(base right)
    docs = list(range(n))
    b, p = base.mean(), point.mean()
    if b == 0 or p == 0:
        return None
    return decision.loss("acc/t", {"acc/t": p}, {"acc/t": list(point), "doc_ids/t": docs}, {"acc/t": b},
                         {"acc/t": list(base), "doc_ids/t": docs})


def _top1_loss(rng, n: int, loss: float) -> decision.Loss:
    flips = _ar1(rng, n, 0.5) < NormalDist().inv_cdf(loss)  # P(flip) = loss, in correlated runs
    ref = torch.log_softmax(torch.tensor([[1.0, 0.0]]).repeat(n, 1), -1)
    point = torch.where(torch.tensor(flips)[:, None], ref.flip(-1), ref)
    return decision.loss("fid/top1_agree", fidelity.compare(ref, point), {}, {}, {})


def _perplexity_loss(rng, n: int, rel_loss: float) -> decision.Loss:
    mu = -math.log(1 - rel_loss)  # ln PPL ratio of that relative loss
    base = rng.gamma(2.0, 1.5, n)
    point = base + mu + 0.3 * _ar1(rng, n, 0.3)
    key = "ppl_token_wikitext2_w1024"
    return decision.loss(key, {key: math.exp(point.mean())}, {key: list(point)}, {key: math.exp(base.mean())},
                         {key: list(base)})


KINDS = {"accuracy": _accuracy_loss, "top1": _top1_loss, "perplexity": _perplexity_loss}


def false_qualification(kind: str, n: int, budget: float, multiple: float, trials: int, seed: int,
                        family: int = 1) -> float:
    """Share of trials in which any of ``family`` points, each truly losing
    ``multiple * budget``, qualifies for ``budget``."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(trials):
        pts = []
        for i in range(family):
            lo = KINDS[kind](rng, n, multiple * budget)
            if lo is not None:
                pts.append(Point(f"p{i}", float(i), lo.value, False, lo.upper, lo.bound.p_value, lo.bound.method))
        hits += fastest_within(pts, budget).point is not None
    return hits / trials


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"false-qualification rate, stated level 5 % one-sided ({args.trials} trials a cell, seed {args.seed})")
    print(f"{'loss':<11} {'n':>5} {'budget':>7} " + " ".join(f"{m:>5.1f}x" for m in MULTIPLES))
    for kind in KINDS:
        for n in NS:
            for b in BUDGETS:
                rates = [false_qualification(kind, n, b, m, args.trials, args.seed) for m in MULTIPLES]
                print(f"{kind:<11} {n:>5} {b:>7.2f} " + " ".join(f"{r:>6.3f}" for r in rates))
    fam = false_qualification("accuracy", 200, 0.05, 1.0, args.trials, args.seed, family=8)
    print(f"family of 8 points at the budget (accuracy, n 200, budget 5 %), any qualified: {fam:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
