"""run_point(cfg): one sweep point, top to bottom.

config -> support check -> load model -> [calibrate] -> weight scheme -> KV scheme
       -> compile for target -> fidelity probe -> latency probe -> log to MLflow

A point that its target cannot run is logged as skipped with the reason; a
point that raises is logged as FAILED with its traceback, and the caller (the
sweep) goes on with the next one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import signal
import traceback
from dataclasses import dataclass

import torch
import yaml

from quantlab import hardware, models, targets, tracking
from quantlab.config import RunConfig
from quantlab.errors import UserError
from quantlab.probes import accuracy, corpus, energy, fidelity, latency, perplexity, roofline, size, stages
from quantlab.probes import cache as cache_probe
from quantlab.schemes.registry import ApplyContext, kv_handler

log = logging.getLogger("quantlab")

PARENT_ENV = "QUANTLAB_PARENT_RUN_ID"
ISOLATION = ("none", "process")


@dataclass
class PointResult:
    run_id: str
    name: str
    outcome: str  # finished | skipped | failed | reused
    reason: str = ""


def config_dict(cfg: RunConfig) -> dict:
    """Plain-dict form of the config; polymorphic slots carry their type name."""
    d = dataclasses.asdict(cfg)
    d["scheme"] = {"weights": cfg.scheme.weights.to_dict(), "kv": cfg.scheme.kv.to_dict()}
    d["target"] = {"type": type(cfg.target).__name__, **dataclasses.asdict(cfg.target)}
    return d


def point_hash(cfg: RunConfig) -> str:
    """Stable id of what a point measures (not where it is logged or cached)."""
    d = config_dict(cfg)
    semantic = {k: d[k] for k in ("model", "scheme", "target", "probe", "seed")}
    semantic["model"] = {k: v for k, v in semantic["model"].items() if k != "name"}
    return hashlib.sha256(json.dumps(semantic, sort_keys=True).encode()).hexdigest()[:16]


def run_name(cfg: RunConfig) -> str:
    """Readable name: ``bf16@cpu``, ``int4-g64+kv8@cuda``, ``int8@cpu+compile``."""
    kv = cfg.scheme.kv.short_name()
    return f"{cfg.scheme.weights.short_name()}{'+' + kv if kv else ''}@{targets.label(cfg.target)}"


def base_tags(cfg: RunConfig) -> dict[str, str]:
    gpu = hardware.cuda(0)
    return {
        tracking.SWEEP_TAG: cfg.sweep_name,
        "scheme": run_name(cfg).split("@")[0],
        "scheme.weights": cfg.scheme.weights.short_name(),
        "scheme.weights.type": type(cfg.scheme.weights).__name__,
        "scheme.kv": cfg.scheme.kv.short_name() or "none",
        "target": cfg.target.name,
        "target.variant": targets.label(cfg.target),
        "model": cfg.model.name,
        "point_hash": point_hash(cfg),
        "host.cpu": hardware.cpu_name(),
        "host.gpu": gpu.name if gpu else "none",
        "git_commit": tracking.git_commit(),
        **tracking.versions(),
    }


def run_point(cfg: RunConfig) -> PointResult:
    """Run and log one point. Never raises for a point-level failure.

    A point whose identical config (``point_hash``) already has a finished run
    is not run again unless ``cfg.force``; runs left RUNNING by a dead process
    are marked KILLED first, so they are redone.
    """
    if cfg.isolation not in ISOLATION:
        raise UserError(f"unknown isolation {cfg.isolation!r}; valid: {', '.join(ISOLATION)}")
    client, exp_id = tracking.connect(cfg.tracking)
    name, phash = run_name(cfg), point_hash(cfg)
    parent = os.environ.get(PARENT_ENV)
    for dead in tracking.reap_dead(client, exp_id):
        log.warning("run %s was left RUNNING by a dead process: marked KILLED", dead)
    if not cfg.force and (done := tracking.find_finished(client, exp_id, phash)):
        log.info("[%s] already finished as run %s: reused (force=true re-runs)", name, done.info.run_id)
        if parent:
            tracking.set_tags(client, parent, {f"{tracking.REUSED_TAG}.{phash}": done.info.run_id})
        return PointResult(done.info.run_id, name, "reused")
    as_dict = config_dict(cfg)
    run_id = tracking.start_run(client, exp_id, name, base_tags(cfg), parent_id=parent,
                                params=tracking.flatten(as_dict))
    tracking.log_text(client, run_id, yaml.safe_dump(as_dict, sort_keys=False), "config.yaml")
    if cfg.isolation == "process":
        return _run_in_subprocess(cfg, run_id, name, client)
    return _execute(cfg, run_id, name, client)


def _execute(cfg: RunConfig, run_id: str, name: str, client=None) -> PointResult:
    """Measure and close the run, turning any exception into a FAILED run."""
    client = client or tracking.connect(cfg.tracking)[0]
    try:
        outcome, reason = _measure(cfg, name, client, run_id)
    except (UserError, ValueError) as e:
        outcome, reason = "failed", _first_line(e) or type(e).__name__
        log.error("[%s] failed: %s", name, reason)
    except Exception as e:  # noqa: BLE001 - one point must never kill the sweep
        outcome, reason = "failed", f"{type(e).__name__}: {_first_line(e)}"
        tracking.log_text(client, run_id, traceback.format_exc(), "traceback.txt")
        log.error("[%s] failed: %s (traceback logged to the run)", name, reason)
    tracking.end(client, run_id, outcome, reason)
    return PointResult(run_id, name, outcome, reason)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _child(cfg: RunConfig, run_id: str, name: str) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    _execute(cfg, run_id, name)


def _run_in_subprocess(cfg: RunConfig, run_id: str, name: str, client) -> PointResult:
    """Run the point in a fresh (spawned) process: clean memory figures, no
    compiled graphs leaking between points, and a crash (OOM kill, segfault)
    ends only that point's run."""
    proc = multiprocessing.get_context("spawn").Process(target=_child, args=(cfg, run_id, name))
    proc.start()
    proc.join()
    run = client.get_run(run_id)
    if run.info.status == "RUNNING":
        code = proc.exitcode
        why = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit status {code}"
        reason = f"point process died ({why}; out of memory?)"
        log.error("[%s] failed: %s", name, reason)
        tracking.end(client, run_id, "failed", reason)
        return PointResult(run_id, name, "failed", reason)
    outcome = run.data.tags.get(tracking.OUTCOME_TAG, "failed")
    return PointResult(run_id, name, outcome, run.data.tags.get(tracking.REASON_TAG, ""))


