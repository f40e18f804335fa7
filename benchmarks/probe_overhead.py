"""Overhead of the latency probe against a bare hand-written timing loop.

    python benchmarks/probe_overhead.py [--model smollm2] [--rounds 7] [--tokens 32]

Both time the same greedy decode on the same model in one process, rounds
interleaved (probe, bare, probe, bare, ...). Prints the median per-token
latency of each, their ratio (aim: overhead < 2 %), and the coefficient of
variation of the per-round medians (how much repeats of one point move).
"""
from __future__ import annotations

import argparse
import statistics

import torch
from transformers import DynamicCache

from quantlab import models
from quantlab.config import ModelConfig
from quantlab.probes.configs import LatencyProbeConfig
from quantlab.decode import Clock, decode_loop
from quantlab.engines.pytorch import TorchEngine
from quantlab import corpus
from quantlab.probes.latency import run_request


@torch.inference_mode()
def bare(model, ids: torch.Tensor, steps: int) -> list[float]:
    """The smallest honest decode timer: the shared loop over a bare forward
    (no engine, no tokenizer, no cache accounting)."""
    cache = DynamicCache(config=model.config)

    def forward(x, start):
        return model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1 if start == 0 else 0).logits

    return decode_loop(forward, ids, steps + 1, Clock()).step_ms


def cv(xs: list[float]) -> float:
    return statistics.stdev(xs) / statistics.mean(xs) if len(xs) > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--cache-dir", default="~/.cache/quantlab")
    args = ap.parse_args()
    model, tok = models.load(ModelConfig(name=args.model, source=args.model), args.cache_dir, torch.bfloat16)
    prompt = corpus.prompt_text(tok, args.prompt)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"][:, : args.prompt]
    cfg = LatencyProbeConfig(prompt_tokens=args.prompt, new_tokens=args.tokens + 1)
    clock, engine = Clock(), TorchEngine(model)
    run_request(engine, tok, prompt, cfg, clock)  # warm-up both paths
    bare(model, ids, args.tokens)
    probe_med, bare_med = [], []
    for r in range(args.rounds):
        probe_med.append(statistics.median(run_request(engine, tok, prompt, cfg, clock).step_ms))
        bare_med.append(statistics.median(bare(model, ids, args.tokens)))
        print(f"round {r + 1}: probe {probe_med[-1]:.2f} ms  bare {bare_med[-1]:.2f} ms", flush=True)
    ratios = [p / b for p, b in zip(probe_med, bare_med)]
    print(f"\nprobe / bare TPOT (median of per-round ratios): {statistics.median(ratios):.4f} "
          f"-> overhead {100 * (statistics.median(ratios) - 1):+.2f} %")
    print(f"coefficient of variation across rounds: probe {100 * cv(probe_med):.1f} %, bare {100 * cv(bare_med):.1f} %")


if __name__ == "__main__":
    main()
