"""run_point(cfg): one sweep point, top to bottom.

config -> support check -> load model -> [calibrate] -> weight scheme -> KV scheme
       -> compile for target -> fidelity probe -> latency probe -> log to MLflow

A point that its target cannot run is logged as skipped with the reason; a
point that raises is logged as FAILED with its traceback, and the caller (the
sweep) goes on with the next one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import traceback
from dataclasses import dataclass

import torch
import yaml

from quantlab import hardware, models, targets, tracking
from quantlab.config import RunConfig
from quantlab.errors import UserError
from quantlab.probes import corpus, fidelity, latency, size
from quantlab.schemes.registry import ApplyContext, kv_handler, weights_handler

log = logging.getLogger("quantlab")

PARENT_ENV = "QUANTLAB_PARENT_RUN_ID"


@dataclass
class PointResult:
    run_id: str
    name: str
    outcome: str  # finished | skipped | failed
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
    """Readable name: ``bf16@cpu``, ``int4-g64+kv8@cuda``."""
    kv = cfg.scheme.kv.short_name()
    return f"{cfg.scheme.weights.short_name()}{'+' + kv if kv else ''}@{cfg.target.name}"


def base_tags(cfg: RunConfig) -> dict[str, str]:
    gpu = hardware.cuda(0)
    return {
        tracking.SWEEP_TAG: cfg.sweep_name,
        "scheme": run_name(cfg).split("@")[0],
        "scheme.weights": cfg.scheme.weights.short_name(),
        "scheme.weights.type": type(cfg.scheme.weights).__name__,
        "scheme.kv": cfg.scheme.kv.short_name() or "none",
        "target": cfg.target.name,
        "model": cfg.model.name,
        "point_hash": point_hash(cfg),
        "host.cpu": hardware.cpu_name(),
        "host.gpu": gpu.name if gpu else "none",
        "git_commit": tracking.git_commit(),
        **tracking.versions(),
    }


def run_point(cfg: RunConfig) -> PointResult:
    """Run and log one point. Never raises for a point-level failure."""
    client, exp_id = tracking.connect(cfg.tracking)
    name = run_name(cfg)
    params = tracking.flatten(config_dict(cfg))
    run_id = tracking.start_run(client, exp_id, name, base_tags(cfg),
                                parent_id=os.environ.get(PARENT_ENV), params=params)
    tracking.log_text(client, run_id, yaml.safe_dump(config_dict(cfg), sort_keys=False), "config.yaml")
    try:
        outcome, reason = _measure(cfg, name, client, run_id)
    except (UserError, ValueError) as e:
        outcome, reason = "failed", str(e).splitlines()[0] if str(e) else type(e).__name__
        log.error("[%s] failed: %s", name, reason)
    except Exception as e:  # noqa: BLE001 - one point must never kill the sweep
        outcome, reason = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        tracking.log_text(client, run_id, traceback.format_exc(), "traceback.txt")
        log.error("[%s] failed: %s (traceback logged to the run)", name, reason)
    tracking.end(client, run_id, outcome, reason)
    return PointResult(run_id, name, outcome, reason)


def _measure(cfg: RunConfig, name: str, client, run_id: str) -> tuple[str, str]:
    target = targets.get(cfg.target)
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
    applied_w = weights_handler(weights).apply(model, weights, ctx)
    applied_kv = kv_handler(kv).apply(model, kv, ctx)
    emulated = applied_w.emulated or applied_kv.emulated
    tracking.set_tags(client, run_id, {
        "emulated": str(emulated).lower(),
        "support": verdict.status,
        "support.reason": verdict.reason or "-",
        "backend.weights": applied_w.backend,
        "backend.kv": applied_kv.backend,
        **applied_w.extra_tags,
    })
    metrics = size.weight_stats(model, n_params)
    runnable = target.compile(model)

    if ref is not None:
        log.info("[%s] fidelity probe (%d tokens)", name, ids.shape[1])
        metrics.update(fidelity.compare(ref, fidelity.logprobs(runnable, ids)))
    if cfg.probe.latency.enabled:
        lat = cfg.probe.latency
        log.info("[%s] latency probe (batch %d, prompt %d, %d new tokens, %d+%d runs)",
                 name, lat.batch_size, lat.prompt_tokens, lat.new_tokens, lat.warmup, lat.repeats)
        prompt = corpus.prompt_text(tok, lat.prompt_tokens)
        lat_metrics, _ = latency.measure(runnable, tok, prompt, lat)
        metrics.update(lat_metrics)
    tracking.log_metrics(client, run_id, metrics)
    log.info("[%s] done: %s", name, _headline(metrics))
    return "finished", ""


def _headline(m: dict[str, float]) -> str:
    parts = [f"{m['size/weight_mb']:.1f} MB"]
    if "fid/kl_mean" in m:
        parts.append(f"KL {m['fid/kl_mean']:.2e}, top1 {m['fid/top1_agree']:.3f}")
    if "lat/tpot_ms_p50" in m:
        parts.append(f"TPOT p50 {m['lat/tpot_ms_p50']:.1f} ms, {m['tput/decode_tok_s']:.1f} tok/s")
    return "; ".join(parts)
