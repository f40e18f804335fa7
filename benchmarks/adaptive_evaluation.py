"""Adaptive evaluation beside the fixed design: the same points, the same
store, the perplexity windows and lm-eval documents each scored, and the
points each design qualifies per budget and metric.

Runs two sweeps of ``python -m quantlab`` (the headline probe, the cache
probe off): ``fixed`` scores ``--cap`` windows and ``--limit`` documents of
each task per point; ``adaptive`` scores ``--chunk`` windows and
``--doc-chunk`` documents a look until every budget is decided against the
reference model (``probe.perplexity.adaptive=true``,
``probe.accuracy.adaptive=true``). Prints per point what it scored and why
it stopped, and per budget and metric (the perplexity the report decides on,
then each task's ``acc_norm``) the points Holm's rule qualifies in each
design (the decision adaptivity can change; the pick among them is by
latency, timed anew in each sweep). The reference model's own windows and
documents (scored once, cached) are counted in the adaptive totals, once:
a point identical to the reference scores them for the cache and itself.

    QUANTLAB_DATA_DIR=../shared/data python benchmarks/adaptive_evaluation.py \
        [--points fp32,bf16,int8,int4-g64,int4-g32,nf4] [--window 512] [--cap 16] [--chunk 2] \
        [--tasks arc_easy_local,piqa_local] [--limit 200] [--doc-chunk 25]
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
from quantlab.tracking_config import TrackingConfig
from quantlab.uncertainty import holm

REPO = Path(__file__).resolve().parent.parent


def sweep(name: str, args, uri: str, root: str, adaptive: bool) -> float:
    tasks = [t for t in args.tasks.split(",") if t]
    cmd = [sys.executable, "-m", "quantlab", "-m", f"model={args.model}", f"scheme/weights={args.points}",
           "probe=headline", f"probe.accuracy.enabled={bool(tasks)}", f"probe.accuracy.tasks=[{','.join(tasks)}]",
           f"probe.accuracy.limit={args.limit}", "probe.cache.enabled=false",
           "probe.latency.repeats=2", "probe.latency.stages=false", f"probe.perplexity.window={args.window}",
           f"probe.perplexity.max_windows={args.cap}", f"sweep_name={name}", f"tracking.uri={uri}",
           f"tracking.artifact_root={root}", f"cache_dir={args.cache_dir}"]
    if adaptive:
        cmd += ["probe.perplexity.adaptive=true", f"probe.perplexity.adaptive_chunk={args.chunk}",
                f"probe.perplexity.adaptive_alpha={args.alpha}", f"probe.accuracy.adaptive={bool(tasks)}",
                f"probe.accuracy.adaptive_chunk={args.doc_chunk}", f"probe.accuracy.adaptive_alpha={args.alpha}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} sweep failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def summary(tracker: tracking.Tracker, name: str, tasks: list[str]):
    """The sweep's perplexity metric, its real points per decision metric, and
    per point the windows and documents (per task) it scored and why it stopped."""
    runs, _, _, base, items = report.sweep_data(tracker, tracker.find_sweep(name))
    metric = report.metric.decision_metric(runs)
    pts = {m: report.metric.points(runs, m, "lat/tpot_ms_p50", base, items)
           for m in [metric, *(f"acc_norm/{t}" for t in tasks)]}
    scored = {r.name: (int(r.metrics.get(f"{metric}_windows", 0)),
                                {t: len(items.get(r.id, {}).get(f"acc/{t}", [])) for t in tasks},
                                "; ".join(r.tags[k] for k in (point.PPL_STOP_TAG, point.ACC_STOP_TAG)
                                          if k in r.tags) or "fixed design") for r in runs}
    return metric, pts, scored


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
    ap.add_argument("--tasks", default="arc_easy_local,piqa_local", help="lm-eval tasks ('' for none)")
    ap.add_argument("--limit", type=int, default=200, help="documents per task: the fixed design, the cap")
    ap.add_argument("--doc-chunk", type=int, default=25)
    ap.add_argument("--report-only", action="store_true",
                    help="read the two sweeps already in --store (no new runs): the decisions with today's code")
    args = ap.parse_args()
    if not os.environ.get("QUANTLAB_DATA_DIR"):
        sys.exit("set QUANTLAB_DATA_DIR (WikiText-2 and the tasks are read from there)")
    tasks = [t for t in args.tasks.split(",") if t]
    store = Path(args.store or tempfile.mkdtemp(prefix="quantlab-adaptive-"))
    uri, root = f"sqlite:///{store}/mlflow.db", str(store / "artifacts")
    secs = {d: 0.0 if args.report_only else sweep(f"eval-{d}", args, uri, root, d == "adaptive")
            for d in ("fixed", "adaptive")}
    tracker = tracking.connect(TrackingConfig(uri=uri, artifact_root=root, experiment="quantlab"))
    res = {d: summary(tracker, f"eval-{d}", tasks) for d in ("fixed", "adaptive")}
    print(f"cap {args.cap} windows of {args.window} tokens, chunk {args.chunk}; {args.limit} documents of "
          f"{', '.join(tasks) or 'no task'}, chunk {args.doc_chunk}; stop alpha {args.alpha}; store {store}")
    print(f"{'point':24} {'windows fixed/adaptive':>23} {'documents fixed/adaptive':>25}  why it stopped")
    fixed, adaptive = res["fixed"][2], res["adaptive"][2]
    for n in sorted(fixed):
        a = adaptive.get(n, (0, {}, "-"))
        print(f"{n:24} {f'{fixed[n][0]}/{a[0]}':>23} "
              f"{f'{sum(fixed[n][1].values())}/{sum(a[1].values())}':>25}  {a[2]}")
    same = [n for n, a in adaptive.items() if point.IDENTICAL_STOP in a[2]]
    for what, i, ref in (("windows", 0, args.cap), ("documents", 1, args.limit * len(tasks))):
        tot_f = sum(v[i] if i == 0 else sum(v[i].values()) for v in fixed.values())
        tot_a = sum(v[i] if i == 0 else sum(v[i].values()) for v in adaptive.values())
        if tot_f and same:  # the reference's were that point's own, scored once (or cached before)
            print(f"{what} scored: fixed {tot_f}, adaptive {tot_a} = {tot_a / tot_f:.2f} of the fixed design "
                  f"(the reference model's are {', '.join(same)}'s, identical to it)")
        elif tot_f:
            print(f"{what} scored: fixed {tot_f}, adaptive {tot_a} + {ref} for the reference model = "
                  f"{(tot_a + ref) / tot_f:.2f} of the fixed design ({tot_a / tot_f:.2f} without it)")
    print(f"sweep wall time: fixed {secs['fixed'] / 60:.1f} min, adaptive {secs['adaptive'] / 60:.1f} min")
    for metric in res["fixed"][1]:
        for b in report.verdict.DEFAULT_BUDGETS:
            qf, qa = qualified(res["fixed"][1][metric], b), qualified(res["adaptive"][1].get(metric, []), b)
            print(f"{metric} within {b:.0%}: fixed qualifies {', '.join(qf) or 'none'}; adaptive "
                  f"{', '.join(qa) or 'none'}" + ("  (same)" if qf == qa else "  (DIFFERENT)"))


if __name__ == "__main__":
    main()
