"""Decode-loop latency: TTFT, per-token latency, throughput, peak RSS.

One request = tokenize -> prefill -> sample first token (TTFT ends here) ->
``new_tokens - 1`` decode steps, each timed on its own (TPOT samples). Nothing
is derived by subtraction, so no figure can go negative. Greedy sampling.
Warm-up requests are run and discarded first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from quantlab.config import LatencyProbeConfig
from quantlab.probes.memory import PeakRSS
from quantlab.stats import summarize


class Clock:
    """Wall clock in ms; synchronizes CUDA first so queued kernels are counted."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter_ns() / 1e6


@dataclass
class RequestTiming:
    tokenize_ms: float
    prefill_ms: float  # forward over the prompt + first sample
    ttft_ms: float  # tokenize + prefill + first sample
    step_ms: list[float] = field(default_factory=list)

    @property
    def e2e_ms(self) -> float:
        return self.ttft_ms + sum(self.step_ms)


@torch.inference_mode()
def run_request(model, tokenizer, prompt: str, cfg: LatencyProbeConfig, clock: Clock,
                cache_factory=DynamicCache) -> RequestTiming:
    """Time one batched greedy generation of ``cfg.new_tokens`` tokens."""
    device = next(model.parameters()).device
    t0 = clock.now_ms()
    ids = tokenizer([prompt] * cfg.batch_size, return_tensors="pt", add_special_tokens=False)
    ids = ids["input_ids"][:, : cfg.prompt_tokens].to(device)
    t1 = clock.now_ms()
    cache = cache_factory(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    t2 = clock.now_ms()
    timing = RequestTiming(tokenize_ms=t1 - t0, prefill_ms=t2 - t1, ttft_ms=t2 - t0)
    for _ in range(cfg.new_tokens - 1):
        s = clock.now_ms()
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        timing.step_ms.append(clock.now_ms() - s)
    return timing


def measure(model, tokenizer, prompt: str, cfg: LatencyProbeConfig,
            cache_factory=DynamicCache) -> tuple[dict[str, float], list[RequestTiming]]:
    """Run warm-up + measured requests; return flat metrics and raw timings.

    ``prompt`` must tokenize to at least ``cfg.prompt_tokens`` tokens.
    """
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if n < cfg.prompt_tokens:
        raise ValueError(f"prompt has {n} tokens, probe needs {cfg.prompt_tokens}")
    clock = Clock(next(model.parameters()).device)
    for _ in range(cfg.warmup):
        run_request(model, tokenizer, prompt, cfg, clock, cache_factory)
    with PeakRSS(cfg.rss_sample_hz) as rss:
        runs = [run_request(model, tokenizer, prompt, cfg, clock, cache_factory)
                for _ in range(cfg.repeats)]
    steps = [s for r in runs for s in r.step_ms]
    metrics = {
        **summarize("lat/ttft_ms", [r.ttft_ms for r in runs]),
        **summarize("lat/prefill_ms", [r.prefill_ms for r in runs]),
        **summarize("lat/e2e_ms", [r.e2e_ms for r in runs]),
        "mem/peak_rss_mb": rss.peak_bytes / 2**20,
        "lat/batch_size": float(cfg.batch_size),
        "lat/prompt_tokens": float(cfg.prompt_tokens),
        "lat/new_tokens": float(cfg.new_tokens),
    }
    if steps:
        metrics.update(summarize("lat/tpot_ms", steps))
        metrics["tput/decode_tok_s"] = cfg.batch_size * 1000.0 / metrics["lat/tpot_ms_mean"]
    total_tokens = cfg.batch_size * cfg.new_tokens * len(runs)
    metrics["tput/e2e_tok_s"] = total_tokens * 1000.0 / sum(r.e2e_ms for r in runs)
    return metrics, runs
