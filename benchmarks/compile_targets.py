"""Eager vs torch.compile (dynamic cache) vs torch.compile + StaticCache on the
CPU target, per weight scheme, batch 1 — through the same Target API a sweep uses.

    python benchmarks/compile_targets.py [--model smollm2] [--rounds 5] [--tokens 32]
                                         [--schemes bf16,int8] [--modes compile]

Every variant is built, compiled and warmed up first (compile seconds printed),
then timed in interleaved rounds; ratios are medians of per-round ratios to the
same scheme's eager run, so a noisy neighbour slows a whole round alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from quantlab import hardware, targets
from quantlab.config import ModelConfig
from quantlab.probes.configs import LatencyProbeConfig
from quantlab.targets.cpu import CPUTargetConfig
from quantlab.decode import Clock
from quantlab import corpus
from quantlab.probes.latency import run_request
from quantlab.schemes.float import FloatScheme
from quantlab.schemes.int4 import Int4Scheme
from quantlab.schemes.int8 import Int8Scheme
from quantlab.schemes.registry import ApplyContext, weights_handler

SCHEMES = {"bf16": FloatScheme("bfloat16"), "int8": Int8Scheme(), "int4-g64": Int4Scheme(group_size=64)}
MODES = {"eager": CPUTargetConfig(), "compile": CPUTargetConfig(compile=True),
         "compile+static": CPUTargetConfig(compile=True, static_cache=256)}


def main() -> None:
    from transformers import DynamicCache

    from quantlab import models
    from quantlab.schemes.registry import Applied

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"subset of {','.join(SCHEMES)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)} (eager is always run)")
    ap.add_argument("--cache-dir", default="~/.cache/quantlab")
    args = ap.parse_args()
    schemes = {k: SCHEMES[k] for k in args.schemes.split(",")}
    modes = {k: MODES[k] for k in ["eager", *(m for m in args.modes.split(",") if m != "eager")]}
    torch._dynamo.config.recompile_limit = 64  # several compiled models live side by side here
    probe = LatencyProbeConfig(prompt_tokens=args.prompt, new_tokens=args.tokens)
    clock = Clock()
    built = {}
    for sname, scheme in schemes.items():
        for mname, tcfg in modes.items():
            target = targets.get(tcfg)
            model, tok = models.load(ModelConfig(name=args.model, source=args.model), args.cache_dir)
            weights_handler(scheme).apply(model, scheme, ApplyContext(hw=hardware.cpu(), tokenizer=tok))
            t = time.perf_counter()
            engine = target.engine(model, Applied("transformers.DynamicCache", False, DynamicCache))
            run_request(engine, tok, corpus.prompt_text(tok, args.prompt), probe, clock)
            print(f"{sname:<9} {mname:<15} ready in {time.perf_counter() - t:6.1f} s", flush=True)
            built[(sname, mname)] = (engine, tok)
    prompt = corpus.prompt_text(next(iter(built.values()))[1], args.prompt)
    ratio: dict[tuple[str, str], list[float]] = {k: [] for k in built}
    ttft: dict[tuple[str, str], list[float]] = {k: [] for k in built}
    for r in range(args.rounds):
        tpot = {}
        for key, (engine, tok) in built.items():
            t = run_request(engine, tok, prompt, probe, clock)
            tpot[key] = statistics.median(t.step_ms)
            ttft[key].append(t.ttft_ms)
        for s, m in built:
            ratio[(s, m)].append(tpot[(s, "eager")] / tpot[(s, m)])
        print(f"round {r + 1}/{args.rounds}: bf16 eager TPOT {tpot[('bf16', 'eager')]:.1f} ms", flush=True)
    print(f"\n{'scheme':<9} {'mode':<15} {'decode speed vs eager':>22} {'TTFT vs eager':>14}")
    for s, m in built:
        t_ratio = statistics.median(ttft[(s, "eager")]) / statistics.median(ttft[(s, m)])
        print(f"{s:<9} {m:<15} {statistics.median(ratio[(s, m)]):>16.2f}x (min {min(ratio[(s, m)]):.2f})"
              f" {t_ratio:>13.2f}x")
    print(f"\nthreads={torch.get_num_threads()} host={hardware.cpu_name()} "
          f"load1={os.getloadavg()[0]:.2f} time={time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
