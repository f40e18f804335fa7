"""Decode-loop latency: TTFT, per-token latency, throughput, peak RSS.

One request = tokenize -> prefill -> sample first token (TTFT ends here) ->
``new_tokens - 1`` decode steps, each timed on its own (TPOT samples), in the
engine's run of the shared loop (:mod:`quantlab.decode`). Nothing is derived
by subtraction, so no figure can go negative. Greedy sampling. Warm-up
requests are run and discarded first.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from quantlab.probes.configs import LatencyProbeConfig
from quantlab.decode import Clock
from quantlab.probes.memory import PeakRSS
from quantlab.stats import summarize


@dataclass
class RequestTiming:
    tokenize_ms: float
    prefill_ms: float  # forward over the prompt + first sample
    ttft_ms: float  # tokenize + prefill + first sample
    step_ms: list[float] = field(default_factory=list)
    kv_bytes: int = 0  # what the cache held at the end of the request

    @property
    def e2e_ms(self) -> float:
        return self.ttft_ms + sum(self.step_ms)


def run_request(engine, tokenizer, prompt: str, cfg: LatencyProbeConfig, clock: Clock,
                batch: int | None = None, prompt_tokens: int | None = None) -> RequestTiming:
    """Time one batched greedy generation of ``cfg.new_tokens`` tokens (batch and
    prompt length default to the primary cell's): tokenize here, decode in the
    engine's loop."""
    batch, prompt_tokens = batch or cfg.batch_size, prompt_tokens or cfg.prompt_tokens
    t0 = clock.now_ms()
    ids = tokenizer([prompt] * batch, return_tensors="pt", add_special_tokens=False)
    ids = ids["input_ids"][:, :prompt_tokens]
    tokenize_ms = clock.now_ms() - t0
    out = engine.decode(ids, cfg.new_tokens, clock)
    return RequestTiming(tokenize_ms=tokenize_ms, prefill_ms=out.prefill_ms, ttft_ms=tokenize_ms + out.prefill_ms,
                         step_ms=out.step_ms, kv_bytes=out.kv_bytes)


def cells(cfg: LatencyProbeConfig) -> list[tuple[int, int]]:
    """The primary cell first, then the rest of the grid."""
    grid = [(b, p) for b in cfg.grid_batch_sizes or [cfg.batch_size]
            for p in cfg.grid_prompt_tokens or [cfg.prompt_tokens]]
    primary = (cfg.batch_size, cfg.prompt_tokens)
    return [primary, *(c for c in grid if c != primary)]


def cell_prompt(tokenizer, prompt: str, prompt_tokens: int) -> str:
    """The start of ``prompt`` that covers ``prompt_tokens`` tokens (one token
    more, so retokenizing the cut text cannot come up short), so that a cell's
    TTFT includes tokenizing its own prompt, not the longest cell's."""
    if not getattr(tokenizer, "is_fast", False):  # offsets need a fast tokenizer
        return prompt
    offsets = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) <= prompt_tokens:
        return prompt
    return prompt[:offsets[prompt_tokens][1]]


