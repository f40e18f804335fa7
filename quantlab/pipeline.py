"""run_point(cfg): one sweep point, top to bottom.

config -> support check -> load model -> [calibrate] -> weight scheme -> KV scheme
       -> engine for the target -> the registered probes (quantlab.probes.runner)
       -> log what was measured to MLflow (one step)

Probes talk to the engine only (``quantlab.engines``) and return results
(:mod:`quantlab.probes.base`); the ``Measurement`` they fill is logged once,
at the end. A new probe is a class registered under the ``quantlab.probes``
entry points: nothing here changes.

A point that its target cannot run is logged as skipped with the reason; a
point that raises is logged as FAILED with its traceback, and the caller (the
sweep) goes on with the next one.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

from quantlab import artifacts, models, point, provenance, targets, tracking
from quantlab.compose import config_dict
from quantlab.config import RunConfig
from quantlab.errors import UserError
from quantlab.export import state as quantized_state
from quantlab.measurement import Measurement
from quantlab.probes import runner, size
from quantlab.schemes import qlinear
from quantlab.schemes.registry import Applied, ApplyContext, kv_handler, weights_handler

log = logging.getLogger("quantlab")

@dataclass
class PointResult:
    run_id: str
    name: str
    outcome: str  # finished | skipped | failed | reused
    reason: str = ""


def identify(cfg: RunConfig) -> tuple[point.Identity, dict]:
    """The point's identity and its plain-dict config, computed once per point."""
    as_dict = config_dict(cfg)
    return point.identify(cfg, as_dict, provenance.code_version(), provenance.data_fingerprint(cfg)), as_dict


def point_hash(cfg: RunConfig) -> str:
    """Stable id of what a point measures (not where it is logged or cached):
    its config, quantlab's code version and the sha256 of the data files it reads."""
    return identify(cfg)[0].hash


def run_point(cfg: RunConfig, parent: str | None = None) -> PointResult:
    """Run and log one point (a child of sweep run ``parent`` when given).
    Never raises for a point-level failure; ``cfg`` is the typed config
    :func:`quantlab.cli.to_point` checked.

    A point whose identical config (``point_hash``) already has a finished run
    is not run again unless ``cfg.force``; runs left RUNNING by a dead process
    are marked KILLED first, so they are redone.
    """
    tracker = _connect(cfg, parent)
    ident, as_dict = identify(cfg)
    name = ident.name
    for dead in tracker.reap_dead():
        log.warning("run %s was left RUNNING by a dead process: marked KILLED", dead)
    # timings are only reused from this host; accuracy-only points from any
    same_host = provenance.host_id() if cfg.probe.latency.enabled else None
    if not cfg.force and (done := tracker.find_finished(ident.hash, same_host)):
        log.info("[%s] already finished as run %s on host %s: reused (force=true re-runs)", name,
                 done.info.run_id, done.data.tags.get(point.HOST_FINGERPRINT_TAG, "?"))
        if parent:
            tracker.link_reused(parent, done, cfg.sweep_name)
        return PointResult(done.info.run_id, name, "reused")
    run = tracker.start(name, provenance.run_tags(cfg, ident), parent=parent,
                        params=provenance.run_params(cfg, ident, as_dict))
    run.log_text(yaml.safe_dump(as_dict, sort_keys=False), "config.yaml")
    if cfg.isolation == "process":
        return _run_in_subprocess(cfg, run, name)
    return _execute(cfg, run, name)


def _connect(cfg: RunConfig, parent: str | None) -> tracking.Tracker:
    """The point's tracking store. A server that stops
    answering is waited for (:data:`quantlab.tracking.SERVER_WAIT_S`) only
    when it answered before: under a sweep (whose start reached it) or
    earlier in this process; before anything started, an unreachable server
    is refused at once in one line (a wrong URI must not cost minutes)."""
    known = parent or tracking.answered(cfg.tracking.uri)
    return tracking.connect(cfg.tracking, tracking.SERVER_WAIT_S if known else 0.0)


