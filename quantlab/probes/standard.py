"""quantlab's own probes, registered under ``quantlab.probes`` in
pyproject.toml: fidelity, perplexity, accuracy (lm-eval), cache, KV error by
position, latency, load. Each turns its config section into calls of its
numerics module and returns what it measured (:mod:`quantlab.probes.base`)."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from quantlab import corpus, metric_names, plots, point
from quantlab.config import RunConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.probes import (accuracy, accuracy_adaptive, energy, fidelity, kv_capacity, kv_position, latency, load,
                             passkey, perplexity, roofline, stages)
from quantlab.probes import cache as cache_probe
from quantlab.probes.base import ProbeContext, ProbeResult


class FidelityProbe:
    """KL and top-1 against the unquantized reference on random windows of
    the fidelity corpus: over whole distributions, or where the engine
    returns only its top k, the top-k lower bound (named apart). Behind an
    exported artifact, the same statistics against quantlab's in-memory point
    are logged as ``parity/*``."""

    name, order, contention_metric = "fidelity", 10, None

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.fidelity.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        cfg, fid, out = ctx.cfg, ctx.cfg.probe.fidelity, ProbeResult()
        out.tags["probe.fidelity.corpus"] = corpus.resolve(fid.corpus, cfg.data_dir)
        ids, _ = corpus.random_windows(ctx.tokenizer, corpus.text(fid.corpus, cfg.data_dir),
                                       fid.tokens // fid.windows, fid.windows, cfg.draws_seed)
        with out.timed("reference"):
            ref = fidelity.reference(ctx.reference_key(), ids, cfg.cache_dir, ctx.reference_engine)
        ctx.log("fidelity probe (%d windows of %d tokens)", *ids.shape)
        engine, w = ctx.engine, len(ids)
        if why := engine.cannot("logits"):
            tops = [engine.topk_logprobs(row[None], fid.topk) for row in ids]
            vals, top = torch.cat([v for v, _ in tops]), torch.cat([t for _, t in tops])
            actual = torch.stack([engine.token_logprobs(row[None])[0][0] for row in ids])
            score = lambda r: fidelity.compare_topk(r, vals, top, actual, ids[:, 1:], w)  # noqa: E731
            out.tags["probe.fidelity.kl"] = f"top-{fid.topk} lower bound ({why})"
        else:
            logp = fidelity.logprobs(engine, ids)
            score = lambda r: fidelity.compare(r, logp, ids[:, 1:], w)  # noqa: E731
        out.metrics.update(score(ref))
        if ctx.serves_export and fid.parity:
            ctx.log("parity: the served artifact against quantlab's in-memory point")
            local = TorchEngine(ctx.model, next(ctx.model.parameters()).device)
            out.metrics.update(fidelity.as_parity(score(fidelity.logprobs(local, ids))))
            out.metrics.update(fidelity.greedy_parity(engine, local, ids[:1, : min(32, ids.shape[1])],
                                                      fid.parity_tokens))
        return out


class PerplexityProbe:
    """Token perplexity on random WikiText-2 windows; adaptive: as many
    windows as the point's budgets need, against the reference model's NLLs
    on the same windows (cached), with why it stopped."""

    name, order, contention_metric = "perplexity", 20, None

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.perplexity.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        cfg, ppl, out = ctx.cfg, ctx.cfg.probe.perplexity, ProbeResult()
        # the metric is named by the cap, however many windows an adaptive point scores
        wins, metric, articles = perplexity.sample(ctx.tokenizer, perplexity.wikitext2_text(cfg.data_dir), ppl.window,
                                                   ppl.max_windows, cfg.draws_seed)
        ctx.log("perplexity probe (%d windows of %d tokens, %s%s)", len(wins), ppl.window,
                "the whole split" if ppl.max_windows is None else "drawn at random", ", adaptive" if ppl.adaptive else "")
        nll = self._adaptive(ctx, wins, metric, out, articles) if ppl.adaptive else \
            perplexity.token_nll(ctx.engine, wins)
        out.metrics.update(perplexity.summary(nll, metric, articles))
        out.items[metric] = [round(float(x), 5) for x in nll.ravel()]
        if articles is not None:  # the windows scored (an adaptive point: a prefix of the draw)
            out.items[f"{metric_names.ARTICLES}{metric}"] = articles[:nll.shape[0]]
        if cascades(cfg) and not ctx.identical_to_reference():
            ref = self._reference(ctx, wins)[:nll.shape[0]]
            lower = perplexity.loss_lower(nll, ref, articles[:nll.shape[0]] if articles else None,
                                          cfg.probe.accuracy.adaptive_alpha)
            if math.isfinite(lower):  # fewer than MIN_UNITS units: no bound, nothing excluded
                out.metrics[f"{metric}_ref_loss_lower"] = lower
        return out

    @staticmethod
    def _reference(ctx: ProbeContext, wins: torch.Tensor) -> np.ndarray:
        """The reference model's per-token NLLs on ``wins`` (computed once, cached)."""
        return fidelity.cached("reference_nll", ctx.reference_key(), wins, ctx.cfg.cache_dir, lambda: torch.from_numpy(
            perplexity.token_nll(ctx.engine_for_reference(), wins))).numpy()

    @staticmethod
    def _adaptive(ctx: ProbeContext, wins: torch.Tensor, metric: str, out: ProbeResult, articles: list | None):
        """Bounds over the windows' ``articles`` (the report's unit). Where
        the point could stop early (not a baseline candidate), logs
        ``<metric>_adaptive_cap`` / ``_adaptive_chunk``: the report's
        sequential bound reads them. A point identical to the reference
        (:meth:`ProbeContext.identical_to_reference`) takes the reference's
        windows over the cap: the fixed design's."""
        ppl, same = ctx.cfg.probe.perplexity, ctx.identical_to_reference()
        ref = PerplexityProbe._reference(ctx, wins)
        if same:
            out.tags[point.PPL_STOP_TAG] = f"{point.IDENTICAL_STOP}: its {len(wins)} windows are the reference's"
            ctx.log("perplexity: %s", out.tags[point.PPL_STOP_TAG])
            return ref
        baseline = ctx.baseline_candidate()
        st = perplexity.adaptive_nll(ctx.engine, wins, ref, ppl.adaptive_chunk, ppl.adaptive_budgets,
                                     ppl.adaptive_alpha, baseline, lambda line: ctx.log("perplexity: %s", line),
                                     articles)
        ctx.log("perplexity: %s", st.reason)
        if not baseline:  # a baseline candidate's design is fixed: the report bounds it as one
            out.metrics.update({f"{metric}_adaptive_cap": float(len(wins)),
                                f"{metric}_adaptive_chunk": float(ppl.adaptive_chunk)})
        out.tags[point.PPL_STOP_TAG] = st.reason
        return st.nll


def cascades(cfg: RunConfig) -> bool:
    """lm-eval is spent only where the decision is still open
    (``probe.accuracy.cascade``): the decision metric is the perplexity."""
    acc, ppl, metric = cfg.probe.accuracy, cfg.probe.perplexity, cfg.decision.metric
    return acc.enabled and acc.cascade and ppl.enabled and (
        metric == "auto" or metric.removeprefix(metric_names.RECOVERY).startswith(metric_names.PPL_STEM))


def excluded(ctx: ProbeContext) -> str:
    """Why the decision has already excluded this point ('' where it has
    not): its perplexity's loss against the reference is above every budget
    (:func:`cascades`)."""
    if not cascades(ctx.cfg):
        return ""
    lower = next((v for k, v in ctx.metrics.items() if k.endswith("_ref_loss_lower")), None)
    budgets, alpha = ctx.cfg.decision.budgets, ctx.cfg.probe.accuracy.adaptive_alpha
    if lower is None or lower <= max(budgets):
        return ""
    return (f"excluded by the decision metric: its perplexity loses at least {lower:.3g} against the reference "
            f"(error {alpha:g}), above every budget ({', '.join(f'{b:g}' for b in budgets)}); lm-eval here could "
            f"only describe a point no budget can pick (probe.accuracy.cascade=false scores it)")


class AccuracyProbe:
    """lm-eval tasks on the local benchmark files (per-document scores as
    items); adaptive: documents scored until each budget is decided."""

    name, order, contention_metric = "accuracy", 30, None

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.accuracy.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        cfg, acc, out = ctx.cfg, ctx.cfg.probe.accuracy, ProbeResult()
        if why := excluded(ctx):
            out.tags["probe.accuracy.skipped"] = why
            ctx.log("lm-eval skipped: %s", why)
            return out
        ctx.log("lm-eval %s (limit %s%s)", ",".join(acc.tasks), acc.limit, ", adaptive" if acc.adaptive else "")
        if acc.adaptive:
            metrics, results, items, stops = accuracy_adaptive.run(
                ctx.engine, ctx.tokenizer, acc, cfg.data_dir, cfg.cache_dir, cfg.draws_seed, ctx.reference_key(),
                ctx.engine_for_reference, ctx.baseline_candidate(), ctx.identical_to_reference(),
                lambda line: ctx.log("lm-eval: %s", line))
            out.tags[point.ACC_STOP_TAG] = "; ".join(f"{t}: {why}" for t, why in stops.items())
            ctx.log("lm-eval: %s", out.tags[point.ACC_STOP_TAG])
        else:
            metrics, results, items = accuracy.evaluate(ctx.engine, ctx.tokenizer, acc, cfg.data_dir, cfg.cache_dir,
                                                        cfg.draws_seed)
        out.metrics.update(metrics)
        out.items.update(items)
        out.artifacts["lm_eval_results.json"] = json.dumps(results, indent=2, default=str)
        return out


class CacheProbe:
    """Teacher-forced decoding through the point's KV cache, where the engine has one."""

    name, order, contention_metric = "cache", 40, None

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.cache.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        cfg, c, out = ctx.cfg, ctx.cfg.probe.cache, ProbeResult()
        if why := ctx.engine.cannot("cache"):
            out.tags["probe.cache.skipped"] = why
            return out
        n = c.prefix_tokens + c.continuation_tokens
        out.tags["probe.cache.corpus"] = corpus.resolve(c.corpus, cfg.data_dir)
        wins = corpus.token_ids(ctx.tokenizer, c.corpus, n * c.windows, cfg.data_dir).reshape(c.windows, n)
        ctx.log("cache probe (%d x %d tokens, chunk %d)", c.windows, n, c.chunk)
        compute_bytes = ctx.model.get_input_embeddings().weight.dtype.itemsize
        out.metrics.update(cache_probe.probe(ctx.engine, ctx.model.config, wins, c, compute_bytes))
        return out


class KVPositionProbe:
    """The cache's error by position bucket, out to long contexts, and the
    first bucket whose KL bound passes the tolerance."""

    name, order, contention_metric = "kv_position", 45, None

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.kv_position.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        cfg, c, out = ctx.cfg, ctx.cfg.probe.kv_position, ProbeResult()
        if why := ctx.engine.cannot("cache"):
            out.tags["probe.kv_position.skipped"] = why
            return out
        out.tags["probe.kv_position.corpus"] = corpus.resolve(c.corpus, cfg.data_dir)
        wins, _ = corpus.random_windows(ctx.tokenizer, corpus.text(c.corpus, cfg.data_dir), c.length, c.windows,
                                        cfg.draws_seed)
        ctx.log("KV error by position (%d windows of %d tokens, chunk %d)", c.windows, c.length, c.chunk)
        metrics, items, over = kv_position.probe(ctx.engine, wins, c.chunk, c.buckets, c.tolerance)
        out.metrics.update(metrics)
        out.items.update(items)
        out.tags["kvpos.first_over"] = over or f"none to {c.length} tokens (KL tolerance {c.tolerance:g})"
        return out


class PasskeyProbe:
    """Retrieval at a distance through the point's cache: the passkey task by
    length and depth (:mod:`quantlab.probes.passkey`)."""

    name, order, contention_metric = "passkey", 46, None

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.passkey.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        c, out = ctx.cfg.probe.passkey, ProbeResult()
        cells = passkey.trials(ctx.tokenizer, c.lengths, c.depths, c.trials, c.digits, ctx.cfg.draws_seed)
        ctx.log("passkey (%d lengths x %d depths x %d keys of %d digits, chunk %d)", len(c.lengths),
                len(c.depths), c.trials, c.digits, c.chunk)
        metrics, items, table = passkey.probe(ctx.engine, cells, c.chunk, ctx.log)
        out.metrics.update(metrics)
        out.items.update(items)
        out.artifacts["passkey.md"] = (f"Passkey found by greedy decoding through the cache, trials per cell "
                                       f"(length in tokens x depth of the key):\n\n{table}\n")
        if why := ctx.engine.cannot("cache"):
            out.tags["passkey.reference"] = f"none: {why}"
        return out


class LatencyProbe:
    """Grid timings (TTFT, TPOT percentiles, throughput), stage table,
    roofline and energy; raw samples as CSV."""

    name, order, contention_metric = "latency", 50, "sys/foreign_cpu_cores"

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.latency.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        cfg, lat, engine, out = ctx.cfg, ctx.cfg.probe.latency, ctx.engine, ProbeResult()
        if lat.on_emulated == "skip" and ctx.tags.get(point.EMULATED_TAG) == "true":
            out.tags["probe.latency.skipped"] = ("emulated: no real kernel for this scheme here, so its timing would "
                                                 "not be the scheme's (probe.latency.on_emulated=skip)")
            ctx.log("latency probe skipped: %s", out.tags["probe.latency.skipped"])
            return out
        ctx.log("latency probe (%d cells, %d new tokens, >= %d requests per cell)", len(latency.cells(lat)),
                lat.new_tokens, lat.repeats)
        prompt = corpus.prompt_text(ctx.tokenizer, max(p for _, p in latency.cells(lat)))
        why = engine.cannot("energy")
        counter, why = (None, why) if why else energy.open_counter(engine.device)
        load_before = os.getloadavg()[0]
        timed, raw = latency.measure(engine, ctx.tokenizer, prompt, lat, counter,  # joules of timed requests only
                                     lambda line: ctx.log("latency: %s", line))
        out.metrics.update(timed)
        out.metrics["sys/load1"] = max(load_before, os.getloadavg()[0])
        out.tags["threads"] = str(torch.get_num_threads())
        if not counter:
            out.tags["energy.reason"] = why
        if not engine.cannot("roofline") and "lat/tpot_ms_p50" in timed:
            peak = roofline.host_bandwidth(cfg.cache_dir, engine.device)
            _, p = latency.cells(lat)[0]
            kv_mid = timed.get("mem/kv_mb", 0.0) * 2**20 * (p + lat.new_tokens / 2) / (p + lat.new_tokens)
            out.metrics.update(roofline.utilisation(ctx.weight_bytes_read() + kv_mid, timed["lat/tpot_ms_p50"], peak))
        out.artifacts["latency_samples.csv"] = latency.samples_csv(raw)
        if lat.stages and (why := engine.cannot("stages")):
            out.tags["probe.stages.skipped"] = why
        elif lat.stages:
            samples, totals = stages.measure(engine, ctx.tokenizer, prompt, lat.prompt_tokens,
                                             max(lat.new_tokens - 1, 1), lat.stage_requests, lat.batch_size)
            csv, stage_metrics = stages.table(samples, totals)
            out.metrics.update(stage_metrics)
            out.artifacts["stages.csv"] = csv
        return out


class LoadProbe:
    """Open-loop load per policy and rate (knee, SLO attainment, plots), then
    (with a budget) KV capacity."""

    name, order, contention_metric = "load", 60, "load/foreign_cpu_cores"

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.probe.load.enabled

    def run(self, ctx: ProbeContext) -> ProbeResult:
        cfg, lc, engine, tok, out = ctx.cfg, ctx.cfg.probe.load, ctx.engine, ctx.tokenizer, ProbeResult()
        ids = corpus.token_ids(tok, "auto", max(lc.prompt_tokens * 16, lc.kv_context), cfg.data_dir)[0]
        if lc.prompts == "paragraphs":
            prompts = corpus.paragraph_ids(tok, "auto", cfg.data_dir, lc.prompt_tokens, lc.prompt_tokens_min, 64)
        else:
            prompts = [ids[i * lc.prompt_tokens:(i + 1) * lc.prompt_tokens] for i in range(16)]
        peak = 0.0 if engine.cannot("roofline") else roofline.host_bandwidth(cfg.cache_dir, engine.device)
        ctx.log("load probe (%s, %s arrivals, %g s per rate, policies %s)",
                "rates auto" if lc.rates == "auto" else f"rates {lc.rates}", lc.arrival, lc.duration_s,
                ",".join(lc.policies))
        metrics, rows, tags = load.measure(engine, prompts, lc, ctx.weight_bytes_read(), peak, cfg.seed,
                                           lambda line: ctx.log("load: %s", line))
        out.metrics.update(metrics)
        out.tags.update(tags)
        if rows:
            out.artifacts["load.csv"] = load.csv_text(rows)
            series = {p: [r for r in rows if r["policy"] == p] for p in dict.fromkeys(r["policy"] for r in rows)}
            slo = {"ttft_ms": lc.slo.ttft_ms, "tpot_ms": lc.slo.tpot_ms}
            with tempfile.TemporaryDirectory() as d:
                out.artifacts["load.png"] = plots.load_png(series, Path(d) / "load.png", f"{ctx.name}: load",
                                                           slo).read_bytes()
                out.artifacts["load.html"] = plots.load_html(series, Path(d) / "load.html",
                                                             f"{ctx.name}: load").read_text()
        if lc.kv_budget_mb is not None and (why := engine.cannot("cache")):
            out.tags["load.kv_capacity.skipped"] = why
        elif lc.kv_budget_mb is not None:
            ctx.log("KV capacity in %g MiB at %d tokens", lc.kv_budget_mb, lc.kv_context)
            out.metrics.update(kv_capacity.measure(engine, ids, lc))
        return out


