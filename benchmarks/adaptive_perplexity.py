"""Adaptive perplexity beside the fixed design: the same points, the same
store, the windows each scored and the points each qualifies per budget.

Runs two sweeps of ``python -m quantlab`` (perplexity the decision metric,
the other accuracy probes off): ``fixed`` scores ``--cap`` windows per point,
``adaptive`` scores ``--chunk`` windows a look until every budget is decided
against the reference model (``probe.perplexity.adaptive=true``). Prints per
point the windows scored, why it stopped, and per budget the points Holm's
rule qualifies in each design (the decision adaptivity can change; the pick
among them is by latency, timed anew in each sweep). The reference model's
own windows (scored once, cached) are counted in the adaptive total.

    QUANTLAB_DATA_DIR=../shared/data python benchmarks/adaptive_perplexity.py \
        [--points fp32,bf16,int8,int4-g64,int4-g32,nf4] [--window 512] [--cap 16] [--chunk 2]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantlab import point, report, tracking
from quantlab.config import TrackingConfig
from quantlab.uncertainty import holm

REPO = Path(__file__).resolve().parent.parent


def sweep(name: str, args, uri: str, root: str, adaptive: bool) -> float:
    cmd = [sys.executable, "-m", "quantlab", "-m", f"model={args.model}", f"scheme/weights={args.points}",
           "probe=headline", "probe.accuracy.enabled=false", "probe.cache.enabled=false",
           "probe.latency.repeats=2", "probe.latency.stages=false", f"probe.perplexity.window={args.window}",
           f"probe.perplexity.max_windows={args.cap}", f"sweep_name={name}", f"tracking.uri={uri}",
           f"tracking.artifact_root={root}", f"cache_dir={args.cache_dir}"]
    if adaptive:
        cmd += ["probe.perplexity.adaptive=true", f"probe.perplexity.adaptive_chunk={args.chunk}",
                f"probe.perplexity.adaptive_alpha={args.alpha}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} sweep failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def summary(client, exp: str, name: str):
    parent = point.find_sweep([(r.info.run_id, dict(r.data.tags)) for r in client.search_runs(
        [exp], filter_string=f"tags.`{point.ROLE_TAG}` = '{point.ROLE_SWEEP}'")], name)[0]
    runs, reused = tracking.sweep_runs(client, exp, parent)
    runs += reused
    base = report.baseline_run(runs)
    items = {r.info.run_id: tracking.load_items(client, tracking.origin(r)) for r in runs if tracking.done(r)}
    metric = report.decision_metric(runs)
    pts = report.points(runs, metric, "lat/tpot_ms_p50", base, items)
    windows = {r.info.run_name: (int(r.data.metrics.get(f"{metric}_windows", 0)),
                                 r.data.tags.get(point.PPL_STOP_TAG, "fixed design")) for r in runs}
    return metric, base.info.run_name, pts, windows


def qualified(pts, budget: float) -> list[str]:
    real = [p for p in pts if not p.emulated]
    return sorted(p.name for p, ok in zip(real, holm([p.p_at(budget) for p in real])) if ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--points", default="fp32,bf16,int8,int4-g64,int4-g32,nf4")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=0.005)
    ap.add_argument("--store", default=None, help="directory for the MLflow store (default: a temporary one)")
    ap.add_argument("--cache-dir", default=os.path.expanduser(os.environ.get("QUANTLAB_CACHE", "~/.cache/quantlab")))
    args = ap.parse_args()
    if not os.environ.get("QUANTLAB_DATA_DIR"):
        sys.exit("set QUANTLAB_DATA_DIR (WikiText-2 is read from there)")
    store = Path(args.store or tempfile.mkdtemp(prefix="quantlab-adaptive-"))
    uri, root = f"sqlite:///{store}/mlflow.db", str(store / "artifacts")
    secs = {d: sweep(f"ppl-{d}", args, uri, root, d == "adaptive") for d in ("fixed", "adaptive")}
    client, exp = tracking.connect(TrackingConfig(uri=uri, artifact_root=root, experiment="quantlab"))
    res = {d: summary(client, exp, f"ppl-{d}") for d in ("fixed", "adaptive")}
    metric = res["fixed"][0]
    print(f"metric {metric}, cap {args.cap} windows of {args.window} tokens, chunk {args.chunk}, "
          f"stop alpha {args.alpha}; store {store}")
    print(f"{'point':24} {'fixed':>6} {'adaptive':>8}  why it stopped")
    names = sorted(res["fixed"][3])
    for n in names:
        a = res["adaptive"][3].get(n, (0, "-"))
        print(f"{n:24} {res['fixed'][3][n][0]:>6} {a[0]:>8}  {a[1]}")
    tot_f = sum(w for w, _ in res["fixed"][3].values())
    tot_a = sum(w for w, _ in res["adaptive"][3].values())
    print(f"windows scored: fixed {tot_f}, adaptive {tot_a} + {args.cap} for the reference model "
          f"= {(tot_a + args.cap) / tot_f:.2f} of the fixed design ({tot_a / tot_f:.2f} without it); "
          f"sweep wall time fixed {secs['fixed'] / 60:.1f} min, adaptive {secs['adaptive'] / 60:.1f} min")
    for b in report.DEFAULT_BUDGETS:
        qf, qa = qualified(res["fixed"][2], b), qualified(res["adaptive"][2], b)
        print(f"within {b:.0%}: fixed qualifies {', '.join(qf) or 'none'}; adaptive {', '.join(qa) or 'none'}"
              + ("  (same)" if qf == qa else "  (DIFFERENT)"))


if __name__ == "__main__":
    main()
