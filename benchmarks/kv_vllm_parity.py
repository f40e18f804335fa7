"""Calibrated FP8 KV scales, measured by quantlab and served by vLLM: does
vLLM, reading the exported ``k_scale``/``v_scale``, lose what quantlab says
the cache loses, position bucket by position bucket?

One model (SmolLM2-135M in bf16 by default), one calibration (``scheme/kv=fp8-cal``'s
own path: per-tensor scales from the point's keys and values over the
calibration set), the same random WikiText-2 windows the ``kv_position``
probe draws (``corpus.random_windows``, same seed):

* quantlab: the point's cache fed ``--chunk`` tokens at a time against the
  same engine without a cache (``kv_position.per_position``): the NLL
  difference on each actual next token (and the KL, which vLLM cannot give
  cheaply: whole-vocabulary prompt log-probs are 49,152 JSON entries a
  position); and the same cache converting to E4M3 by truncation
  (:class:`TowardZeroFp8Layer`) instead of to nearest;
* vLLM: quantlab's export of the point (bf16 weights, ``kv_cache_scheme`` and
  the scales) served with ``--kv-cache-dtype fp8``, and an export without
  scales served with ``auto`` (the unquantized cache: vLLM serves a
  checkpoint that declares ``kv_cache_scheme`` in fp8 even under ``auto``) and
  with ``fp8`` (vLLM's default scale 1.0); per position the fp8 server's NLL
  minus the unquantized one's on the same tokens. vLLM's CPU
  attention reads every position, the prompt's own included, back from the
  quantized cache; quantlab's first chunk attends its own states.

Each bucket: the mean over windows (the unit) +- se, and the paired
difference vLLM - quantlab +- se (windows paired): parity when it is within
2 se. Printed as a markdown table.

    python benchmarks/kv_vllm_parity.py [--windows 4] [--length 2048] [--chunk 64]

Needs vLLM's venv (``bash scripts/build_vllm_venv.sh``; ``$QUANTLAB_VLLM_PYTHON``) and
``QUANTLAB_DATA_DIR``.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from quantlab import corpus, hardware, models, targets
from quantlab.config import ModelConfig
from quantlab.export import checkpoint
from quantlab.probes import kv_position
from quantlab.schemes.configs import FP8KV, FloatScheme
from quantlab.schemes.kv import Fp8CalibratedLayer, KVCache
from quantlab.schemes.registry import Applied, ApplyContext, kv_handler, weights_handler
from quantlab.serving.vllm_server import ServerArgs, VllmServer, python_path
from quantlab.targets.cpu import CPUTargetConfig


class TowardZeroFp8Layer(Fp8CalibratedLayer):
    """The calibrated FP8 cache with conversion by truncation (round toward
    zero) instead of to nearest: what vLLM 0.32's CPU cache was measured to
    match (docs/results/2026-12-05-epyc-avx512bf16-kv-vllm-parity.md)."""

    def _quantize(self, tensor, scale=None):
        return toward_zero_e4m3(tensor.float() / scale), scale


def toward_zero_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` as E4M3 rounded toward zero, saturated at +-448: the nearest
    value, stepped one code down in magnitude where it lies above ``|x|``
    (E4M3's codes order magnitudes within each sign)."""
    x = x.clamp(-448.0, 448.0)
    q = x.to(torch.float8_e4m3fn)
    bits = q.view(torch.uint8)
    over = (q.float().abs() > x.abs()) & ((bits & 0x7F) > 0)
    return torch.where(over, bits - 1, bits).view(torch.float8_e4m3fn)


def vllm_nll(python: str, model_dir: Path, kv_dtype: str, windows: torch.Tensor) -> np.ndarray:
    """``[W, T - 1]``: the server's NLL of token ``t + 1`` after ``t + 1`` tokens."""
    args = ServerArgs(model_dir, dtype="bfloat16", max_model_len=windows.shape[1] + 8, kv_cache_dtype=kv_dtype,
                      max_logprobs=1, max_num_seqs=1)
    server = VllmServer(python, args, None, 600.0)
    try:
        rows = []
        for row in windows.tolist():
            dist = server.prompt_logprobs(row, 1, last=False)
            rows.append([-dist[t][row[t + 1]][0] for t in range(len(dist))])
        return np.asarray(rows, dtype=np.float64)
    finally:
        server.close()


