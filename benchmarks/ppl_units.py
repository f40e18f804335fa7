"""Which unit of a perplexity comparison is independent enough: the standard
error of a point's paired per-token NLL difference against the baseline from
blocks of up to 128 tokens (the report's) beside the one from whole windows
(each window's mean difference a unit), on a sweep already in a store.

A window that is harder for the point as a whole (a shift shared by its
tokens) widens the window figure and not the block one: where the window se
is clearly the larger, blocks are too narrow a unit and the windows must be.

    python benchmarks/ppl_units.py --store /tmp/adaptive-eval-store --sweep eval-fixed
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from quantlab import report, tracking
from quantlab.tracking_config import TrackingConfig
from quantlab.uncertainty import block_stderr, mean_stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="directory holding mlflow.db and artifacts/")
    ap.add_argument("--sweep", required=True, help="the sweep's name (its newest parent run)")
    args = ap.parse_args()
    uri = f"sqlite:///{args.store}/mlflow.db"
    tracker = tracking.connect(TrackingConfig(uri=uri, artifact_root=f"{args.store}/artifacts"))
    runs, _, _, _, _ = report.sweep_data(tracker, tracker.find_sweep(args.sweep))
    runs = [r for r in runs if r.done]
    base = report.table.baseline_run(runs)
    metric = report.metric.decision_metric(runs)
    if not metric.startswith("ppl_token_"):
        raise SystemExit(f"sweep {args.sweep} has no token perplexity (decision metric {metric})")
    windows = int(base.metrics[f"{metric}_windows"])
    ref = np.asarray(tracker.items(base.origin)[metric])
    per = ref.size // windows
    print(f"{metric}: {windows} windows of {per} predicted tokens; baseline {base.name}")
    print(f"{'point':22} {'ln PPL ratio':>12} {'se blocks':>10} {'se windows':>11} {'ratio':>6}")
    ratios = []
    for r in runs:
        if r.id == base.id:
            continue
        nll = np.asarray(tracker.items(r.origin).get(metric, []))
        if nll.size != ref.size:
            continue
        d = nll - ref
        se_b, blocks = block_stderr(d)
        se_w = mean_stderr(d.reshape(windows, per).mean(axis=1))
        ratios.append(se_w / se_b)
        print(f"{r.name:22} {d.mean():12.5f} {se_b:10.5f} {se_w:11.5f} {se_w / se_b:6.2f}  "
              f"({blocks} blocks)")
    if ratios:
        print(f"window se / block se: geometric mean {math.exp(np.mean(np.log(ratios))):.2f} over "
              f"{len(ratios)} points (a ratio's own sampling spread with {windows} windows: about "
              f"{1 / math.sqrt(2 * (windows - 1)):.0%})")


if __name__ == "__main__":
    main()
