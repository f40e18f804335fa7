"""The perplexity probe's windows scored one a forward against several a forward, side by side.

    python benchmarks/ppl_batch.py [--model smollm2|tiny] [--schemes fp32,bf16,int8,int4-g64]
        [--window 128] [--windows 16] [--batches 1,4,16] [--rounds 3]

Every point lives in this one process; each round times every (scheme, batch)
pair once, interleaved, so a noisy neighbour slows a whole round alike. Per
pair: the least seconds over the rounds to score ``--windows`` random
WikiText-2 windows (the built-in text without ``QUANTLAB_DATA_DIR``), the ratio
to one window a forward, and the largest difference of any token's NLL from
the one-a-forward scoring (what batching changes in the numbers; 0 where the
kernels do not depend on the batch). ``quantlab.probes.perplexity.BATCH_TOKENS``
is chosen from this table.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from quantlab import corpus, models
from quantlab.probes import perplexity
from quantlab.schemes.kv import NoKV
from quantlab.schemes.kv import apply as kv_apply
from quantlab.targets.cpu import CPUTarget, CPUTargetConfig

from runtimes import SCHEMES, model_config, quantized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    ap.add_argument("--schemes", default="fp32,bf16,int8,int4-g64", help=f"fp32 or of {', '.join(SCHEMES)}")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--batches", default="1,4,16", help="windows a forward; the first is the ratios' base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"))
    ap.add_argument("--cache-dir", default=os.environ.get("QUANTLAB_CACHE", "~/.cache/quantlab"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, batches = model_config(args.model), [int(b) for b in args.batches.split(",")]
    engines, tok = {}, None
    for s in args.schemes.split(","):
        model, tok = models.load(cfg, args.cache_dir) if s == "fp32" else quantized(cfg, s, args.cache_dir, None)[:2]
        engines[s] = CPUTarget(CPUTargetConfig()).engine(model, kv_apply(model, NoKV(), None), tok)
    if args.data_dir:
        raw = perplexity.wikitext2_text(args.data_dir)
        wins, _, _ = perplexity.sample(tok, raw, args.window, args.windows, 0)
    else:
        wins = corpus.token_ids(tok, "builtin", args.window * args.windows)[0].reshape(-1, args.window)
    secs, nll = {}, {}
    for r in range(args.rounds):  # token_nll: the probe's own scoring, at b windows a forward
        for s, eng in engines.items():
            for b in batches:
                t = time.perf_counter()
                nll[(s, b)] = perplexity.token_nll(eng, wins, b)
                secs.setdefault((s, b), []).append(time.perf_counter() - t)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{len(wins)} windows of {args.window} tokens, {args.threads} threads, least of {args.rounds} rounds")
    print(f"{'scheme':<10} {'windows/forward':>15} {'seconds':>8} {'speed-up':>8} {'max |dNLL|':>11}")
    for s in engines:
        base = min(secs[(s, batches[0])])
        for b in batches:
            diff = float(np.abs(nll[(s, b)] - nll[(s, batches[0])]).max())
            print(f"{s:<10} {b:>15} {min(secs[(s, b)]):>8.2f} {base / min(secs[(s, b)]):>7.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
