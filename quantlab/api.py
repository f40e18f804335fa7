"""quantlab from Python: run a sweep, read its points as a table, decide, export.

    import quantlab
    quantlab.run("+sweep=smoke")                      # = quantlab run +sweep=smoke
    df = quantlab.results("smoke")                    # one row per point
    row = quantlab.fastest_within(df, budget=0.05)    # Holm, as the report decides
    quantlab.export(row, "exports/best")              # the artifact that was measured

Every function reads the same store as the command line
(:func:`quantlab.tracking_config.default_tracking_uri`: ``MLFLOW_TRACKING_URI``, else
``sqlite:///mlruns/mlflow.db``) unless ``tracking_uri`` is given. Errors a user
can fix raise :class:`quantlab.errors.UserError` with one line.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab import metric_names
from quantlab.tracking_config import TrackingConfig, default_tracking_uri
from quantlab.errors import UserError
from quantlab.uncertainty import ALPHA

if TYPE_CHECKING:
    import pandas

# the columns every results() frame starts with; then one column per MLflow
# metric (standard errors are the metrics ending in _stderr) and per tag (tag.<key>)
FIRST = ("point", "run_id", "measured_by", "outcome", "baseline", "emulated", "contended",
         "decision_metric", "loss", "loss_upper", "bound_method", "bound")


def run(*overrides: str, tracking_uri: str | None = None, check: bool = True,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``quantlab run OVERRIDES`` in a child process (Hydra owns its
    process: logging, working directory, launchers) and wait for it.
    ``tracking_uri`` is passed as ``MLFLOW_TRACKING_URI``. With ``check``, a
    non-zero exit raises UserError carrying the last line it printed."""
    env = dict(os.environ)
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    done = subprocess.run([sys.executable, "-m", "quantlab", *overrides], env=env, cwd=cwd,
                          capture_output=True, text=True)
    if check and done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(nothing printed)"])[-1]
        raise UserError(f"quantlab run {' '.join(overrides)} exited {done.returncode}: {last}")
    return done


def results(sweep: str = "latest", *, tracking_uri: str | None = None, experiment: str = "quantlab",
            metric: str | None = None) -> pandas.DataFrame:
    """One row per point of ``sweep`` (latest, a sweep name, or its parent run
    id), with the columns :data:`FIRST`, then every logged metric and tag.

    ``loss``/``loss_upper``: the point's loss on the decision metric against
    the sweep's baseline and its 95 % one-sided upper bound (NaN: estimate
    only, never a pick), as the report computes them; ``bound`` holds the
    bound itself (:class:`quantlab.uncertainty.Bound`, None without one) for
    :func:`fastest_within`. ``metric``: None takes the one the sweep declared
    (else ``auto``). ``frame.attrs`` records the sweep, its parent run id,
    the tracking URI, and the declared metric, budgets and alpha."""
    import pandas

    from quantlab import point, report, tracking

    uri = tracking_uri or default_tracking_uri()
    tracker = tracking.connect(TrackingConfig(uri=uri, experiment=experiment, artifact_root=None))
    parent = tracker.find_sweep(sweep)
    runs, reused, tags, base, items = report.sweep_data(tracker, parent)
    said = report.verdict.declared(tags)
    budgets = tuple(said.budgets) if said else report.verdict.DEFAULT_BUDGETS
    latency = report.verdict.latency_half(tracker, parent, tags, said, said.halves()[1] if said else 0.0)
    metric = report.metric.decision_metric(runs, metric or (said.metric if said else "auto"), base, items, budgets,
                                           said.halves()[0] if said else ALPHA)
    again = {r.id for r in reused}
    rows = []
    for r in runs:
        is_base = base is not None and r.id == base.id
        lo = report.metric.run_loss(r, metric, base, items)
        bounded = lo is not None and lo.bounded
        rows.append({
            "point": r.name, "run_id": r.id, "measured_by": r.origin,
            "outcome": "reused" if r.id in again else r.tags.get(point.OUTCOME_TAG, r.status.lower()),
            "baseline": is_base, "emulated": r.tags.get(point.EMULATED_TAG) == "true",
            "contended": point.CONTENDED_TAG in r.tags, "decision_metric": metric,
            "loss": lo.value if lo is not None else math.nan, "loss_upper": lo.upper if bounded else math.nan,
            "bound_method": lo.bound.method if lo is not None else "", "bound": lo.bound if bounded else None,
            **dict(r.metrics),
            **{f"tag.{k}": v for k, v in r.tags.items() if not k.startswith("mlflow.")},
        })
    frame = pandas.DataFrame(rows, columns=None if rows else list(FIRST))
    frame.attrs.update(sweep=tags.get(point.SWEEP_TAG, sweep), parent_run_id=parent, tracking_uri=uri,
                       experiment=experiment, metric=metric,
                       budgets=budgets, alpha=said.alpha if said else ALPHA, decision=said, latency=latency)
    return frame


