"""Decode speed of each weight scheme on each CPU runtime, side by side, batch 1.

    python benchmarks/runtimes.py [--model smollm2|tiny|shape:<name>] [--rounds 5] [--tokens 64]
        [--schemes bf16,fp16,int8,int4-g64,int4-g32-sym] [--runtimes eager,compile,llamacpp,llamacpp-own]

Runtimes: ``eager`` and ``compile`` (torch.compile, inductor) are quantlab's
PyTorch engine; ``llamacpp`` runs quantlab's GGUF export of the point (its own
integers); ``llamacpp-own`` runs the file llama.cpp's own quantizer makes from
the same fp32 weights, for the block types it shares (Q8_0, Q4_0, Q4_1), with
the embedding kept in BF16 like quantlab's export. (The default model's fp32
weights are a dequantized Q4_1: its own Q4_1 is nearly lossless, compare Q4_0.)
For MXFP4 (``mxfp4-a16``), llama.cpp's quantizer writes MXFP4 for MoE experts
only (``MXFP4_MOE``: dense tensors become Q8_0), so its own file is written
with gguf-py's MXFP4 quantizer, the Python twin of ggml's
``quantize_row_mxfp4_ref`` (E8M0 exponent ``floor(log2 amax) - 2``, nearest
code), where quantlab's file holds compressed-tensors' codes.

All variants live in this one process and are timed in interleaved rounds (one
request of each variant, then the next round), so a noisy neighbour slows a
whole round alike. Per variant: TPOT median (``--tokens`` steps after a 64-token
prompt), tok/s, ratio to the same runtime's bf16 (median of per-round ratios),
TTFT at 128 and 512 prompt tokens, weight bytes read per step, achieved GB/s
over the measured read bandwidth, and the per-token overhead: TPOT minus the
time the weight bytes take at that bandwidth. ``--quality`` adds KL against the
fp32 model and WikiText-2 token perplexity for the llama.cpp files.

``--model shape:smollm2-1.7b`` times a real architecture with seeded random
weights (``model=shape``: quantlab/shapes.py), where decode is bound by weight
bytes rather than by per-token overhead; every variant is held in memory at
once, so on 24 GiB the largest shape is smollm2-1.7b (llama-3.2-3b's eight
variants take about 28 GB). ``--quality`` means nothing there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from quantlab import corpus, hardware, models
from quantlab.config import ModelConfig, ShapeModelConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.probes import fidelity, perplexity, roofline, size
from quantlab.schemes.float import FloatScheme
from quantlab.schemes.gptq import GPTQScheme
from quantlab.schemes.int4 import Int4Scheme
from quantlab.schemes.int8 import Int8Scheme
from quantlab.schemes.configs import MXScheme
from quantlab.schemes.kv import NoKV
from quantlab.schemes.kv import apply as kv_apply
from quantlab.schemes.registry import ApplyContext, weights_handler
from quantlab.schemes.smoothquant import W8A8Scheme
from quantlab.targets.cpu import CPUTarget
from quantlab.engines.llamacpp import LlamaCppEngine
from quantlab.export import gguf as gguf_export
from quantlab.targets.cpu import CPUTargetConfig
from quantlab.targets.llamacpp import LlamaCppTarget, LlamaCppTargetConfig

SCHEMES = {
    "bf16": FloatScheme("bfloat16"), "fp16": FloatScheme("float16"), "int8": Int8Scheme(),
    "int4-g64": Int4Scheme(group_size=64), "int4-g32": Int4Scheme(group_size=32),
    "int4-g32-sym": Int4Scheme(group_size=32, symmetric=True),
    "gptq-g32-sym": GPTQScheme(group_size=32, symmetric=True),  # calibration: wiki (64 x 512), see build()
    # W8A8 INT8 (PyTorch runtimes only: GGUF has no such type); SmoothQuant alpha searched, optionally the rotated down_proj
    "w8a8-sq-auto": W8A8Scheme(grid=20), "w8a8-sq-auto-had128": W8A8Scheme(grid=20, rotate_down=128),
    "mxfp4-a16": MXScheme(elem="fp4", activations="none"),  # emulated on PyTorch; llama.cpp's MXFP4 type
}
OWN_FTYPE = {"int8": "Q8_0", "int4-g32-sym": "Q4_0", "int4-g32": "Q4_1", "mxfp4-a16": "MXFP4"}  # llama.cpp's rules
GGML_BF16 = 30  # ggml_type of BF16 (llama-cpp-python has no constant for it)


def model_config(name: str) -> ModelConfig:
    """``smollm2``, ``tiny``, or ``shape:<name>`` (random weights)."""
    if name.startswith("shape:"):
        shape = name.split(":", 1)[1]
        return ModelConfig(name=f"{shape}-random", source="shape", shape=ShapeModelConfig(name=shape))
    return ModelConfig(name=name, source=name)


def quantized(cfg: ModelConfig, name: str, cache_dir: str, data_dir: str | None):
    """The point; GPTQ calibrates on Wikipedia (``calibration/wiki.yaml``) when the
    data directory is there, else on the built-in text (then its KL on that same
    text is flattered: use --quality only with data)."""
    model, tok = models.load(cfg, cache_dir)
    n = size.count_params(model)
    scheme = SCHEMES[name]
    if isinstance(scheme, GPTQScheme) and not data_dir:
        scheme = GPTQScheme(group_size=32, symmetric=True, calibration="builtin", n_samples=32, seq_len=256)
    weights_handler(scheme).apply(model, scheme, ApplyContext(hw=hardware.cpu(), tokenizer=tok, cache_dir=cache_dir,
                                                              data_dir=data_dir))
    return model, tok, size.weight_stats(model, n)["size/weight_bytes"]


def own_quantized(cfg: ModelConfig, ftype: str, cache_dir: str, tmp: Path, threads: int) -> Path:
    """llama.cpp's quantizer applied to an F32 GGUF of the model (embedding/output kept BF16)."""
    import llama_cpp

    model, tok = models.load(cfg, cache_dir)
    src, out = tmp / "f32.gguf", tmp / f"own-{ftype}.gguf"
    if not src.exists():
        gguf_export.write(model, tok, src, getattr(model, "quantlab_gguf", None))
    if ftype == "MXFP4":
        return gguf_py_quantized(src, out, ftype)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    params.output_tensor_type = params.token_embedding_type = GGML_BF16
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {ftype} failed")
    return out