def cell(s: dict[str, float], z: bool = False) -> str:
    """A bucket's ``mean +- se`` (``kv_position.bucket_stats``), with ``z = mean / se``."""
    out = f"{s['mean']:+.2e} +- {s['stderr']:.1e}"
    return f"{out} ({s['mean'] / s['stderr']:+.1f})" if z and s["stderr"] > 0 else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--buckets", default="256,1024,2048,4096")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    python = python_path(None)
    if not python:
        raise SystemExit("no vLLM venv: bash scripts/build_vllm_venv.sh (or set QUANTLAB_VLLM_PYTHON)")
    data_dir = os.environ.get("QUANTLAB_DATA_DIR")
    t0 = time.perf_counter()
    model, tok = models.load(ModelConfig(name="smollm2-135m", source="smollm2"), os.path.expanduser("~/.cache/quantlab"))
    ctx = ApplyContext(hw=hardware.cpu(), tokenizer=tok, cache_dir=os.path.expanduser("~/.cache/quantlab"),
                       data_dir=data_dir, seed=a.seed)
    weights_handler(FloatScheme()).apply(model, FloatScheme(), ctx)  # bf16
    kv = FP8KV(scales="calibrated")
    applied = kv_handler(kv).apply(model, kv, ctx)
    wins, _ = corpus.random_windows(tok, corpus.text("wikitext2", data_dir), a.length, a.windows, a.seed)
    cpu = targets.get(CPUTargetConfig())
    kl, dnll_q = kv_position.per_position(cpu.engine(model, applied, tok), wins, a.chunk)  # tokens chunk .. T-1
    scales = [(layer.k_scale, layer.v_scale) for layer in applied.cache_factory(config=model.config).layers]
    rtz = Applied("TowardZeroFp8Layer", True, partial(KVCache, lambda i: TowardZeroFp8Layer(*scales[i])), kv)
    _, dnll_z = kv_position.per_position(cpu.engine(model, rtz, tok), wins, a.chunk)
    t_q = time.perf_counter() - t0
    k_scales = [float(k) for k, _ in scales]
    v_scales = [float(v) for _, v in scales]

    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        cal, plain = Path(d) / "cal", Path(d) / "plain"
        for dest, extra in ((cal, applied.checkpoint), (plain, None)):
            dest.mkdir()
            checkpoint.write(copy.deepcopy(model), tok, {"format": "hf", "dtype": "bfloat16"}, None, dest, extra)
        # a checkpoint with kv_cache_scheme is served fp8 even under "auto" (vLLM honours the
        # checkpoint's cache unless told otherwise, and its CPU build takes no explicit bfloat16):
        # the unquantized reference is the export without scales
        auto = vllm_nll(python, plain, "auto", wins)
        fp8 = vllm_nll(python, cal, "fp8", wins)
        unit = vllm_nll(python, plain, "fp8", wins)
    t_v = time.perf_counter() - t1
    dnll_v = (fp8 - auto)[:, a.chunk - 1:]  # the same predicted tokens as quantlab's columns
    dnll_1 = (unit - auto)[:, a.chunk - 1:]

    edges = [int(x) for x in a.buckets.split(",")]
    buckets = [(lo, hi) for lo, hi in kv_position.bucket_edges(edges, a.length) if hi > a.chunk]
    print("# Calibrated FP8 KV: quantlab's measurement against vLLM serving the exported scales\n")
    print(f"host: {platform.processor() or hardware.cpu().name}, {os.cpu_count()} cores; "
          f"{a.windows} windows x {a.length} WikiText-2 tokens (seed {a.seed}), quantlab chunk {a.chunk}; "
          f"quantlab {t_q:.0f} s, vLLM (3 servers) {t_v:.0f} s")
    print(f"k_scale {min(k_scales):.3g}..{max(k_scales):.3g}, v_scale {min(v_scales):.3g}..{max(v_scales):.3g} "
          f"over {len(k_scales)} layers\n")
    print("dNLL: NLL through the FP8 cache minus without it, nats per token, mean over windows +- se; "
          "z: the paired difference over its se\n")
    print("| bucket | quantlab KL | quantlab dNLL | vLLM dNLL (scales) | vLLM - quantlab (z) | "
          "quantlab toward zero | vLLM - toward zero (z) | vLLM dNLL (scale 1.0) |")
    print("|---|---|---|---|---|---|---|---|")
    shifted = [(max(lo - a.chunk, 0), hi - a.chunk) for lo, hi in buckets]  # columns start at token chunk
    arms = (kl, dnll_q, dnll_v, dnll_v - dnll_q, dnll_z, dnll_v - dnll_z, dnll_1)  # paired differences per window
    columns = [kv_position.bucket_stats(x, shifted) for x in arms]
    for i, (lo, hi) in enumerate(buckets):
        k, q, v, vq, z, vz, one = (c[i] for c in columns)
        print(f"| {kv_position.bucket_name(max(lo, a.chunk), hi)} | {k['mean']:.2e} +- {k['stderr']:.1e} "
              f"| {cell(q)} | {cell(v)} | {cell(vq, True)} | {cell(z)} | {cell(vz, True)} | {cell(one)} |")


if __name__ == "__main__":
    main()