def fastest_within(frame: pandas.DataFrame, budget: float, *, alpha: float | None = None,
                   cost: str = metric_names.TPOT_P50, include_emulated: bool = False) -> pandas.Series | None:
    """The row of the point the report picks within ``budget`` among the
    rows given that have a loss and a cost (filter the frame first to decide
    among fewer): shown within it by closed testing at family-wise ``alpha``
    over those rows and the sweep's budgets (:func:`quantlab.pareto.fastest_within`),
    then the lowest ``cost``; for the TPOT, the re-timing's claim where the
    sweep re-timed its candidates (:mod:`quantlab.retime`). None when none
    is shown within. ``alpha`` None: the loss half's share of the sweep's
    declared one (``frame.attrs``), else 0.05."""
    from quantlab import report
    from quantlab.pareto import Point, fastest_within as decide

    if cost not in frame.columns:
        raise UserError(f"no column {cost!r} in this frame (a cost such as {metric_names.TPOT_P50}, {metric_names.WEIGHT_MB})")
    latency = frame.attrs.get("latency")
    retimed = cost == metric_names.TPOT_P50 and latency is not None and latency.retimed is not None
    said = frame.attrs.get("decision")
    if alpha is None:
        alpha = said.halves()[0] if said is not None else frame.attrs.get("alpha", ALPHA)
    pts = {}
    for i, row in frame.iterrows():
        if math.isnan(row["loss"]) or row[cost] is None or math.isnan(row[cost]):
            continue
        bound = row["bound"]
        pts[i] = Point(row["point"], float(row[cost]), float(row["loss"]), bool(row["emulated"]),
                       bound.upper if bound is not None else None, bound.p_value if bound is not None else None,
                       row["bound_method"], bool(row["contended"]),
                       upper_at=bound.upper_at if bound is not None else None)
    rec = decide(list(pts.values()), budget, include_emulated, alpha, budgets=frame.attrs.get("budgets", ()))
    if rec.point is None:
        return None
    if retimed:
        figure = report.verdict.TIE_BREAKS.get(latency.tie_break)
        rank = {r["point"]: float(r.get(figure, math.inf)) if figure else math.inf for _, r in frame.iterrows()}
        rec, _ = report.verdict.with_latency(rec, latency, rank)
    row = frame.loc[next(i for i, p in pts.items() if p.name == rec.point.name)]
    row.attrs = dict(frame.attrs)  # where it came from, for export()
    return row


def export(row: pandas.Series | str, out: str | Path, *, fmt: str = "checkpoint", force: bool = False,
           register: str | None = None, tracking_uri: str | None = None, experiment: str | None = None) -> Path:
    """Write the point of ``row`` (a :func:`results` row, or a run id) to
    ``out`` as ``quantlab export --run`` does: rebuilt from the run that
    measured it and checked by a round trip. The row's store is used unless
    ``tracking_uri`` is given. Returns ``out``."""
    from quantlab.export_cli import export as write

    if isinstance(row, str):
        run_id, attrs = row, {}
    else:
        run_id, attrs = row["measured_by"], getattr(row, "attrs", {}) or {}
    return write(Path(out), run=run_id, fmt=fmt, force=force, register=register,
                 tracking_uri=tracking_uri or attrs.get("tracking_uri"),
                 experiment=experiment or attrs.get("experiment", "quantlab"))