def record_lost(cfg: RunConfig, reason: str, parent: str | None = None) -> PointResult:
    """A point whose worker or node died under it (the launcher saw its task
    fail, so nothing on that worker could log it): its RUNNING run under this
    sweep, or a new run when it never started one, ends FAILED with
    ``reason``. A rerun of the sweep redoes it (a failed run is never reused)."""
    tracker = _connect(cfg, parent)
    ident, as_dict = identify(cfg)
    # RUNNING, or already KILLED by another point's reap_dead (the lost worker ran on this host)
    found = tracker.find_running(ident.hash, parent) or (
        tracker.find_running(ident.hash, parent, "KILLED") if parent else None)
    run = tracker.run(found.info.run_id) if found is not None else tracker.start(
        ident.name, provenance.run_tags(cfg, ident), parent=parent, params=provenance.run_params(cfg, ident, as_dict))
    log.error("[%s] failed: %s", ident.name, reason)
    run.end("failed", reason)
    return PointResult(run.id, ident.name, "failed", reason)


def _execute(cfg: RunConfig, run: tracking.Run, name: str) -> PointResult:
    """Measure, log what was measured (also after a failure) and close the run,
    turning any exception into a FAILED run."""
    m = Measurement()
    try:
        with m.timed("point"):
            outcome, reason = _measure(cfg, name, m)
    except (UserError, ValueError) as e:
        outcome, reason = "failed", _first_line(e) or type(e).__name__
        log.error("[%s] failed: %s", name, reason)
    except Exception as e:  # noqa: BLE001 - one point must never kill the sweep
        outcome, reason = "failed", f"{type(e).__name__}: {_first_line(e)}"
        m.artifacts["traceback.txt"] = traceback.format_exc()
        log.error("[%s] failed: %s (traceback logged to the run)", name, reason)
    if "size/bits_per_weight" in m.metrics:  # as a param too: the UI's parallel coordinates take params
        m.params["bits_per_weight"] = f"{m.metrics['size/bits_per_weight']:.2f}"
    run.log_measurement(m)
    run.end(outcome, reason)
    return PointResult(run.id, name, outcome, reason)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _child(cfg: RunConfig, run_id: str, name: str) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    _execute(cfg, _connect(cfg, None).run(run_id), name)


def _run_in_subprocess(cfg: RunConfig, run: tracking.Run, name: str) -> PointResult:
    """Run the point in a fresh (spawned) process: clean memory figures, no
    compiled graphs leaking between points, and a crash (OOM kill, segfault)
    ends only that point's run."""
    proc = multiprocessing.get_context("spawn").Process(target=_child, args=(cfg, run.id, name))
    proc.start()
    proc.join()
    now = run.get()
    if now.info.status == "RUNNING":
        code = proc.exitcode
        why = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit status {code}"
        reason = f"point process died ({why}; out of memory?)"
        log.error("[%s] failed: %s", name, reason)
        run.end("failed", reason)
        return PointResult(run.id, name, "failed", reason)
    outcome = now.data.tags.get(tracking.OUTCOME_TAG, "failed")
    return PointResult(run.id, name, outcome, now.data.tags.get(tracking.REASON_TAG, ""))


def _measure(cfg: RunConfig, name: str, m: Measurement) -> tuple[str, str]:
    """The straight line of one point; returns (outcome, reason), fills ``m``."""
    _check_node(cfg)
    target = targets.get(cfg.target)
    weights, kv = cfg.scheme.weights, cfg.scheme.kv
    if why := artifacts.mismatch(cfg):
        log.warning("[%s] skipped: %s", name, why)
        return "skipped", why
    verdict = target.supports(weights, kv)
    if not verdict.runnable:
        log.warning("[%s] skipped: %s", name, verdict.reason)
        return "skipped", verdict.reason
    with built(cfg, name, m, target=target, verdict=verdict) as (engine, model, tok, target):
        runner.run(dict(cfg=cfg, name=name, engine=engine, tokenizer=tok, model=model,
                        serves_export=target.serves_export), m)
    log.info("[%s] done: %s", name, _headline(m.metrics))
    return "finished", ""


