"""Hydra callback that brackets a multirun with an MLflow parent run.

``on_multirun_start`` opens the parent run and exports its id in
``QUANTLAB_PARENT_RUN_ID`` (inherited by local launcher workers; with the
Ray launcher also put in the tasks' ``runtime_env``, which reaches workers
on other nodes); each point's child
run points at it. ``on_multirun_end`` prints and logs the summary table, closes
the parent, and exits non-zero when any point failed.
"""
from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from quantlab import capabilities, point, records, report, retiming, tracking
from quantlab.config import DecisionConfig
from quantlab.tracking_config import TrackingConfig
from quantlab.digest import write_atomic
from quantlab.errors import UserError

log = logging.getLogger("quantlab")
RAY_LAUNCHER = "hydra_plugins.quantlab_ray_launcher.RayLauncher"


def _tracking_cfg(config: DictConfig) -> TrackingConfig:
    return TrackingConfig(**OmegaConf.to_container(config.tracking, resolve=True))


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        try:
            tracker = tracking.connect(_tracking_cfg(config))
        except UserError as e:
            print(f"quantlab: {e}", file=sys.stderr)
            sys.exit(2)
        sweep = config.get("sweep_name", "adhoc")
        params = {f"sweep.{k}": str(v) for k, v in config.hydra.sweeper.params.items()} \
            if config.hydra.sweeper.get("params") else {}
        params["sweep.overrides"] = " ".join(config.hydra.overrides.task) or "-"
        name = f"sweep:{sweep} {time.strftime('%Y-%m-%d %H:%M:%S')}"
        seed, source = _eval_seed(tracker, config, sweep, params["sweep.overrides"])
        tags = {point.SWEEP_TAG: sweep, point.ROLE_TAG: point.ROLE_SWEEP, point.EVAL_SEED_TAG: str(seed),
                point.EVAL_SEED_FROM_TAG: source,
                "git_commit": tracking.git_commit(), **tracking.versions(), **_declared(config)}
        run = tracker.start(name, tags, params=params)
        parent = run.id
        os.environ[point.PARENT_ENV] = parent
        exported = {point.PARENT_ENV: parent}
        if source != "pinned":  # the points read it (conf/config.yaml); taken out again at the sweep's end
            os.environ[point.EVAL_SEED_ENV] = exported[point.EVAL_SEED_ENV] = _set_here[parent] = str(seed)
        if config.hydra.launcher.get("_target_", "") == RAY_LAUNCHER:  # workers on other nodes inherit nothing
            with open_dict(config):
                init = config.hydra.launcher.ray.init
                given = init.get("runtime_env")
                env = OmegaConf.to_container(given, resolve=True) if given is not None else {}
                env.setdefault("env_vars", {}).update(exported)
                init.runtime_env = env
        _log_capabilities(run)
        log.info("sweep %s: parent run %s in %s; evaluation draws: seed %d (%s)", sweep, parent,
                 config.tracking.uri, seed, source)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        parent = os.environ.pop(point.PARENT_ENV, None)
        if _set_here.pop(parent, None) is not None:
            os.environ.pop(point.EVAL_SEED_ENV, None)
        if parent is None:
            return
        tracker = tracking.connect(_tracking_cfg(config), tracking.SERVER_WAIT_S)
        runs, reused = tracker.sweep_runs(parent)
        _log_recovery(tracker, parent, runs, reused, config.get("recovery_baseline", "auto"))
        retiming.after_sweep(tracker, parent)
        text = report.build(tracker, parent)  # reads the runs again, recovery included
        print("\n" + text, flush=True)
        failed = [r for r in runs if r.data.tags.get(point.OUTCOME_TAG) == "failed"]
        counts = {o: sum(r.data.tags.get(point.OUTCOME_TAG) == o for r in runs)
                  for o in ("finished", "skipped", "failed")}
        counts["reused"] = len(reused)
        run = tracker.run(parent)
        run.log_metrics({f"points_{k}": v for k, v in counts.items()})
        run.set_status("FAILED" if failed else "FINISHED")
        log.info("sweep done: %s", ", ".join(f"{v} {k}" for k, v in counts.items()))
        if failed:
            sys.exit(1)


