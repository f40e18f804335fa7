"""Per-sweep report read back from MLflow: table (:mod:`.table`), the
metric that decides (:mod:`.metric`), "the fastest point within a budget"
(:mod:`.verdict`), the sections the probes declare
(:func:`quantlab.metric_names.sections`, :func:`probe_sections`), plots. Its command
line (``quantlab report``, ``python -m quantlab.report``) is
:mod:`quantlab.report_cli`."""
from __future__ import annotations

import dataclasses
import importlib
import tempfile
from pathlib import Path

from quantlab import metric_names, plots, point, records, tracking, uncertainty
from quantlab.config import DecisionConfig
from quantlab.errors import UserError
from quantlab.metric_names import SectionView
from quantlab.pareto import Recommendation
from quantlab.report import table
from quantlab.report.metric import auto_metric, information_only, points
from quantlab.report.verdict import (DEFAULT_BUDGETS, decide, declaration_text, declared, draws_text, latency_half,
                                    measured_before, objective, post_hoc)


def next_steps(runs, recs: dict[float, Recommendation], sweep: str, parent_id: str, out: Path,
               logged: bool) -> str:
    """Run ids, the export command of each recommendation, and where the
    report's files went."""
    lines = ["Runs: " + ", ".join(f"{r.name} {r.origin}" for r in runs if r.done)]
    for b, rec in recs.items():
        if rec.point is not None:
            lines.append(f"- export the {b:g} pick: `python -m quantlab.export --sweep {sweep} --budget {b:g} "
                         f"--out exports/{sweep}-{b:g}`")
    where = f"Files: {', '.join(['report.md', *(('pareto.png', 'pareto.html') if recs else ())])} in {out}"
    lines.append(where + (f", and as artifacts of the parent run {parent_id}." if logged else "."))
    return "\n".join(lines)


def probe_sections(view: SectionView, place: str) -> tuple[list[str], list[str]]:
    """The texts (those not empty) and files of every section the probes
    declare at ``place`` (:class:`quantlab.metric_names.Section`), in
    declaration order."""
    texts, files = [], []
    for sec in metric_names.sections(place):
        module, _, name = sec.function.partition(":")
        try:
            function = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise UserError(f"report section {sec.function!r} cannot be loaded: {e}") from e
        text, written = function(view)
        texts += [text] if text else []
        files += written
    return texts, files


def sweep_data(tracker: tracking.Tracker, parent_id: str):
    """``(runs, reused, parent_tags, baseline_run, items)`` of one sweep:
    its child runs as :class:`~quantlab.records.PointRecord` (the runs it
    reused last, and also in ``reused``), the
    baseline (the one the sweep named, else :func:`.table.baseline_run`) and each
    finished run's per-item scores (read from the run that measured it)."""
    own, reused = tracker.sweep_runs(parent_id)
    reused = [records.of(r) for r in reused]
    runs = [records.of(r) for r in own] + reused
    tags = tracker.tags(parent_id) or {}
    base = next((r for r in runs if r.name == tags.get(point.BASELINE_TAG)), None) or table.baseline_run(runs)
    items = {r.id: tracker.items(r.origin) for r in runs if r.done}
    return runs, reused, tags, base, items