def _measure(cfg: RunConfig, name: str, client, run_id: str) -> tuple[str, str]:
    target = targets.get(cfg.target)
    try:
        return _measure_on(target, cfg, name, client, run_id)
    finally:
        target.close()


def _measure_on(target, cfg: RunConfig, name: str, client, run_id: str) -> tuple[str, str]:
    weights, kv = cfg.scheme.weights, cfg.scheme.kv
    verdict = target.supports(weights, kv)
    if not verdict.runnable:
        log.warning("[%s] skipped: %s", name, verdict.reason)
        return "skipped", verdict.reason
    target.prepare()

    log.info("[%s] loading model %s", name, cfg.model.name)
    model, tok = models.load(cfg.model, cfg.cache_dir)
    fid_cfg = cfg.probe.fidelity
    ids = corpus.token_ids(tok, fid_cfg.corpus, fid_cfg.tokens, cfg.data_dir)
    ref = None
    if fid_cfg.enabled:
        ref_dtype = getattr(torch, fid_cfg.reference_dtype)
        key = {"model": dataclasses.asdict(cfg.model), "dtype": fid_cfg.reference_dtype}
        ref = fidelity.reference(key, ids, cfg.cache_dir,
                                 lambda: models.load(cfg.model, cfg.cache_dir, ref_dtype)[0])

    n_params = size.count_params(model)
    log.info("[%s] applying %s (%s)", name, weights.short_name(), verdict.status)
    ctx = ApplyContext(hw=target.hardware(), tokenizer=tok, cache_dir=cfg.cache_dir,
                       data_dir=cfg.data_dir, seed=cfg.seed)
    applied_w = target.apply_weights(model, weights, ctx)
    applied_kv = kv_handler(kv).apply(model, kv, ctx)
    emulated = applied_w.emulated or applied_kv.emulated
    tracking.set_tags(client, run_id, {
        "emulated": str(emulated).lower(),
        "support": verdict.status,
        "support.reason": verdict.reason or "-",
        "backend.weights": applied_w.backend,
        "backend.kv": applied_kv.backend,
    })
    metrics = size.weight_stats(model, n_params)
    runnable = target.compile(model)
    decode_cache = target.decode_cache(applied_kv.cache_factory)
    metrics["compile/warmup_s"] = target.warm_up(runnable, decode_cache)
    metrics["compile/enabled"] = float(bool(cfg.target.compile))
    metrics.update(target.compile_metrics())

    if ref is not None:
        log.info("[%s] fidelity probe (%d tokens)", name, ids.shape[1])
        metrics.update(fidelity.compare(ref, fidelity.logprobs(runnable, ids)))
    metrics.update(_accuracy(cfg, name, runnable, tok, client, run_id))
    if cfg.probe.cache.enabled and not target.in_process:
        tracking.set_tags(client, run_id, {"probe.cache.skipped": f"the model runs in the {target.name} worker"})
    elif cfg.probe.cache.enabled:
        c = cfg.probe.cache
        n = c.prefix_tokens + c.continuation_tokens
        with _optional_probe("cache", name, client, run_id):
            wins = corpus.token_ids(tok, c.corpus, n * c.windows, cfg.data_dir).reshape(c.windows, n)
            log.info("[%s] cache probe (%d x %d tokens, chunk %d)", name, c.windows, n, c.chunk)
            metrics.update(cache_probe.probe(runnable, wins, c, applied_kv.cache_factory))
    if cfg.probe.latency.enabled:
        metrics.update(_latency(cfg, name, target, runnable, tok, decode_cache,
                                metrics["size/weight_bytes"], client, run_id))
    tracking.log_metrics(client, run_id, metrics)
    log.info("[%s] done: %s", name, _headline(metrics))
    return "finished", ""