_set_here: dict[str, str] = {}  # parent run -> the eval seed this process put in the environment for it


def _eval_seed(tracker: tracking.Tracker, config: DictConfig, sweep: str, overrides: str) -> tuple[int, str]:
    """``(seed, where it came from)`` of the sweep's evaluation draws:
    ``eval_seed`` as given (``pinned``: on the command line, in the sweep's
    preset or in $QUANTLAB_EVAL_SEED); else the seed of this sweep's newest
    parent when that one did not finish (killed, or a point failed) and ran
    the same overrides (``resumed <run id>``): its finished points are reused
    with their windows; else a fresh one (``drawn``), so that two sweeps are
    two independent looks at the evaluation data."""
    given = config.get("eval_seed")
    if given is not None:
        return int(given), "pinned"
    last = tracker.last_sweep(sweep)
    if last is not None and last.info.status != "FINISHED" and point.EVAL_SEED_TAG in last.data.tags \
            and last.data.params.get("sweep.overrides") == overrides:
        return int(last.data.tags[point.EVAL_SEED_TAG]), f"resumed {last.info.run_id}"
    return random.SystemRandom().randrange(2 ** 31), "drawn"


def _declared(config: DictConfig) -> dict[str, str]:
    """The decision declared before any point runs, as the parent's tags
    (:data:`quantlab.point.DECLARED_TAGS`): what the report decides by default."""
    d = DecisionConfig(**OmegaConf.to_container(config.get("decision") or {}, resolve=True))
    t = point.DECLARED_TAGS
    return {t["metric"]: d.metric, t["budgets"]: ",".join(f"{float(b):g}" for b in d.budgets),
            t["alpha"]: f"{float(d.alpha):g}", t["latency_share"]: f"{float(d.latency_share):g}",
            t["retime_rounds"]: str(d.retime_rounds), t["retime_points"]: str(d.retime_points),
            t["tie_break"]: d.tie_break, t["retime_instance_sd"]: f"{float(d.retime_instance_sd):g}"}


def _log_recovery(tracker: tracking.Tracker, parent: str, runs, reused, choice: str) -> None:
    """Log ``recovery/*`` on this sweep's own finished points against its
    baseline (which may be a reused point). Reused runs keep the recovery of the
    sweep that ran them: the report computes its own against this baseline."""
    own = [records.of(r) for r in runs]
    base = report.table.baseline_run(own + [records.of(r) for r in reused], choice)
    if base is None:
        log.warning("no baseline point %r finished: recovery not computed", choice)
        return
    tracker.run(parent).set_tags({point.BASELINE_TAG: base.name})
    for r in own:
        if r.tags.get(point.OUTCOME_TAG) == "finished":
            rec = report.table.recovery(r.metrics, base.metrics)
            if rec:
                tracker.run(r.id).log_metrics(rec)


def _log_capabilities(parent: tracking.Run) -> None:
    """The scheme x target matrix of this environment, on the parent run. Made
    in a subprocess (Hydra is initialised here and the matrix composes every
    preset: 8-15 s on 2 cores), once per :func:`capabilities.environment_key`,
    kept under ``$QUANTLAB_CACHE/capabilities/`` (the matrix is of the
    installed environment, not of the sweep's config)."""
    root = Path(os.environ.get("QUANTLAB_CACHE", "~/.cache/quantlab")).expanduser() / "capabilities"
    cached = root / f"{capabilities.environment_key()}.md"
    if cached.is_file():
        parent.log_text(cached.read_text(), "capabilities.md")
        return
    proc = subprocess.run([sys.executable, "-m", "quantlab.capabilities"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        log.warning("capability matrix not logged: %s", (proc.stderr.strip().splitlines() or ["?"])[-1])
        return
    parent.log_text(proc.stdout, "capabilities.md")
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(cached, proc.stdout)
