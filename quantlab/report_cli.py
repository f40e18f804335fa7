"""``quantlab report``: the command line of :mod:`quantlab.report` (``python -m
quantlab.report`` runs it too, after importing the report's modules: seconds).

It parses the arguments and finds the sweep or point to report in the store
(:mod:`quantlab.store_read`: the standard library alone where the store is a
local SQLite file) before anything heavy is imported, so that a name that is
not there, or a store that is not there, is refused in one line within about
a second, and nothing is created. Only then are the report's modules (MLflow,
SciPy, matplotlib) imported and the report built.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quantlab.tracking_config import default_tracking_uri
from quantlab.errors import UserError
from quantlab.point import find_report
from quantlab.store_read import open_store


def _budget_list(text: str) -> tuple[float, ...]:
    """``--budgets 0.01,0.05``: positive numbers, else argparse's one-line error."""
    try:
        out = tuple(float(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers, e.g. 0.01,0.05") from None
    if not out or any(b <= 0 for b in out):
        raise argparse.ArgumentTypeError(f"{text!r}: budgets must be > 0")
    return out


def main(argv: list[str] | None = None, prog: str = "quantlab report") -> int:
    """``quantlab report [--sweep latest|NAME|RUN_ID] ...``: the report of a
    sweep (its table, decision and plots, logged to its parent run) or of a
    point run alone. Exit status 2 with one line when there is nothing to
    report."""
    ap = argparse.ArgumentParser(prog=prog, description=main.__doc__.split(":")[0])
    ap.add_argument("--tracking-uri", default=default_tracking_uri(),
                    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db)")
    ap.add_argument("--experiment", default="quantlab")
    ap.add_argument("--sweep", default="latest", help="latest (the newest sweep, or point run alone), a sweep "
                    "name, a parent run id, or the run id of a point run alone")
    ap.add_argument("--metric", default=None, help="decision metric (auto, fid/kl_mean, recovery/acc/...); "
                    "default: the one the sweep declared (decision.metric); another is reported as post hoc")
    ap.add_argument("--budgets", type=_budget_list, default=None,
                    help="comma-separated loss budgets; default: those declared (decision.budgets)")
    ap.add_argument("--alpha", type=float, default=None,
                    help="family-wise error per budget; default: the one declared (decision.alpha)")
    ap.add_argument("--objective", default="auto", help="what a budget's pick maximises: auto (capacity where the "
                    "load probe ran, else tpot), tpot (lowest decode latency), capacity (highest lower bound of "
                    "req/s under the SLOs)")
    ap.add_argument("--out", default=None, help="directory for report.md, pareto.png, pareto.html")
    ap.add_argument("--no-log", action="store_true", help="do not write to the parent run")
    args = ap.parse_args(argv)
    try:
        try:
            is_sweep, run_id = find_report(open_store(args.tracking_uri, args.experiment).top_level(), args.sweep)
        except LookupError as e:
            raise UserError(str(e)) from None
        from quantlab import report, tracking
        from quantlab.tracking_config import TrackingConfig

        tracker = tracking.connect(TrackingConfig(uri=args.tracking_uri, experiment=args.experiment,
                                                  artifact_root=None))
        out = Path(args.out) if args.out else None
        # build() checks the objective before it writes anything
        print(report.build(tracker, run_id, args.metric, args.budgets, out, not args.no_log, args.objective,
                           args.alpha) if is_sweep else report.point_report(tracker, run_id, out, not args.no_log))
    except UserError as e:
        print(f"quantlab.report: {e}", file=sys.stderr)
        return 2
    return 0
