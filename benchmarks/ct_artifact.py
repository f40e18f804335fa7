"""Write a compressed-tensors checkpoint of a model the way llm-compressor's
round-to-nearest recipes do (min-max scales from compressed-tensors'
``calculate_qparams``, packed by its ``ModelCompressor``, LM head left
float), beside the float original it was made from: the artifacts
``scheme/weights=as-is`` measures, made here without a model hub.

    python benchmarks/ct_artifact.py --out /tmp/smollm2-ct --kinds w4a16-g64,fp8-dynamic,w8a8

writes ``<out>/float`` (SmolLM2-135M-Instruct's offline weights as a
transformers directory) and ``<out>/<kind>`` for each kind, then prints
the sweep that measures them against the original.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

# kind -> (weight QuantizationArgs fields, input activation fields or None, compressed-tensors format)
KINDS = {
    "w4a16-g64": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64), None,
                  "pack-quantized"),
    "w4a16-g32": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32), None,
                  "pack-quantized"),
    "w4a16-g32-asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), None,
                       "pack-quantized"),
    "w8a16": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None, "pack-quantized"),
    "w8a8": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
             dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True), "int-quantized"),
    "fp8-dynamic": (dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                    dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True), "float-quantized"),
    "w4a16-channel": (dict(num_bits=4, type="int", symmetric=True, strategy="channel"), None, "pack-quantized"),
}


@torch.no_grad()
def quantize(model: torch.nn.Module, tokenizer, kind: str, dest: Path) -> Path:
    """``model`` (consumed: its Linear layers are compressed in place)
    quantized as ``kind`` and saved with ``tokenizer`` to ``dest``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    w_args, a_args, fmt = KINDS[kind]
    args = QuantizationArgs(**w_args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=QuantizationArgs(**a_args) if a_args else None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        format=fmt, quantization_status="frozen"))
    for _, m in model.named_modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.data.float()
            g = w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group" else w[:, None, :]
            scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            m.weight_scale.data = scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data = zp.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dest)
    compressor.update_config(str(dest))
    tokenizer.save_pretrained(dest)
    return dest


def main() -> None:
    from quantlab import models
    from quantlab.config import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kinds", default="w4a16-g64,fp8-dynamic,w8a8", help=f"of {', '.join(KINDS)}")
    ap.add_argument("--dtype", default="bfloat16", help="the checkpoints' dtype (what their config says)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig(name="smollm2-135m", source="smollm2")
    model, tok = models.load(cfg, "~/.cache/quantlab")
    model.to(dtype).save_pretrained(args.out / "float")
    tok.save_pretrained(args.out / "float")
    kinds = args.kinds.split(",")
    for kind in kinds:
        quantize(models.load(cfg, "~/.cache/quantlab")[0].to(dtype), tok, kind, args.out / kind)
        print(f"wrote {args.out / kind}")
    paths = ",".join(str(args.out / k) for k in ["float", *kinds])
    print(f"quantlab run -m model=hf model.path={paths} scheme/weights=as-is,bf16 reference.path={args.out / 'float'}")


if __name__ == "__main__":
    main()