def gguf_py_quantized(src: Path, out: Path, ggml_type: str) -> Path:
    """``src`` (an F32 GGUF) with every 2-D tensor but the embedding in
    ``ggml_type`` by gguf-py's quantizer (the embedding BF16, 1-D tensors F32),
    every key copied: a llama-quantize for the types it writes only for MoE."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        kind = "F32" if data.ndim == 1 else "BF16" if t.name == "token_embd.weight" else ggml_type
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def build(args, tmp: Path) -> dict[tuple[str, str], tuple]:
    """``(scheme, runtime) -> (engine, tokenizer, weight bytes read per step)``."""
    cfg = model_config(args.model)
    lc_cfg = LlamaCppTargetConfig(threads=args.threads, n_ctx=1024, gguf_cache=str(tmp / "cache"))
    torch._dynamo.config.recompile_limit = 64  # several compiled models side by side
    built = {}
    for s in args.schemes.split(","):
        for rt in args.runtimes.split(","):
            t = time.perf_counter()
            if rt == "llamacpp-own":
                if s not in OWN_FTYPE:
                    continue
                path = own_quantized(cfg, OWN_FTYPE[s], args.cache_dir, tmp, args.threads)
                eng = LlamaCppEngine(path, "F16", 0, lc_cfg.n_ctx, lc_cfg.n_batch, lc_cfg.threads)
                built[(s, rt)] = (eng, None, gguf_export.tensor_bytes(path))
            elif rt == "llamacpp" and not (sup := LlamaCppTarget(lc_cfg).supports(SCHEMES[s], NoKV())).runnable:
                print(f"{s:<19} {rt:<13} skipped: {sup.reason}", flush=True)
                continue
            else:
                model, tok, nbytes = quantized(cfg, s, args.cache_dir, args.data_dir)
                kv = kv_apply(model, NoKV(), None)
                if rt == "llamacpp":
                    eng = LlamaCppTarget(lc_cfg).engine(model, kv, tok)
                    nbytes = gguf_export.tensor_bytes(eng.path)
                else:
                    target = CPUTarget(CPUTargetConfig(compile=rt == "compile"))
                    eng = target.engine(model, kv, tok)
                built[(s, rt)] = (eng, tok, nbytes)
            print(f"{s:<19} {rt:<13} ready in {time.perf_counter() - t:6.1f} s", flush=True)
    return built


def quality(built, args) -> None:
    """KL vs fp32 (WikiText-2 test text, else the built-in text) and WikiText-2
    token perplexity, for the llama.cpp files."""
    cfg = model_config(args.model)
    ref_model, tok = models.load(cfg, args.cache_dir)
    ids = corpus.token_ids(tok, "wikitext2" if args.data_dir else "builtin", 1024, args.data_dir)
    ref = fidelity.logprobs(TorchEngine(ref_model), ids)
    wins = None
    if args.data_dir:
        text = perplexity.wikitext2_text(args.data_dir)
        wins, _ = perplexity.windows(tok(text[:200_000], add_special_tokens=False, return_tensors="pt")["input_ids"][0],
                                     512, args.ppl_windows)
    print(f"\nKL over {ids.shape[1]} tokens of {'WikiText-2 test' if args.data_dir else 'the built-in text'}; "
          f"perplexity over {0 if wins is None else wins.shape[0]} windows of 512")
    print(f"{'scheme':<19} {'runtime':<13} {'KL vs fp32':>11} {'top-1':>7} {'KL vs point':>12} {'ppl WT2 w512':>13}")
    points = {s: fidelity.logprobs(eng, ids) for (s, rt), (eng, _, _) in built.items() if rt == "eager"}
    for (s, rt), (eng, _, _) in built.items():
        if not rt.startswith("llamacpp"):
            continue
        mine = fidelity.logprobs(eng, ids)
        f = fidelity.compare(ref, mine)
        # against quantlab's in-memory point of the same scheme (the eager runtime), where it was built
        kp = fidelity.compare(points[s], mine)["fid/kl_mean"] if s in points else float("nan")
        ppl = float(np.exp(perplexity.token_nll(eng, wins).mean())) if wins is not None else float("nan")
        print(f"{s:<19} {rt:<13} {f['fid/kl_mean']:>11.4f} {f['fid/top1_agree']:>7.3f} {kp:>12.2e} {ppl:>13.3f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny or shape:<name> (random weights)")
    ap.add_argument("--schemes", default="bf16,fp16,int8,int4-g64,int4-g32-sym")
    ap.add_argument("--runtimes", default="eager,llamacpp,llamacpp-own", help="eager,compile,llamacpp,llamacpp-own")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quality", action="store_true", help="KL and perplexity of the llama.cpp files")
    ap.add_argument("--ppl-windows", type=int, default=8)
    ap.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"))
    ap.add_argument("--cache-dir", default=os.environ.get("QUANTLAB_CACHE", "~/.cache/quantlab"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        built = build(args, Path(d))
        tok = next(t for _, t, _ in built.values() if t is not None)
        prompt = {p: corpus.token_ids(tok, "builtin", p) for p in (64, 128, 512)}
        peak = roofline.measure_read_bandwidth(torch.device("cpu"))
        for eng, _, _ in built.values():  # warm-up
            eng.decode(prompt[64], 4)
        tpot = {k: [] for k in built}
        ttft = {k: {128: [], 512: []} for k in built}
        for r in range(args.rounds):
            for key, (eng, _, _) in built.items():
                tpot[key].append(statistics.median(eng.decode(prompt[64], args.tokens + 1).step_ms))
                for p in (128, 512):
                    ttft[key][p].append(eng.decode(prompt[p], 1).prefill_ms)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        report(built, tpot, ttft, peak, args)
        if args.quality:
            quality(built, args)


def baseline(built, rt: str) -> tuple[str, str] | None:
    """What a runtime's ratios are relative to: llama.cpp's f16 (its native float
    type; llama.cpp's own files share the llamacpp engine's), PyTorch's bf16."""
    order = ("fp16", "bf16") if rt.startswith("llamacpp") else ("bf16", "fp16")
    for r in ((rt, "llamacpp") if rt == "llamacpp-own" else (rt,)):
        for s in order:
            if (s, r) in built:
                return s, r
    return None


