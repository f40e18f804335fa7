"""The packed weight-only kernels against the dequantized-fp32 GEMM, per number
of tokens in a call and per activation dtype, side by side in one process.

    python benchmarks/prefill_path.py [--rounds 5] [--k 576] [--n 1536]

Prints, for Int8Linear and Int4Linear (g64) of one SmolLM2-sized layer
(576 -> 1536), the median milliseconds of a call through ATen's packed kernel
and through the dequantized weight in fp32 (what ``quantlab.schemes.qlinear``
takes from ``DENSE_MIN_TOKENS`` tokens where ``kernel_fast`` is false), at 1 to
512 tokens, variants interleaved round by round; and which path quantlab takes
on this CPU. The ratio says where the packed kernel has no vectorized path.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from quantlab import hardware
from quantlab.schemes import qlinear
from quantlab.schemes.qlinear import Int4Linear, Int8Linear

TOKENS = (1, 4, 16, 64, 128, 512)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _call_ms(fn, calls: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=1536)
    args = ap.parse_args()
    torch.manual_seed(0)
    lin = nn.Linear(args.k, args.n, bias=False)
    variants = {}
    for dtype in DTYPES:
        mods = {"int8": Int8Linear.from_linear(lin, dtype), "int4-g64": Int4Linear.from_linear(lin, 64, False, dtype)}
        for m in TOKENS:
            x = torch.randn(m, args.k).to(dtype)
            for kind, mod in mods.items():
                variants[(kind, dtype, m, "kernel")] = lambda mod=mod, x=x: _kernel(mod, x)
                variants[(kind, dtype, m, "dense")] = lambda mod=mod, x=x, d=dtype: qlinear._dense(x, mod.dequantize(), d)
    times: dict = {key: [] for key in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()  # warm-up
        for _ in range(args.rounds):
            for key, fn in variants.items():
                times[key].append(_call_ms(fn))
    print(f"{hardware.cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"layer {args.k} -> {args.n}; median of {args.rounds} interleaved rounds, ms per call")
    print(f"{'layer':9s} {'dtype':9s} {'tokens':>6s} {'kernel':>9s} {'dense fp32':>10s} {'kernel/dense':>12s}  quantlab")
    for (kind, dtype, m, path) in variants:
        if path != "kernel":
            continue
        k_ms = statistics.median(times[(kind, dtype, m, "kernel")])
        d_ms = statistics.median(times[(kind, dtype, m, "dense")])
        name = str(dtype).removeprefix("torch.")
        took = "dense" if qlinear.dense_path(m, dtype) else "kernel"
        print(f"{kind:9s} {name:9s} {m:6d} {k_ms:9.3f} {d_ms:10.3f} {k_ms / d_ms:12.2f}  {took}")


def _kernel(mod, x):
    """The module's forward with the dense path switched off."""
    saved, qlinear.DENSE_MIN_TOKENS = qlinear.DENSE_MIN_TOKENS, 10**9
    try:
        return mod(x)
    finally:
        qlinear.DENSE_MIN_TOKENS = saved


if __name__ == "__main__":
    main()
