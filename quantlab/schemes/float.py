"""Plain floating-point weights: fp32, fp16, bf16 (a cast, no quantization)."""
from __future__ import annotations


import torch

from quantlab.hardware import Hardware
from quantlab.schemes import layers
from quantlab.schemes.configs import FloatScheme
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

def support(cfg: FloatScheme, hw: Hardware) -> Support:
    """Real everywhere: weights stay in ``dtype`` in memory and the GEMM reads
    them as such. On CPUs without AVX512-FP16/BF16 the kernel widens to fp32 in
    registers, which costs compute but not memory traffic (decode is bound by
    the latter); the reason says so. (Where oneDNN has no such matmul at all,
    calls of several tokens multiply in fp32: ``qlinear.WidenedLinear``.)"""
    if hw.device == "cpu":
        native = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
        flags = native.get(cfg.dtype)
        if flags and not hw.has_any(*flags):
            return Support("real", f"no native {cfg.dtype} FMA on this CPU: widened to fp32 in registers")
    return Support("real")


def apply(model: torch.nn.Module, cfg: FloatScheme, ctx: ApplyContext) -> Applied:
    """Cast the parameters only, as every quantized scheme does: buffers such as
    RoPE's ``inv_freq`` stay fp32, so a float baseline carries no rounding of
    the positions that the points it is compared with do not."""
    layers.cast_parameters(model, getattr(torch, cfg.dtype))
    return Applied(backend="torch", emulated=False)


def checkpoint(cfg: FloatScheme) -> Mapping:
    return Mapping({"format": "hf", "dtype": cfg.dtype})


def neuron(cfg: FloatScheme) -> Mapping:
    if cfg.dtype == "float32":
        return Mapping(reason="Neuron compiles bf16/fp16 (auto_cast_type); fp32 is not a deployment dtype")
    return Mapping({"dtype": cfg.dtype, "quantization": None, "note": ""})


def gguf(cfg: FloatScheme) -> Mapping:
    return Mapping({"type": {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[cfg.dtype]})


register_weights("float", FloatScheme, support, apply, checkpoint=checkpoint, neuron=neuron, gguf=gguf)
