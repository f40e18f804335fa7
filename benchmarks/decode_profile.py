"""Where one decode step's time goes on the CPU PyTorch engine, per variant:
torch.profiler over decode steps, ops grouped into weight GEMMs, attention, the
compiled graph's own kernels, dynamo's guard check and the rest; beside them the
floor (weight bytes / measured read bandwidth) and the overhead (TPOT minus it).

    python benchmarks/decode_profile.py [--scheme bf16] [--variants eager,compile,compile+freezing]
                                        [--steps 32] [--static 0]

Each variant runs in this process after the last (compile first, then timing),
so the per-category split is what to read, not small TPOT differences between
variants (rerun with the variants reordered to check those).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from runtimes import SCHEMES, quantized  # the speed tables' schemes and how they are built

from quantlab import hardware, targets
from quantlab.config import ModelConfig
from quantlab.targets.cpu import CPUTargetConfig
from quantlab.decode import Clock
from quantlab.probes import roofline
from quantlab.schemes.kv import NoKV, cache_factory
from quantlab.schemes.registry import Applied
GEMM = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
        "aten::_weight_int4pack_mm_for_cpu")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",)
GRAPH, GUARDS = "## Call CompiledFxGraph", "TorchDynamo Cache Lookup"


def category(name: str) -> str | None:
    """The bucket of a profiler row's self time (None: the rest, which is TPOT
    minus the buckets: small ops, Python between them, the profiler's share)."""
    if name in GEMM:
        return "weight GEMMs"
    if name in ATTENTION:
        return "attention"
    if name.startswith(GRAPH):
        return "compiled kernels"
    if name == GUARDS:
        return "guards"
    return None


@contextlib.contextmanager
def inductor(freezing: bool):
    import torch._inductor.config as ic

    with ic.patch(freezing=freezing):
        yield


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--scheme", default="bf16", choices=sorted(SCHEMES))
    ap.add_argument("--variants", default="eager,compile,compile+freezing")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--static", type=int, default=0, help="StaticCache length (0: dynamic cache)")
    ap.add_argument("--cache-dir", default="~/.cache/quantlab")
    ap.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"), help="GPTQ's calibration data")
    args = ap.parse_args()
    peak = roofline.measure_read_bandwidth(torch.device("cpu"))
    print(f"CPU: {hardware.cpu_name()}, {torch.get_num_threads()} threads, read bandwidth {peak / 1e9:.1f} GB/s")
    rows = {}
    for variant in args.variants.split(","):
        model, _, nbytes = quantized(ModelConfig(name=args.model, source=args.model), args.scheme, args.cache_dir,
                                     args.data_dir)
        tcfg = CPUTargetConfig(compile=variant != "eager", static_cache=args.static)
        target = targets.get(tcfg)
        with inductor("freezing" in variant), target.session():  # session: a fresh dynamo cache per variant
            engine = target.engine(model, Applied("none", False, cache_factory(NoKV())))
            prompt = torch.randint(0, engine.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
            engine.decode(prompt, args.steps)  # warm: shapes the timed requests see
            tpot = statistics.median(engine.decode(prompt, args.steps, Clock()).step_ms)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                profiled = engine.decode(prompt, args.steps, Clock())
        # The profiler slows every op: its shares are scaled onto the unprofiled TPOT.
        scale = tpot / statistics.median(profiled.step_ms)
        per_step = collections.Counter()
        for ev in prof.key_averages():
            if (cat := category(ev.key)) is not None:
                per_step[cat] += ev.self_cpu_time_total / 1e3 / (args.steps + 1) * scale
        floor = nbytes / peak * 1e3
        rows[variant] = (tpot, floor, per_step)
        print(f"{variant}: TPOT {tpot:.1f} ms, floor {floor:.1f} ms, ready in {engine.ready_s:.0f} s", flush=True)
    cats = ["weight GEMMs", "attention", "compiled kernels", "guards"]
    print(f"\n{args.scheme}, {args.model}, batch 1, {args.steps} steps after a 32-token prompt, "
          f"{'static cache ' + str(args.static) if args.static else 'dynamic cache'}; ms per step "
          "(profiler shares scaled onto TPOT; the prefill counts as one step); GEMM GB/s: weight bytes over the "
          "GEMMs' time")
    print(f"| variant | TPOT | floor | overhead | {' | '.join(cats)} | rest | GEMM GB/s |")
    print("|---|" + "---|" * (5 + len(cats)))
    for variant, (tpot, floor, per_step) in rows.items():
        split = " | ".join(f"{per_step[c]:.1f}" for c in cats)
        rest = max(tpot - sum(per_step[c] for c in cats), 0.0)
        gemm_gbs = floor * peak / 1e9 / per_step["weight GEMMs"] if per_step["weight GEMMs"] else float("nan")
        print(f"| {variant} | {tpot:.1f} | {floor:.1f} | {tpot - floor:.1f} | {split} | {rest:.1f} | {gemm_gbs:.1f} |")


if __name__ == "__main__":
    main()
