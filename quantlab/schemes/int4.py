"""INT4 blockwise round-to-nearest: group size 32/64/128, symmetric or asymmetric."""
from __future__ import annotations


import torch

from quantlab.hardware import Hardware
from quantlab.schemes.configs import Int4Scheme
from quantlab.schemes import layers
from quantlab.schemes.qlinear import Int4Linear, prefill_tags
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

def support(cfg: Int4Scheme, hw: Hardware) -> Support:
    if hw.device == "cpu":
        return Support("real")
    if hw.device == "cuda":
        if cfg.symmetric:
            return Support("unsupported", "torchao's CUDA int4 kernel takes asymmetric (zero-point) groups only")
        return Support("real")
    return Support("unsupported", f"int4 on {hw.device}")


def apply(model: torch.nn.Module, cfg: Int4Scheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    linears = layers.select(model, cfg.skip)
    layers.check_group_size(linears, cfg.group_size, cfg.short_name())
    if ctx.hw.device == "cuda":
        from torchao.quantization import Int4WeightOnlyConfig

        config = Int4WeightOnlyConfig(group_size=cfg.group_size, int4_packing_format="tile_packed_to_4d")
        layers.torchao_quantize(model, linears, dtype, config)
        return Applied(backend="torchao.Int4WeightOnlyConfig", emulated=False)
    for name, lin in linears:
        layers.replace(model, name, Int4Linear.from_linear(lin, cfg.group_size, cfg.symmetric, dtype))
    layers.cast_parameters(model, dtype)
    return Applied(backend="aten._weight_int4pack_mm_for_cpu", emulated=False, tags=prefill_tags(dtype))


def checkpoint(cfg, asymmetric_as: str = "group") -> Mapping:
    """compressed-tensors ``pack-quantized`` int4 (RTN and GPTQ alike): eight
    values per int32, scales in the compute dtype (where the point keeps
    them, so they are exact). Symmetric: ``group`` strategy, no zero points.
    Asymmetric (``asymmetric_as="group"``): ``group`` with the zero points
    packed eight to an int32 along the output dimension, the layout
    llm-compressor's W4A16_ASYM writes and vLLM's WNA16 kernels read (vLLM
    0.32 rejects ``block`` there, measured); transformers 5.24 with
    compressed-tensors 0.20.1 reloads it only with ``dequantize=True`` (its
    compressed path initialises the zero points unpacked: a shape mismatch),
    see :func:`quantlab.export.checkpoint.transformers_load`.
    ``asymmetric_as="block"``: the same groups as ``block [1, group]`` with
    unpacked int8 zero points, which transformers' compressed path reloads;
    mixed recipes use it, because transformers' ``dequantize`` conversion
    applies one layer's scheme to every layer of the same name (measured: a
    recipe with int8 and int4 ``down_proj`` layers fails to reload)."""
    args = {"num_bits": 4, "type": "int", "symmetric": cfg.symmetric, "scale_dtype": cfg.compute_dtype}
    if cfg.symmetric or asymmetric_as == "group":
        args.update(strategy="group", group_size=cfg.group_size)
    else:
        args.update(strategy="block", block_structure=[1, cfg.group_size])
    return Mapping({"format": "pack-quantized", "args": args, "dtype": cfg.compute_dtype})


def gguf(cfg) -> Mapping:
    """Q4_0 (symmetric: zero point 8) or Q4_1 (integer zero point -> m = -zp * d);
    a group of 64+ spans several 32-blocks that share its d (and m)."""
    if cfg.group_size % 32:
        return Mapping(reason=f"group size {cfg.group_size} is not a multiple of llama.cpp's 32-weight blocks")
    return Mapping({"type": "Q4_0" if cfg.symmetric else "Q4_1"})


register_weights("int4", Int4Scheme, support, apply, checkpoint=checkpoint, gguf=gguf)
