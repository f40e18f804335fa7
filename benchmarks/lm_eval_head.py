"""The accuracy probe with the head run from each batch's earliest continuation
token (what ``EngineLM`` asks since it passes ``first``) against the head on
every position, side by side in one process, on SmolLM2-135M.

    QUANTLAB_DATA_DIR=../shared/data python benchmarks/lm_eval_head.py [--rounds 2] [--limit 50]

For each point (fp32, bf16, int8 with bf16 compute) and each round, both
variants score the same ARC-Easy and PIQA documents (the headline probe's
tasks, batch 16), interleaved; prints the median seconds of each, their ratio,
and whether every per-document score agreed. Set ``ATEN_CPU_CAPABILITY`` /
``ONEDNN_MAX_CPU_ISA`` to time another CPU's kernel paths (docs/testing.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from quantlab import hardware, models
from quantlab.config import ModelConfig
from quantlab.probes.configs import AccuracyProbeConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.probes import accuracy
from quantlab.schemes import layers, qlinear
from quantlab.schemes.configs import Int8Scheme
from quantlab.schemes.registry import ApplyContext, weights_handler


class EveryPosition(TorchEngine):
    """The head on every position, as before ``first`` existed."""

    def token_logprobs(self, ids: torch.Tensor, first: int = 0):
        logp, top1 = super().token_logprobs(ids, 0)
        return logp[:, first:], top1[:, first:]


def _point(name: str, cache: str):
    model, tok = models.load(ModelConfig(name="smollm2-135m", source="smollm2"), cache)
    if name == "int8":
        cfg = Int8Scheme(compute_dtype="bfloat16")
        weights_handler(cfg).apply(model, cfg, ApplyContext(hw=hardware.cpu(), tokenizer=tok))
        dtype = torch.bfloat16
    else:
        dtype = getattr(torch, name)
        layers.cast_parameters(model, dtype)  # as the float scheme does
    qlinear.widen(model, dtype)
    return model.eval(), tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--points", default="float32,bfloat16,int8")
    args = ap.parse_args()
    data = os.environ.get("QUANTLAB_DATA_DIR")
    if not data:
        raise SystemExit("set QUANTLAB_DATA_DIR to the benchmark data (ARC-Easy, PIQA)")
    cfg = AccuracyProbeConfig(enabled=True, tasks=["arc_easy_local", "piqa_local"], limit=args.limit, batch_size=16)
    print(f"{hardware.cpu_name()}, {torch.get_num_threads()} threads, ATen {hardware.cpu_vector_isa()}, "
          f"oneDNN bf16 {hardware.cpu_native_matmul(torch.bfloat16)}; {args.limit} documents a task, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'point':10} {'every position s':>17} {'from first s':>13} {'ratio':>6}  scores")
    with tempfile.TemporaryDirectory() as cache:
        for name in args.points.split(","):
            model, tok = _point(name, cache)
            times: dict[str, list[float]] = {"every": [], "first": []}
            items = {}
            for _ in range(args.rounds):
                for kind, engine in (("every", EveryPosition(model)), ("first", TorchEngine(model))):
                    start = time.perf_counter()
                    _, _, items[kind] = accuracy.evaluate(engine, tok, cfg, data, cache, seed=0)
                    times[kind].append(time.perf_counter() - start)
            every, first = statistics.median(times["every"]), statistics.median(times["first"])
            same = "identical" if items["every"] == items["first"] else "DIFFER"
            print(f"{name:10} {every:17.1f} {first:13.1f} {every / first:6.2f}  {same}")


if __name__ == "__main__":
    main()
