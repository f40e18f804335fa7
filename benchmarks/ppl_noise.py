"""Which cell of the decision's calibration grid real evidence sits in: the
noise of each point's paired per-token NLL difference against the baseline,
measured on a sweep in a store, and the headline design's error rates at that
noise, simulated through the report's own path.

Per point (its per-token NLLs and the baseline's, on the same random windows):

- ``sigma``: the pooled within-window sd of the difference d[w, t];
- ``rho``: the pooled lag-1 autocorrelation of d inside a window;
- ``tau``: the sd of a per-window shift, from the variance of the window means
  beyond what ``sigma`` and ``rho`` explain (0 when they explain all of it);
- ``window se / iid se``: how much wider the window-mean standard error is
  than the one that treats tokens as independent.

Then, at each point's own ``sigma``, ``rho`` and ``tau``, ``--trials``
simulated points per cell through
``decision.loss`` -> ``Bound.p_value`` -> ``pareto.fastest_within`` (the
``fixed16`` design of ``benchmarks/decision_calibration.py``: 16 windows of
128 tokens): false qualification at the budget and at 1.5x it, power at half.

    python -m quantlab -m scheme/weights=fp32,int8,int4-g64,int4-g32 probe=headline \\
        probe.perplexity.max_windows=64 probe.accuracy.enabled=false probe.latency.enabled=false \\
        probe.cache.enabled=false probe.fidelity.enabled=false sweep_name=ppl-noise tracking.uri=sqlite:///S/mlflow.db
    python benchmarks/ppl_noise.py --store S --sweep ppl-noise [--trials 2000]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decision_calibration as calib  # noqa: E402

from quantlab import report, tracking  # noqa: E402
from quantlab.tracking_config import TrackingConfig  # noqa: E402


def noise(d: np.ndarray) -> dict[str, float]:
    """``d``: [windows, tokens] paired differences -> sigma, rho, tau and the se ratio."""
    w, n = d.shape
    centred = d - d.mean(axis=1, keepdims=True)
    sigma = float(np.sqrt((centred ** 2).sum() / (w * (n - 1))))
    rho = float((centred[:, 1:] * centred[:, :-1]).sum() / (centred ** 2).sum())
    # variance of a window mean of an AR(1) series of n tokens, sd sigma, lag-1 correlation rho
    k = np.arange(1, n)
    within = sigma ** 2 / n * (1 + 2 * np.sum((1 - k / n) * rho ** k))
    between = float(d.mean(axis=1).var(ddof=1))
    return {"sigma": sigma, "rho": rho, "tau": math.sqrt(max(between - within, 0.0)),
            "se_ratio": math.sqrt(between / w) / (sigma / math.sqrt(w * n))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="directory holding mlflow.db")
    ap.add_argument("--sweep", required=True)
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tracker = tracking.connect(TrackingConfig(uri=f"sqlite:///{args.store}/mlflow.db", artifact_root=None))
    runs, reused, _, base, items = report.sweep_data(tracker, tracker.find_sweep(args.sweep))
    metric = report.metric.decision_metric(runs)
    windows = int(base.metrics[f"{metric}_windows"])
    ref = np.asarray(items[base.id][metric]).reshape(windows, -1)
    print(f"sweep {args.sweep}: {metric}, {windows} windows of {ref.shape[1] + 1} tokens, baseline "
          f"{base.name}\n")
    print("| point | loss | sigma | rho | tau | window se / iid se |\n|---|---|---|---|---|---|")
    measured = []
    for r in runs:
        if r.id == base.id or metric not in items.get(r.id, {}):
            continue
        d = np.asarray(items[r.id][metric]).reshape(windows, -1) - ref
        nz = noise(d)
        measured.append((r.name, nz))
        loss = 1 - math.exp(-d.mean())
        print(f"| {r.name} | {loss:.4f} | {nz['sigma']:.3f} | {nz['rho']:.3f} | {nz['tau']:.4f} | "
              f"{nz['se_ratio']:.2f} |")
    print(f"\nEach point's noise, simulated: design fixed16 (16 x 128), {args.trials} trials a cell, true loss "
          "at the budget, 1.5x it and half of it\n")
    print("| noise of | budget | at budget (se) | 1.5x (se) | 0.5x: power (se) |\n|---|---|---|---|---|")
    rng = np.random.default_rng(args.seed)
    for name, nz in measured:
        kind = f"ar{max(nz['rho'], 0.0):.3f}"
        for budget in calib.BUDGETS:
            calib.SIGMA[budget] = nz["sigma"]
            cells = [calib.rate(lambda: calib.perplexity_loss(rng, "fixed16", budget, mult, nz["tau"], kind),
                                budget, args.trials) for mult in calib.MULTIPLES]
            print(f"| {name} | {budget:g} | " + " | ".join(f"{p:.3f} ({se:.3f})" for p, se in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