def report(built, tpot, ttft, peak, args) -> None:
    print(f"\nCPU: {hardware.cpu_name()}, {args.threads} threads, read bandwidth {peak / 1e9:.1f} GB/s "
          f"(measured), load1 {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'scheme':<19} {'runtime':<13} {'TPOT ms':>8} {'tok/s':>7} {'vs base':>14} {'TTFT128':>8} "
          f"{'TTFT512':>8} {'MB/step':>8} {'GB/s':>6} {'of peak':>7} {'overhead ms':>11}")
    for (s, rt), (_, _, nbytes) in built.items():
        med = statistics.median(tpot[(s, rt)])
        b = baseline(built, rt) or (s, rt)
        ratios = [x / y for x, y in zip(tpot[b], tpot[(s, rt)])]
        floor_ms = nbytes / peak * 1e3
        print(f"{s:<19} {rt:<13} {med:>8.2f} {1000 / med:>7.1f} {statistics.median(ratios):>6.2f}x {b[0]:<6} "
              f"{statistics.median(ttft[(s, rt)][128]):>8.1f} {statistics.median(ttft[(s, rt)][512]):>8.1f} "
              f"{nbytes / 2**20:>8.1f} {nbytes / med / 1e6:>6.1f} {nbytes / med / 1e6 / (peak / 1e9):>7.0%} "
              f"{med - floor_ms:>11.2f}")


if __name__ == "__main__":
    main()
