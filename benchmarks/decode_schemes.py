"""Decode speed and weight bytes of each weight scheme relative to bf16, CPU, batch 1.

    python benchmarks/decode_schemes.py [--model smollm2-135m] [--rounds 5] [--tokens 32]

All variants live in one process and are timed in interleaved rounds
(bf16, int8, int4, ... then again), so a noisy neighbour slows every variant
of a round alike; the printed ratios are medians over rounds of per-round ratios.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantlab import hardware, models
from quantlab.config import ModelConfig
from quantlab.probes import corpus, size
from quantlab.config import LatencyProbeConfig
from quantlab.decode import Clock
from quantlab.engines.pytorch import TorchEngine
from quantlab.probes.latency import run_request
from quantlab.schemes.bnb4 import BnB4Scheme
from quantlab.schemes.float import FloatScheme
from quantlab.schemes.fp8 import FP8Scheme
from quantlab.schemes.int4 import Int4Scheme
from quantlab.schemes.int8 import Int8Scheme
from quantlab.schemes.registry import ApplyContext, weights_handler

VARIANTS = {
    "bf16": FloatScheme("bfloat16"),
    "fp16": FloatScheme("float16"),
    "int8": Int8Scheme(),
    "int4-g64": Int4Scheme(group_size=64),
    "int4-g32": Int4Scheme(group_size=32),
    "int4-g64+lm_head": Int4Scheme(group_size=64, skip=[]),
    "nf4": BnB4Scheme(),
    "fp8-e4m3 (emulated)": FP8Scheme(),
}


def build(cfg_model: ModelConfig, scheme, cache_dir: str):
    model, tok = models.load(cfg_model, cache_dir)
    n = size.count_params(model)
    weights_handler(scheme).apply(model, scheme, ApplyContext(hw=hardware.cpu(), tokenizer=tok))
    return TorchEngine(model), tok, size.weight_stats(model, n)["size/weight_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default="~/.cache/quantlab")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg_model = ModelConfig(name=args.model, source=args.model)
    built = {name: build(cfg_model, s, args.cache_dir) for name, s in VARIANTS.items()}
    tok = next(iter(built.values()))[1]
    prompt = corpus.prompt_text(tok, args.prompt)
    probe = LatencyProbeConfig(prompt_tokens=args.prompt, new_tokens=args.tokens)
    clock = Clock()
    for model, _, _ in built.values():  # warm-up
        run_request(model, tok, prompt, probe, clock)
    per_round: dict[str, list[float]] = {n: [] for n in built}
    for r in range(args.rounds):
        tpot = {}
        for name, (model, _, _) in built.items():
            t = run_request(model, tok, prompt, probe, clock)
            tpot[name] = statistics.median(t.step_ms)
        for name in built:
            per_round[name].append(tpot["bf16"] / tpot[name])
        print(f"round {r + 1}/{args.rounds}: bf16 TPOT {tpot['bf16']:.1f} ms", flush=True)
    bf16_bytes = built["bf16"][2]
    print(f"\n{'scheme':<22} {'decode speed vs bf16':>22} {'weight bytes vs bf16':>22}")
    for name, (_, _, nbytes) in built.items():
        ratios = per_round[name]
        print(f"{name:<22} {statistics.median(ratios):>16.2f}x (min {min(ratios):.2f}) "
              f"{nbytes / bf16_bytes:>18.3f}")
    print(f"\nthreads={torch.get_num_threads()} host={hardware.cpu_name()} "
          f"load1={__import__('os').getloadavg()[0]:.2f} time={time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