def build(tracker: tracking.Tracker, parent_id: str, metric: str | None = None,
          budgets=None, out_dir: Path | None = None, log_to_run: bool = True,
          by: str = "auto", alpha: float | None = None) -> str:
    """Table + frontier + recommendations (by objective ``by``, see
    :func:`objective`) for one sweep; PNG/HTML plots in ``out_dir``; with
    ``log_to_run`` all of it goes to the parent run (tag ``recommended.by``)
    and the recommended child runs get a ``quantlab.recommended.<budget>`` tag.
    ``metric``, ``budgets``, ``alpha``: None takes what the sweep declared at
    launch (:func:`.verdict.declared`; else auto, 1 % and 5 %, 0.05); a choice that
    differs is said "post hoc" beside its picks and in a parent tag per budget."""
    runs, reused, tags, base, items = sweep_data(tracker, parent_id)
    said = declared(tags)
    budgets = tuple(budgets or (said.budgets if said else DEFAULT_BUDGETS))
    alpha = alpha if alpha is not None else (said.alpha if said else uncertainty.ALPHA)
    split = dataclasses.replace(said or DecisionConfig(retime_rounds=0), alpha=alpha).halves()
    metric, passed_over = auto_metric(runs, metric or (said.metric if said else "auto"), base, items, budgets,
                                      split[0])
    late = post_hoc(runs, said, metric, budgets, alpha, base, items)
    if before := measured_before(tracker, reused, said):
        late = {b: "; ".join(filter(None, (late.get(b), before))) for b in budgets}
    by = objective(runs, by)
    latency = latency_half(tracker, parent_id, tags, said, split[1])
    if any(r.done and metric in r.metrics for r in runs):
        text, recs = decide(runs, metric, budgets, base, items, by, split[0], late, latency)
    else:  # nothing to put on an accuracy axis (model=shape, probe=latency): no pick, no Pareto plot
        text, recs = (f"No point measured {metric}: a latency-only sweep (random weights or probe=latency), so no "
                      f"point is picked by loss and none is plotted against one."), {}
    text = (f"Declared at launch: {declaration_text(said)}." if said else
            "Declared at launch: nothing (a sweep from before declarations: every pick is post hoc).") + \
        (f" The metric: {passed_over}." if passed_over else "") + \
        information_only(runs, metric, base, items, budgets, split[0]) + draws_text(tags) + "\n\n" + text
    sweep = tags.get(point.SWEEP_TAG, "?")
    paired_text = table.paired_table(runs, base, items) if base is not None else ""
    times = table.time_table(runs, {r.id for r in reused})
    out = Path(out_dir or tempfile.mkdtemp(prefix="quantlab-report-"))
    out.mkdir(parents=True, exist_ok=True)
    view = SectionView(runs, out, f"quantlab sweep {sweep}", lambda r, name: tracker.download(r.origin, name))
    sections, section_files = probe_sections(view, "body")
    appendix, appendix_files = probe_sections(view, "end")
    body = (f"# Sweep {sweep} ({parent_id})\n\n{table.table(runs, {r.id for r in reused}, base, items)}\n\n"
            + (paired_text + "\n\n" if paired_text else "") + f"{text}\n\n"
            + "".join(t + "\n\n" for t in sections)
            + (times + "\n\n" if times else "") + next_steps(runs, recs, sweep, parent_id, out, log_to_run) + "\n"
            + "".join("\n" + t + "\n" for t in appendix))
    (out / "report.md").write_text(body)
    panels = {c: points(runs, metric, c, base, items) if recs else []
              for c in (metric_names.TPOT_P50, metric_names.WEIGHT_MB)}
    label = metric if (s := metric_names.spec(metric)) is not None and s.loss == "value" else \
        f"relative loss on {metric}"
    title = f"quantlab sweep {sweep}"
    if any(panels.values()):
        plots.png(panels, label, out / "pareto.png", title)
        plots.html(panels, label, out / "pareto.html", title)
    if log_to_run:
        parent = tracker.run(parent_id)
        for f in ("report.md", "pareto.png", "pareto.html", *section_files, *appendix_files):
            if (out / f).is_file():
                parent.log_files(out / f)
        by_name = {r.name: r.id for r in runs}
        for p in panels[metric_names.WEIGHT_MB]:  # the loss as a metric: the UI's charts plot it against latency
            child = tracker.run(by_name[p.name])
            child.log_metrics({metric_names.DECISION_LOSS: p.loss, metric_names.DECISION_LOSS_UPPER: p.upper})
            child.set_tags({"decision.metric": metric})
        parent.set_tags({point.RECOMMENDED_BY_TAG: by})
        for b, rec in recs.items():
            if rec.point is not None:
                name_tag, id_tag = point.recommended_tags(b)
                tracker.run(by_name[rec.point.name]).set_tags({point.recommended_point_tag(b): "true"})
                parent.set_tags({name_tag: rec.point.name, id_tag: by_name[rec.point.name],
                                 point.post_hoc_tag(b): late.get(b, "no")})
    return body


def point_report(tracker: tracking.Tracker, run_id: str, out_dir: Path | None = None,
                 log_to_run: bool = True) -> str:
    """The report of a point run alone (``quantlab run`` without ``-m``): its
    row of the table and where its time went; no loss and no pick, since
    nothing was measured beside it. ``report.md`` in ``out_dir`` and, with
    ``log_to_run``, on the run."""
    run = records.of(tracker.get(run_id))
    times = table.time_table([run])
    body = (f"# Point {run.name} ({run_id})\n\n"
            "A point run alone: no other point to compare it with, so no loss and no pick. A sweep decides: "
            "`quantlab run -m scheme/weights=bf16,int8,...` or `quantlab run +sweep=NAME`.\n\n"
            f"{table.table([run])}\n\n" + (times + "\n\n" if times else ""))
    out = Path(out_dir or tempfile.mkdtemp(prefix="quantlab-report-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(body)
    if log_to_run:
        tracker.run(run_id).log_files(out / "report.md")
    return body + f"Files: report.md in {out}" + (f", and as an artifact of the run {run_id}." if log_to_run else ".")