def measure_cell(engine, tokenizer, prompt: str, cfg: LatencyProbeConfig, batch: int,
                 prompt_tokens: int, counter=None) -> tuple[dict[str, float], list[RequestTiming]]:
    """Warm-up, then requests until ``repeats`` and ``min_seconds`` are both met.
    With an energy ``counter`` (``probes.energy``), joules are read over the
    timed requests only, never the warm-up, and divided by their tokens."""
    clock = engine.clock()
    prompt = cell_prompt(tokenizer, prompt, prompt_tokens)
    for _ in range(cfg.warmup):
        run_request(engine, tokenizer, prompt, cfg, clock, batch, prompt_tokens)
    runs: list[RequestTiming] = []
    began = time.perf_counter()
    e0 = counter.read() if counter else None
    with PeakRSS(cfg.rss_sample_hz) as rss:
        while len(runs) < cfg.max_repeats and (
                len(runs) < cfg.repeats or time.perf_counter() - began < cfg.min_seconds):
            runs.append(run_request(engine, tokenizer, prompt, cfg, clock, batch, prompt_tokens))
    joules = counter.delta(e0, counter.read()) if counter else None
    steps = [s for r in runs for s in r.step_ms]
    metrics = {
        **summarize("lat/ttft_ms", [r.ttft_ms for r in runs]),
        **summarize("lat/prefill_ms", [r.prefill_ms for r in runs]),
        **summarize("lat/e2e_ms", [r.e2e_ms for r in runs]),
        "mem/peak_rss_mb": rss.peak_bytes / 2**20,
        "mem/kv_mb": runs[-1].kv_bytes / 2**20,
    }
    if steps:
        metrics.update(summarize("lat/tpot_ms", steps))
        metrics["tput/decode_tok_s"] = batch * 1000.0 / metrics["lat/tpot_ms_mean"]
        per_request = [statistics.median(r.step_ms) for r in runs if r.step_ms]
        if len(per_request) >= 2:  # the spread of one request's TPOT to the next: what the P50 can resolve
            metrics["lat/tpot_ms_req_lo"], metrics["lat/tpot_ms_req_hi"] = min(per_request), max(per_request)
    total_ms = sum(r.e2e_ms for r in runs)
    metrics["tput/e2e_tok_s"] = batch * cfg.new_tokens * len(runs) * 1000.0 / total_ms
    metrics["tput/req_s"] = batch * len(runs) * 1000.0 / total_ms
    if joules is not None:
        metrics["energy/joules"] = joules
        metrics["energy/tok_per_j"] = batch * cfg.new_tokens * len(runs) / joules if joules > 0 else 0.0
    return metrics, runs


def measure(engine, tokenizer, prompt: str, cfg: LatencyProbeConfig, counter=None,
            progress=None) -> tuple[dict[str, float], list[tuple[int, int, RequestTiming]]]:
    """Every grid cell. The primary cell's metrics keep plain names
    (``lat/tpot_ms_p50``); every other cell logs ``cell/b{B}_p{P}/<name>``.
    ``prompt`` must tokenize to at least the longest prompt length.
    ``progress(line)``, when given, hears each cell's figures as it ends (an
    8,192-token cell takes minutes on a CPU)."""
    need = max(p for _, p in cells(cfg))
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if n < need:
        raise ValueError(f"prompt has {n} tokens, probe needs {need}")
    metrics: dict[str, float] = {"lat/batch_size": float(cfg.batch_size),
                                 "lat/prompt_tokens": float(cfg.prompt_tokens),
                                 "lat/new_tokens": float(cfg.new_tokens)}
    raw: list[tuple[int, int, RequestTiming]] = []
    for i, (b, p) in enumerate(cells(cfg)):
        cell, runs = measure_cell(engine, tokenizer, prompt, cfg, b, p, counter)
        raw += [(b, p, r) for r in runs]
        if progress:
            progress(f"cell batch {b} prompt {p}: TTFT p50 {cell['lat/ttft_ms_p50']:.1f} ms, TPOT p50 "
                     f"{cell.get('lat/tpot_ms_p50', float('nan')):.1f} ms ({len(runs)} requests)")
        if i == 0:
            metrics.update(cell)
            continue
        metrics.update({f"cell/b{b}_p{p}/{k.split('/', 1)[1]}": v for k, v in cell.items()
                        if k.endswith(("_p50", "_p99", "_tok_s", "req_s", "_mb", "_per_j"))})
    return metrics, raw


def samples_csv(raw: list[tuple[int, int, RequestTiming]]) -> str:
    """Every timing sample, for re-analysis: batch,prompt,request,kind,index,ms."""
    lines = ["batch,prompt_tokens,request,kind,index,ms"]
    for i, (b, p, r) in enumerate(raw):
        lines += [f"{b},{p},{i},tokenize,0,{r.tokenize_ms:.6f}", f"{b},{p},{i},prefill,0,{r.prefill_ms:.6f}",
                  f"{b},{p},{i},ttft,0,{r.ttft_ms:.6f}"]
        lines += [f"{b},{p},{i},tpot,{j},{ms:.6f}" for j, ms in enumerate(r.step_ms)]
    return "\n".join(lines) + "\n"