def _accuracy(cfg: RunConfig, name: str, model, tok, client, run_id: str) -> dict[str, float]:
    """Perplexity and lm-eval; a missing data file costs those metrics only."""
    out: dict[str, float] = {}
    ppl = cfg.probe.perplexity
    if ppl.enabled:
        with _optional_probe("perplexity", name, client, run_id):
            ids = tok(perplexity.wikitext2_text(cfg.data_dir), add_special_tokens=False, return_tensors="pt")
            wins = perplexity.windows(ids["input_ids"][0], ppl.window, ppl.max_windows)
            log.info("[%s] perplexity probe (%d windows of %d tokens)", name, len(wins), ppl.window)
            out.update(perplexity.token_perplexity(model, wins))
    acc = cfg.probe.accuracy
    if acc.enabled:
        with _optional_probe("accuracy", name, client, run_id):
            log.info("[%s] lm-eval %s (limit %s)", name, ",".join(acc.tasks), acc.limit)
            metrics, results = accuracy.evaluate(model, tok, acc, cfg.data_dir, cfg.cache_dir, cfg.seed)
            out.update(metrics)
            tracking.log_text(client, run_id, json.dumps(results, indent=2, default=str), "lm_eval_results.json")
    return out


@contextlib.contextmanager
def _optional_probe(probe: str, name: str, client, run_id: str):
    """A probe whose data is missing (UserError) is skipped with a
    ``probe.<probe>.skipped`` tag naming what it expected; the point goes on."""
    try:
        yield
    except UserError as e:
        log.warning("[%s] %s probe skipped: %s", name, probe, e)
        tracking.set_tags(client, run_id, {f"probe.{probe}.skipped": str(e)})


def _latency(cfg: RunConfig, name: str, target, model, tok, cache_factory, weight_bytes: float,
             client, run_id: str) -> dict[str, float]:
    """Grid timings, stage table, roofline, energy and load; raw samples as CSV."""
    lat = cfg.probe.latency
    cores = os.cpu_count() or 1
    log.info("[%s] latency probe (%d cells, %d new tokens, >= %d requests per cell)",
             name, len(latency.cells(lat)), lat.new_tokens, lat.repeats)
    prompt = corpus.prompt_text(tok, max(p for _, p in latency.cells(lat)))
    device = next(model.parameters()).device
    counter, why = (energy.open_counter(device) if target.in_process
                    else (None, f"no energy counter read on the {target.name} device"))
    load_before = os.getloadavg()[0]
    e0 = counter.read() if counter else None
    out, raw = target.measure_latency(model, tok, prompt, lat, cache_factory)
    tags = {"threads": str(torch.get_num_threads())}
    if counter:
        joules = counter.delta(e0, counter.read())
        tokens = sum(b * lat.new_tokens for b, _, _ in raw)
        out.update({"energy/joules": joules, "energy/tok_per_j": tokens / joules if joules > 0 else 0.0})
    else:
        tags["energy.reason"] = why
    load = max(load_before, os.getloadavg()[0])
    out["sys/load1"] = load
    if load > cores + lat.load_warn:
        log.warning("[%s] system load %.1f on %d cores during timing: latency is inflated", name, load, cores)
        tags["load.warning"] = f"load1 {load:.1f} > {cores} cores"
    if target.in_process and "lat/tpot_ms_p50" in out:  # host/GPU bandwidth is not a NeuronCore's
        peak = roofline.host_bandwidth(cfg.cache_dir, device)
        b, p = latency.cells(lat)[0]
        kv_mid = out.get("mem/kv_mb", 0.0) * 2**20 * (p + lat.new_tokens / 2) / (p + lat.new_tokens)
        out.update(roofline.utilisation(weight_bytes + kv_mid, out["lat/tpot_ms_p50"], peak))
    tracking.log_text(client, run_id, latency.samples_csv(raw), "latency_samples.csv")
    if lat.stages and target.no_stage_table():
        tags["probe.stages.skipped"] = target.no_stage_table()
    elif lat.stages:
        samples, totals = stages.measure(model, tok, prompt, lat.prompt_tokens,
                                         max(lat.new_tokens - 1, 1), lat.stage_requests, cache_factory)
        csv, stage_metrics = stages.table(samples, totals)
        out.update(stage_metrics)
        tracking.log_text(client, run_id, csv, "stages.csv")
    tracking.set_tags(client, run_id, tags)
    return out


def _headline(m: dict[str, float]) -> str:
    parts = [f"{m['size/weight_mb']:.1f} MB"]
    if "fid/kl_mean" in m:
        parts.append(f"KL {m['fid/kl_mean']:.2e}, top1 {m['fid/top1_agree']:.3f}")
    if "lat/tpot_ms_p50" in m:
        parts.append(f"TPOT p50 {m['lat/tpot_ms_p50']:.1f} ms, {m['tput/decode_tok_s']:.1f} tok/s")
    return "; ".join(parts)
