"""run_point(cfg): one sweep point, top to bottom.

config -> support check -> load model -> [calibrate] -> weight scheme -> KV scheme
       -> engine for the target -> fidelity, accuracy, cache, latency probes
       -> log what was measured to MLflow (one step)

Probes talk to the engine only (``quantlab.engines``) and return results; the
``Measurement`` they fill is logged once, at the end.

A point that its target cannot run is logged as skipped with the reason; a
point that raises is logged as FAILED with its traceback, and the caller (the
sweep) goes on with the next one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from quantlab import contention, corpus, hardware, models, plots, point, provenance, targets, tracking
from quantlab.compose import config_dict
from quantlab.config import RunConfig, check_choice, choices
from quantlab.engines.pytorch import TorchEngine
from quantlab.errors import UserError
from quantlab.measurement import Measurement
from quantlab.export import formats
from quantlab.probes import (accuracy, accuracy_adaptive, energy, fidelity, kv_capacity, latency, load,
                             perplexity, roofline, size, stages)
from quantlab.probes import cache as cache_probe
from quantlab.schemes import qlinear
from quantlab.schemes.registry import ApplyContext, kv_handler

log = logging.getLogger("quantlab")

PARENT_ENV = "QUANTLAB_PARENT_RUN_ID"


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


def run_params(cfg: RunConfig, ident: point.Identity, as_dict: dict) -> dict[str, str]:
    """The config as MLflow params, plus ``scheme`` (the point's scheme name, a
    param so that the UI's charts can plot against it); the settings of the
    in-memory ``tiny`` model only where that is the model."""
    params = tracking.flatten(as_dict)
    if cfg.model.source != "tiny":
        params = {k: v for k, v in params.items() if not k.startswith("model.tiny.")}
    params[point.SCHEME_TAG] = ident.scheme
    return params


def base_tags(cfg: RunConfig, ident: point.Identity) -> dict[str, str]:
    gpu, host = hardware.cuda(0), provenance.host()
    return {
        point.SWEEP_TAG: cfg.sweep_name,
        point.SCHEME_TAG: ident.scheme,
        "scheme.weights": ident.weights,
        "scheme.weights.type": type(cfg.scheme.weights).__name__,
        "scheme.kv": ident.kv or "none",
        "target": cfg.target.name,
        "target.variant": ident.target,
        "model": cfg.model.name,
        point.HASH_TAG: ident.hash,
        point.HOST_CPU_TAG: hardware.cpu_name(),
        "host.gpu": gpu.name if gpu else "none",
        point.HOST_ID_TAG: provenance.host_id(host),
        point.HOST_FINGERPRINT_TAG: host,
        "quantlab.code": ident.code,
        "data.sha256": ident.data,
        "git_commit": tracking.git_commit(),
        **formats.exportable_tags(cfg.scheme.weights),
        **tracking.versions(),
    }


def run_point(cfg: RunConfig) -> PointResult:
    """Run and log one point. Never raises for a point-level failure.

    A point whose identical config (``point_hash``) already has a finished run
    is not run again unless ``cfg.force``; runs left RUNNING by a dead process
    are marked KILLED first, so they are redone.
    """
    try:
        check_choice("isolation", cfg.isolation, choices(RunConfig, "isolation"))
    except ValueError as e:
        raise UserError(str(e)) from None
    client, exp_id = _connect(cfg)
    ident, as_dict = identify(cfg)
    name = ident.name
    parent = os.environ.get(PARENT_ENV)
    for dead in tracking.reap_dead(client, exp_id):
        log.warning("run %s was left RUNNING by a dead process: marked KILLED", dead)
    # timings are only reused from this host; accuracy-only points from any
    same_host = provenance.host_id() if cfg.probe.latency.enabled else None
    if not cfg.force and (done := tracking.find_finished(client, exp_id, ident.hash, same_host)):
        log.info("[%s] already finished as run %s on host %s: reused (force=true re-runs)", name,
                 done.info.run_id, done.data.tags.get(point.HOST_FINGERPRINT_TAG, "?"))
        if parent:
            tracking.link_reused(client, exp_id, parent, done, cfg.sweep_name)
        return PointResult(done.info.run_id, name, "reused")
    run_id = tracking.start_run(client, exp_id, name, base_tags(cfg, ident), parent_id=parent,
                                params=run_params(cfg, ident, as_dict))
    tracking.log_text(client, run_id, yaml.safe_dump(as_dict, sort_keys=False), "config.yaml")
    if cfg.isolation == "process":
        return _run_in_subprocess(cfg, run_id, name, client)
    return _execute(cfg, run_id, name, client)


def _connect(cfg: RunConfig):
    """The point's tracking client and experiment. A server that stops
    answering is waited for (:data:`quantlab.tracking.SERVER_WAIT_S`) only
    when it answered before: under a sweep (whose start reached it) or
    earlier in this process; before anything started, an unreachable server
    is refused at once in one line (a wrong URI must not cost minutes)."""
    known = os.environ.get(PARENT_ENV) or tracking.answered(cfg.tracking.uri)
    return tracking.connect(cfg.tracking, tracking.SERVER_WAIT_S if known else 0.0)


def record_lost(cfg: RunConfig, reason: str) -> PointResult:
    """A point whose worker or node died under it (the launcher saw its task
    fail, so nothing on that worker could log it): its RUNNING run under this
    sweep, or a new run when it never started one, ends FAILED with
    ``reason``. A rerun of the sweep redoes it (a failed run is never reused)."""
    client, exp_id = _connect(cfg)
    ident, as_dict = identify(cfg)
    parent = os.environ.get(PARENT_ENV)
    # RUNNING, or already KILLED by another point's reap_dead (the lost worker ran on this host)
    run = tracking.find_running(client, exp_id, ident.hash, parent) or (
        tracking.find_running(client, exp_id, ident.hash, parent, "KILLED") if parent else None)
    run_id = run.info.run_id if run is not None else tracking.start_run(
        client, exp_id, ident.name, base_tags(cfg, ident), parent_id=parent, params=run_params(cfg, ident, as_dict))
    log.error("[%s] failed: %s", ident.name, reason)
    tracking.end(client, run_id, "failed", reason)
    return PointResult(run_id, ident.name, "failed", reason)


def _execute(cfg: RunConfig, run_id: str, name: str, client=None) -> PointResult:
    """Measure, log what was measured (also after a failure) and close the run,
    turning any exception into a FAILED run."""
    client = client or _connect(cfg)[0]
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
    tracking.log_measurement(client, run_id, m)
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


def _measure(cfg: RunConfig, name: str, m: Measurement) -> tuple[str, str]:
    """The straight line of one point; returns (outcome, reason), fills ``m``."""
    _check_node(cfg)
    target = targets.get(cfg.target)
    weights, kv = cfg.scheme.weights, cfg.scheme.kv
    verdict = target.supports(weights, kv)
    if not verdict.runnable:
        log.warning("[%s] skipped: %s", name, verdict.reason)
        return "skipped", verdict.reason
    with target.session():
        log.info("[%s] loading model %s", name, cfg.model.name)
        with m.timed("model"):
            model, tok = models.load(cfg.model, cfg.cache_dir)
        with m.timed("reference"):
            reference = _reference(cfg, name, tok, m)
        n_params = size.count_params(model)
        log.info("[%s] applying %s (%s)", name, weights.short_name(), verdict.status)
        ctx = ApplyContext(hw=target.hardware(), tokenizer=tok, cache_dir=cfg.cache_dir,
                           data_dir=cfg.data_dir, seed=cfg.seed)
        with m.timed("apply"):  # calibration included
            applied_w = target.apply_weights(model, weights, ctx)
            applied_kv = kv_handler(kv).apply(model, kv, ctx)
        compute = model.get_input_embeddings().weight.dtype
        widened = qlinear.widen(model, compute)
        m.tags.update({"emulated": str(applied_w.emulated or applied_kv.emulated).lower(),
                       "support": verdict.status, "support.reason": verdict.reason or "-",
                       "backend.weights": applied_w.backend, "backend.kv": applied_kv.backend,
                       **applied_w.tags, **applied_kv.tags, **qlinear.widened_tags(widened, compute)})
        m.metrics.update(size.weight_stats(model, n_params))
        m.metrics["size/embedding_unread_bytes"] = size.embedding_unread_bytes(model, cfg.probe.latency.batch_size)
        compute_bytes = compute.itemsize
        with m.timed("engine"):
            engine = target.engine(model, applied_kv, tok)
        try:
            m.metrics.update({"compile/warmup_s": engine.ready_s,
                              "compile/enabled": float(bool(getattr(cfg.target, "compile", False))),
                              **engine.metrics})
            if reference is not None:
                with m.timed("fidelity"):
                    _fidelity(cfg, name, engine, reference, m, model if target.serves_export else None)
            _accuracy(cfg, name, engine, tok, m)
            with m.timed("cache"):
                _cache(cfg, name, engine, model.config, tok, compute_bytes, m)
            if cfg.probe.latency.enabled:
                with m.timed("latency"):
                    _latency(cfg, name, engine, tok, m)
            if cfg.probe.load.enabled:
                with m.timed("load"):
                    _load(cfg, name, engine, tok, m)
        finally:
            engine.close()
    log.info("[%s] done: %s", name, _headline(m.metrics))
    return "finished", ""


def _check_node(cfg: RunConfig) -> None:
    """On a Ray worker, a data directory this node cannot see fails the point:
    here a missing directory would skip its accuracy probes with a tag, and a
    sweep whose nodes differ would compare points measured on different data.
    (On the machine that composed the sweep a missing one skips them, as ever.)"""
    ray = sys.modules.get("ray")
    if cfg.data_dir and ray is not None and ray.is_initialized() and not Path(cfg.data_dir).expanduser().is_dir():
        raise UserError(f"data_dir {cfg.data_dir} is not on this node ({socket.gethostname()}): every node of the "
                        "cluster needs it at the same path (a shared or copied directory)")


def _reference(cfg: RunConfig, name: str, tok, m: Measurement):
    """``(ids, reference log-probs)`` of the fidelity corpus, or None when the
    probe is off or its corpus is missing (then tagged, and the point goes on)."""
    fid = cfg.probe.fidelity
    if not fid.enabled:
        return None
    with _optional_probe("fidelity", name, m):
        m.tags["probe.fidelity.corpus"] = corpus.resolve(fid.corpus, cfg.data_dir)
        ids, _ = corpus.random_windows(tok, corpus.text(fid.corpus, cfg.data_dir), fid.tokens // fid.windows,
                                       fid.windows, cfg.seed)
        return ids, fidelity.reference(_reference_key(cfg), ids, cfg.cache_dir, lambda: _reference_engine(cfg))
    return None


def _fidelity(cfg: RunConfig, name: str, engine, reference, m: Measurement, point_model=None) -> None:
    """KL and top-1 against the reference: over whole distributions, or where
    the engine returns only its top k, the top-k lower bound (named apart).
    ``point_model``: quantlab's in-memory point behind an exported artifact;
    the same statistics against it are logged as ``parity/*``."""
    ids, ref = reference  # ids: [windows, length], drawn at random
    fid = cfg.probe.fidelity
    log.info("[%s] fidelity probe (%d windows of %d tokens)", name, *ids.shape)
    w = len(ids)
    if why := engine.cannot("logits"):
        tops = [engine.topk_logprobs(row[None], fid.topk) for row in ids]
        vals, top = torch.cat([v for v, _ in tops]), torch.cat([t for _, t in tops])
        actual = torch.stack([engine.token_logprobs(row[None])[0][0] for row in ids])
        score = lambda r: fidelity.compare_topk(r, vals, top, actual, ids[:, 1:], w)  # noqa: E731
        m.tags["probe.fidelity.kl"] = f"top-{fid.topk} lower bound ({why})"
    else:
        logp = fidelity.logprobs(engine, ids)
        score = lambda r: fidelity.compare(r, logp, ids[:, 1:], w)  # noqa: E731
    m.metrics.update(score(ref))
    if point_model is None or not fid.parity:
        return
    log.info("[%s] parity: the served artifact against quantlab's in-memory point", name)
    local = TorchEngine(point_model, next(point_model.parameters()).device)
    m.metrics.update(fidelity.as_parity(score(fidelity.logprobs(local, ids))))
    m.metrics.update(fidelity.greedy_parity(engine, local, ids[:1, : min(32, ids.shape[1])], fid.parity_tokens))


def _accuracy(cfg: RunConfig, name: str, engine, tok, m: Measurement) -> None:
    """Perplexity and lm-eval; a missing data file costs those metrics only."""
    ppl = cfg.probe.perplexity
    if ppl.enabled:
        with m.timed("perplexity"), _optional_probe("perplexity", name, m):
            wins, metric = perplexity.sample(tok, perplexity.wikitext2_text(cfg.data_dir), ppl.window,
                                             ppl.max_windows, cfg.seed)  # the cap's name, however many scored
            log.info("[%s] perplexity probe (%d windows of %d tokens, %s%s)", name, len(wins), ppl.window,
                     "the whole split" if ppl.max_windows is None else "drawn at random",
                     ", adaptive" if ppl.adaptive else "")
            nll = _adaptive_nll(cfg, name, engine, wins, metric, m) if ppl.adaptive else \
                perplexity.token_nll(engine, wins)
            m.metrics.update(perplexity.summary(nll, metric))
            m.items[metric] = [round(float(x), 5) for x in nll.ravel()]
    acc = cfg.probe.accuracy
    if acc.enabled:
        with m.timed("accuracy"), _optional_probe("accuracy", name, m):
            log.info("[%s] lm-eval %s (limit %s%s)", name, ",".join(acc.tasks), acc.limit,
                     ", adaptive" if acc.adaptive else "")
            if acc.adaptive:
                metrics, results, items, stops = accuracy_adaptive.run(
                    engine, tok, acc, cfg.data_dir, cfg.cache_dir, cfg.seed, _reference_key(cfg),
                    lambda: _reference_engine(cfg), _baseline_candidate(cfg, m),
                    lambda line: log.info("[%s] lm-eval: %s", name, line))
                m.tags[point.ACC_STOP_TAG] = "; ".join(f"{t}: {why}" for t, why in stops.items())
                log.info("[%s] lm-eval: %s", name, m.tags[point.ACC_STOP_TAG])
            else:
                metrics, results, items = accuracy.evaluate(engine, tok, acc, cfg.data_dir, cfg.cache_dir, cfg.seed)
            m.metrics.update(metrics)
            m.items.update(items)
            m.artifacts["lm_eval_results.json"] = json.dumps(results, indent=2, default=str)


def _adaptive_nll(cfg: RunConfig, name: str, engine, wins: torch.Tensor, metric: str, m: Measurement):
    """Per-token NLLs of as many windows as the point's budgets need
    (:func:`quantlab.probes.perplexity.adaptive_nll`), against the reference
    model's NLLs on the same windows (cached like the fidelity reference).
    Logs why it stopped and, where it could stop early (not a baseline
    candidate), ``<metric>_adaptive_cap`` / ``_adaptive_chunk``: the report's
    sequential bound reads them."""
    ppl = cfg.probe.perplexity
    ref = fidelity.cached("reference_nll", _reference_key(cfg), wins, cfg.cache_dir,
                          lambda: torch.from_numpy(perplexity.token_nll(_reference_engine(cfg), wins)))
    baseline = _baseline_candidate(cfg, m)
    st = perplexity.adaptive_nll(engine, wins, ref.numpy(), ppl.adaptive_chunk, ppl.adaptive_budgets,
                                 ppl.adaptive_alpha, baseline, lambda line: log.info("[%s] perplexity: %s", name, line))
    log.info("[%s] perplexity: %s", name, st.reason)
    if not baseline:  # a baseline candidate's design is fixed: the report bounds it as one
        m.metrics.update({f"{metric}_adaptive_cap": float(len(wins)),
                          f"{metric}_adaptive_chunk": float(ppl.adaptive_chunk)})
    m.tags[point.PPL_STOP_TAG] = st.reason
    return st.nll


def _baseline_candidate(cfg: RunConfig, m: Measurement) -> bool:
    """A point the sweep may take as its baseline (float weights, or the
    ``recovery_baseline`` scheme): adaptive probes score its cap, since every
    other point is paired against its items."""
    return m.metrics.get("size/bits_per_weight", 0.0) >= 15.99 or \
        cfg.recovery_baseline == cfg.scheme.weights.short_name()


def _reference_key(cfg: RunConfig) -> dict:
    """What identifies the reference model in its caches: the model and the reference precision."""
    return {"model": dataclasses.asdict(cfg.model), "dtype": cfg.probe.fidelity.reference_dtype}


def _reference_engine(cfg: RunConfig) -> TorchEngine:
    """The unquantized model at the fidelity probe's reference precision."""
    dtype = getattr(torch, cfg.probe.fidelity.reference_dtype)
    return TorchEngine(models.load(cfg.model, cfg.cache_dir, dtype)[0])


def _cache(cfg: RunConfig, name: str, engine, config, tok, compute_bytes: int, m: Measurement) -> None:
    """Teacher-forced decoding through the point's KV cache, where the engine has one."""
    c = cfg.probe.cache
    if not c.enabled:
        return
    if why := engine.cannot("cache"):
        m.tags["probe.cache.skipped"] = why
        return
    n = c.prefix_tokens + c.continuation_tokens
    with _optional_probe("cache", name, m):
        m.tags["probe.cache.corpus"] = corpus.resolve(c.corpus, cfg.data_dir)
        wins = corpus.token_ids(tok, c.corpus, n * c.windows, cfg.data_dir).reshape(c.windows, n)
        log.info("[%s] cache probe (%d x %d tokens, chunk %d)", name, c.windows, n, c.chunk)
        m.metrics.update(cache_probe.probe(engine, config, wins, c, compute_bytes))


@contextlib.contextmanager
def _optional_probe(probe: str, name: str, m: Measurement):
    """A probe whose data is missing (UserError) is skipped with a
    ``probe.<probe>.skipped`` tag naming what it expected; the point goes on."""
    try:
        yield
    except UserError as e:
        log.warning("[%s] %s probe skipped: %s", name, probe, e)
        m.tags[f"probe.{probe}.skipped"] = str(e)


def _latency(cfg: RunConfig, name: str, engine, tok, m: Measurement) -> None:
    """Grid timings, stage table, roofline, energy and load; raw samples as CSV."""
    lat = cfg.probe.latency
    cores = os.cpu_count() or 1
    log.info("[%s] latency probe (%d cells, %d new tokens, >= %d requests per cell)",
             name, len(latency.cells(lat)), lat.new_tokens, lat.repeats)
    prompt = corpus.prompt_text(tok, max(p for _, p in latency.cells(lat)))
    why = engine.cannot("energy")
    counter, why = (None, why) if why else energy.open_counter(engine.device)
    load_before, before = os.getloadavg()[0], contention.snapshot()
    out, raw = latency.measure(engine, tok, prompt, lat, counter)  # joules of timed requests only
    foreign = contention.foreign_cores(before, contention.snapshot())
    tags = {"threads": str(torch.get_num_threads())}
    if not counter:
        tags["energy.reason"] = why
    out["sys/load1"] = max(load_before, os.getloadavg()[0])
    out["sys/foreign_cpu_cores"] = foreign
    if foreign > lat.contention_warn:
        log.warning("[%s] other processes used %.2f of %d cores while this point was timed: its latency is "
                    "inflated and the report marks it", name, foreign, cores)
        tags[point.CONTENDED_TAG] = f"latency timed beside {foreign:.2f} cores of other work ({cores} cores)"
    if not engine.cannot("roofline") and "lat/tpot_ms_p50" in out:
        peak = roofline.host_bandwidth(cfg.cache_dir, engine.device)
        b, p = latency.cells(lat)[0]
        kv_mid = out.get("mem/kv_mb", 0.0) * 2**20 * (p + lat.new_tokens / 2) / (p + lat.new_tokens)
        out.update(roofline.utilisation(_weight_bytes_read(m.metrics) + kv_mid, out["lat/tpot_ms_p50"], peak))
    m.artifacts["latency_samples.csv"] = latency.samples_csv(raw)
    if lat.stages and (why := engine.cannot("stages")):
        tags["probe.stages.skipped"] = why
    elif lat.stages:
        samples, totals = stages.measure(engine, tok, prompt, lat.prompt_tokens,
                                         max(lat.new_tokens - 1, 1), lat.stage_requests, lat.batch_size)
        csv, stage_metrics = stages.table(samples, totals)
        out.update(stage_metrics)
        m.artifacts["stages.csv"] = csv
    m.metrics.update(out)
    m.tags.update(tags)


def _weight_bytes_read(metrics: dict[str, float]) -> float:
    """Weight bytes one decode step reads: the runtime's own where it stores
    them differently (llama.cpp's blocks), less the rows of an untied
    embedding table a step does not read."""
    return metrics.get("size/runtime_weight_bytes", metrics["size/weight_bytes"]) \
        - metrics.get("size/embedding_unread_bytes", 0.0)


def _load(cfg: RunConfig, name: str, engine, tok, m: Measurement) -> None:
    """Open-loop load per policy and rate, then (with a budget) KV capacity."""
    lc = cfg.probe.load
    ids = corpus.token_ids(tok, "auto", max(lc.prompt_tokens * 16, lc.kv_context), cfg.data_dir)[0]
    if lc.prompts == "paragraphs":
        prompts = corpus.paragraph_ids(tok, "auto", cfg.data_dir, lc.prompt_tokens, lc.prompt_tokens_min, 64)
    else:
        prompts = [ids[i * lc.prompt_tokens:(i + 1) * lc.prompt_tokens] for i in range(16)]
    peak = 0.0 if engine.cannot("roofline") else roofline.host_bandwidth(cfg.cache_dir, engine.device)
    log.info("[%s] load probe (%s, %s arrivals, %g s per rate, policies %s)", name,
             "rates auto" if lc.rates == "auto" else f"rates {lc.rates}", lc.arrival, lc.duration_s,
             ",".join(lc.policies))
    before = contention.snapshot()
    metrics, rows, tags = load.measure(engine, prompts, lc, _weight_bytes_read(m.metrics), peak, cfg.seed,
                                       lambda line: log.info("[%s] load: %s", name, line))
    metrics["load/foreign_cpu_cores"] = foreign = contention.foreign_cores(before, contention.snapshot())
    if foreign > cfg.probe.latency.contention_warn:
        log.warning("[%s] other processes used %.2f cores during the load probe: the report marks it", name, foreign)
        was = m.tags.get(point.CONTENDED_TAG)
        tags[point.CONTENDED_TAG] = (was + "; " if was else "") + f"load probe beside {foreign:.2f} cores of other work"
    m.metrics.update(metrics)
    m.tags.update(tags)
    if rows:
        m.artifacts["load.csv"] = load.csv_text(rows)
        series = {p: [r for r in rows if r["policy"] == p] for p in dict.fromkeys(r["policy"] for r in rows)}
        slo = {"ttft_ms": lc.slo.ttft_ms, "tpot_ms": lc.slo.tpot_ms}
        with tempfile.TemporaryDirectory() as d:
            m.artifacts["load.png"] = plots.load_png(series, Path(d) / "load.png", f"{name}: load", slo).read_bytes()
            m.artifacts["load.html"] = plots.load_html(series, Path(d) / "load.html", f"{name}: load").read_text()
    if lc.kv_budget_mb is not None and (why := engine.cannot("cache")):
        m.tags["load.kv_capacity.skipped"] = why
    elif lc.kv_budget_mb is not None:
        log.info("[%s] KV capacity in %g MiB at %d tokens", name, lc.kv_budget_mb, lc.kv_context)
        m.metrics.update(kv_capacity.measure(engine, ids, lc))


def _headline(m: dict[str, float]) -> str:
    parts = [f"{m['size/weight_mb']:.1f} MB"]
    if "fid/kl_mean" in m:
        parts.append(f"KL {m['fid/kl_mean']:.2e}, top1 {m['fid/top1_agree']:.3f}")
    if "lat/tpot_ms_p50" in m:
        parts.append(f"TPOT p50 {m['lat/tpot_ms_p50']:.1f} ms, {m['tput/decode_tok_s']:.1f} tok/s")
    return "; ".join(parts)
