"""Export a sweep point as a checkpoint that transformers (and vLLM) load.

    python -m quantlab.export --run RUN_ID --out exports/int8
    python -m quantlab.export --run RUN_ID --format gguf --out exports/int4.gguf
    python -m quantlab.export --sweep fp8_vs_int4 --budget 0.01 --out exports/best --register smollm2-best

This module is the command line: it checks ``--out``, the run (or the sweep's
recommendation for the budget) and whether the point's scheme has the format,
with the standard library only where the store is a local SQLite file, so that
bad input fails in one line within a second or two, before torch, MLflow or the
model load. The work itself (rebuild, write, round trip) is
:mod:`quantlab.export_run`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from quantlab.errors import UserError
from quantlab.export.formats import FORMATS
from quantlab.point import (REUSED_FROM_TAG, SCHEME_TAG, exportable_tag, find_sweep, post_hoc_tag, recommended_budgets,
                            recommended_tags)
from quantlab.store_read import Store, open_store
from quantlab.tracking_config import default_tracking_uri


def resolve(store: Store, run: str | None, sweep: str | None, budget: float, fmt: str) -> str:
    """The id of the run that measured the point to export: ``run``, or the
    point ``sweep`` recommended within ``budget`` (followed to the run that
    measured it when the sweep reused it). Refuses, in one line, an unknown
    run or sweep, a budget without a recommendation (listing those with one)
    and a point whose scheme has no ``fmt`` representation."""
    if not run and not sweep:
        raise UserError("give --run RUN_ID or --sweep NAME")
    run_id = run or _recommended(store, sweep, budget)
    tags = store.tags(run_id)
    if tags is None:
        raise UserError(f"no run {run_id!r} in this store" if run else
                        f"sweep {sweep!r} recommends run {run_id}, which is no longer in this store")
    if REUSED_FROM_TAG in tags:  # a light run of a sweep that reused the point: the run that measured it
        run_id = tags[REUSED_FROM_TAG]
        tags = store.tags(run_id) or tags
    verdict = tags.get(exportable_tag(fmt), "")
    if verdict.startswith("no: "):
        raise UserError(f"{fmt} export of {tags.get(SCHEME_TAG, run_id)} is not supported ({verdict[4:]})")
    return run_id


def _recommended(store: Store, sweep: str, budget: float) -> str:
    try:
        _, tags = find_sweep(store.sweeps(), sweep)
    except LookupError as e:
        raise UserError(str(e)) from None
    chosen = tags.get(recommended_tags(budget)[1])
    if chosen and (why := tags.get(post_hoc_tag(budget), "no")) != "no":
        print(f"quantlab.export: post hoc: the {budget:g} pick of sweep {sweep!r} was not declared at launch "
              f"({why})", file=sys.stderr)
    if not chosen:
        budgets = recommended_budgets(tags)
        raise UserError(f"sweep {sweep!r} has no recommendation for budget {budget:g}; "
                        f"budgets with one: {', '.join(budgets) or 'none'} "
                        f"(quantlab report --sweep {sweep} --budgets {budget:g} makes one)")
    return chosen


def main(argv: list[str] | None = None, prog: str = "python -m quantlab.export") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="MLflow run id of the point")
    ap.add_argument("--sweep", help="sweep name, latest, or parent run id: export its recommended point")
    ap.add_argument("--budget", type=float, default=0.01, help="with --sweep: which recommendation")
    ap.add_argument("--out", help="directory (or .gguf file with --format gguf) to write; must not exist "
                                  "unless --force")
    ap.add_argument("--format", choices=FORMATS, default="checkpoint",
                    help="checkpoint: compressed-tensors / safetensors directory; gguf: one llama.cpp file")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--register", help="register the export in the MLflow Model Registry under this name "
                                       "(copies the checkpoint into the run's artifacts, export/)")
    ap.add_argument("--tracking-uri", default=default_tracking_uri(),
                    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db)")
    ap.add_argument("--experiment", default="quantlab")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    try:
        if not args.out:
            raise UserError("--out DIR is required")
        export(Path(args.out), run=args.run, sweep=args.sweep, budget=args.budget, fmt=args.format,
               force=args.force, register=args.register, tracking_uri=args.tracking_uri, experiment=args.experiment)
    except UserError as e:
        print(f"quantlab.export: {e}", file=sys.stderr)
        return 2
    return 0


def export(out: Path, *, run: str | None = None, sweep: str | None = None, budget: float = 0.01,
           fmt: str = "checkpoint", force: bool = False, register: str | None = None,
           tracking_uri: str | None = None, experiment: str = "quantlab") -> Path:
    """Write run ``run`` (or sweep ``sweep``'s pick within ``budget``) to
    ``out`` in format ``fmt`` (:data:`FORMATS`), rebuilt from the run's
    config and checked by a round trip; returns ``out``. Raises UserError,
    before any model loads, for an existing ``out`` (without ``force``), an
    unknown run or sweep, or a scheme without that format."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to replace it")
    uri = tracking_uri or default_tracking_uri()
    run_id = resolve(open_store(uri, experiment), run, sweep, budget, fmt)
    from quantlab import tracking
    from quantlab.tracking_config import TrackingConfig
    from quantlab import export_run as work

    source = tracking.connect(TrackingConfig(uri=uri, experiment=experiment, artifact_root=None)).run(run_id)
    if fmt == "gguf":
        work.export_gguf(source, out, force)
    else:
        work.export_run(source, out, force, register)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