@contextlib.contextmanager
def built(cfg: RunConfig, name: str, m: Measurement, state: str | None = None, target=None, verdict=None):
    """``(engine, model, tokenizer, target)`` of a point the target supports,
    closed on exit: load, [calibrate], weight scheme, KV scheme, engine, with
    what each step says recorded in ``m``. ``state``: the sha256 of the
    quantized model the point kept (:mod:`quantlab.export.state`): on a
    target that runs the model itself, that model when the cache still
    holds it, instead of quantizing (and calibrating) again. ``target``:
    the point's target where the caller made it already, ``verdict`` its
    answer to ``supports`` where the caller asked it (asked once a point)."""
    target = target or targets.get(cfg.target)
    weights, kv = cfg.scheme.weights, cfg.scheme.kv
    verdict = verdict or target.supports(weights, kv)
    with target.session():
        log.info("[%s] loading model %s", name, cfg.model.name)
        with m.timed("model"):
            model, tok = models.load(cfg.model, cfg.cache_dir)
        n_params = size.count_params(model)
        if not weights.KEEPS_ARTIFACT and (art := artifacts.dequantized_from(cfg.model)) is not None:
            m.tags[artifacts.DEQUANTIZED_TAG] = art.description  # e.g. SmolLM2's offline Q4_1
        ctx = ApplyContext(hw=target.hardware(), tokenizer=tok, cache_dir=cfg.cache_dir,
                           data_dir=cfg.data_dir, seed=cfg.seed)
        kept = quantized_state.load(cfg.cache_dir, state)[0] if state and not target.serves_export else None
        with m.timed("apply"):  # calibration included
            if kept is not None:
                log.info("[%s] the quantized model it kept (sha256 %s...)", name, state[:12])
                model, applied_w = kept, Applied("kept quantized state", emulated=False)
            else:
                log.info("[%s] applying %s (%s)", name, weights.short_name(), verdict.status)
                applied_w = target.apply_weights(model, weights, ctx)
                if weights.calibration_set() is not None and \
                        weights_handler(weights).mapping("checkpoint", weights).ok:
                    m.tags.update(quantized_state.keep(model, cfg.cache_dir))  # what its export writes
            applied_kv = kv_handler(kv).apply(model, kv, ctx)
        compute = model.get_input_embeddings().weight.dtype
        widened = qlinear.widen(model, compute)
        m.tags.update({"emulated": str(applied_w.emulated or applied_kv.emulated).lower(),
                       "support": verdict.status, "support.reason": verdict.reason or "-",
                       "backend.weights": applied_w.backend, "backend.kv": applied_kv.backend,
                       **applied_w.tags, **applied_kv.tags, **qlinear.widened_tags(widened, compute)})
        m.metrics.update({**size.weight_stats(model, n_params), **applied_w.metrics})
        m.metrics["size/embedding_unread_bytes"] = size.embedding_unread_bytes(model, cfg.probe.latency.batch_size)
        with m.timed("engine"):
            engine = target.engine(model, applied_kv, tok)
        try:
            m.metrics.update({"compile/warmup_s": engine.ready_s,
                              "compile/enabled": float(bool(getattr(cfg.target, "compile", False))),
                              **engine.metrics})
            yield engine, model, tok, target
        finally:
            engine.close()


def _check_node(cfg: RunConfig) -> None:
    """On a Ray worker, a data directory this node cannot see fails the point:
    here a missing directory would skip its accuracy probes with a tag, and a
    sweep whose nodes differ would compare points measured on different data.
    (On the machine that composed the sweep a missing one skips them, as ever.)"""
    ray = sys.modules.get("ray")
    if cfg.data_dir and ray is not None and ray.is_initialized() and not Path(cfg.data_dir).expanduser().is_dir():
        raise UserError(f"data_dir {cfg.data_dir} is not on this node ({socket.gethostname()}): every node of the "
                        "cluster needs it at the same path (a shared or copied directory)")


def _headline(m: dict[str, float]) -> str:
    parts = [f"{m['size/weight_mb']:.1f} MB"]
    if "fid/kl_mean" in m:
        parts.append(f"KL {m['fid/kl_mean']:.2e}, top1 {m['fid/top1_agree']:.3f}")
    if "lat/tpot_ms_p50" in m:
        parts.append(f"TPOT p50 {m['lat/tpot_ms_p50']:.1f} ms, {m['tput/decode_tok_s']:.1f} tok/s")
    return "; ".join(parts)
