"""FP8 (E4M3 / E5M2) weights, optionally W8A8 with dynamic per-token activation scales.

Real FP8 GEMMs need FP8 tensor cores (CUDA SM >= 8.9) and FP8 activations
(``activations=dynamic``, torchao + ``torch._scaled_mm``). Everything else is
emulated: FP8 storage, dequantized to the compute dtype once and kept beside it.
"""
from __future__ import annotations


import torch

from quantlab.hardware import Hardware
from quantlab.schemes.configs import FP8_FORMATS, FP8Scheme
from quantlab.schemes import layers
from quantlab.schemes.qlinear import FP8Linear
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

FORMATS = dict(zip(FP8_FORMATS, (torch.float8_e4m3fn, torch.float8_e5m2)))


def _fp8_tensor_cores(hw: Hardware) -> bool:
    return hw.device == "cuda" and hw.cuda_capability is not None and hw.cuda_capability >= (8, 9)


def support(cfg: FP8Scheme, hw: Hardware) -> Support:
    if cfg.activations == "dynamic" and _fp8_tensor_cores(hw):
        if cfg.format != "e4m3":
            return Support("unsupported", "W8A8 uses e4m3 (torchao Float8DynamicActivationFloat8WeightConfig)")
        # Measured on an H200, eager: 97.6 ms/token vs bf16's 18.4 on a 30-layer
        # 135M model (torchao's tensor-subclass dispatch per linear, in Python).
        return Support("real", "torchao _scaled_mm; eager pays a Python dispatch per linear: compile for its speed")
    if hw.device in ("cpu", "cuda"):
        why = "no FP8 GEMM on this device" if not _fp8_tensor_cores(hw) else "weight-only FP8 has no fused kernel"
        return Support("emulated", f"{why}: FP8 storage, dequantized to {cfg.compute_dtype} (once, kept) for a float matmul")
    return Support("unsupported", f"fp8 on {hw.device}")


def apply(model: torch.nn.Module, cfg: FP8Scheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    linears = layers.select(model, cfg.skip)
    if support(cfg, ctx.hw).status == "real":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        layers.torchao_quantize(model, linears, dtype, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        return Applied(backend="torchao.Float8DynamicActivationFloat8WeightConfig", emulated=False)
    for name, lin in linears:
        layers.replace(model, name, FP8Linear(lin.weight, lin.bias, FORMATS[cfg.format], dtype,
                                              quantize_activations=cfg.activations == "dynamic"))
    layers.cast_parameters(model, dtype)
    return Applied(backend="quantlab.FP8Linear(dequant)", emulated=True)


def checkpoint(cfg: FP8Scheme) -> Mapping:
    """compressed-tensors ``float-quantized``: E4M3 weights, fp32 scale per
    channel; W8A8 adds dynamic per-token E4M3 input activations (what
    transformers applies on reload and vLLM runs on FP8 tensor cores).
    compressed-tensors' FP8 is E4M3 only."""
    if cfg.format != "e4m3":
        return Mapping(reason=f"compressed-tensors FP8 is E4M3 only; {cfg.short_name()} has no checkpoint format")
    spec = {"format": "float-quantized", "dtype": cfg.compute_dtype,
            "args": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}
    if cfg.activations == "dynamic":
        spec["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                     "dynamic": True}
    return Mapping(spec)


def neuron(cfg: FP8Scheme) -> Mapping:
    if cfg.activations != "none" or cfg.format != "e4m3":
        return Mapping(reason=f"no Neuron equivalent of {cfg.short_name()}: the SDK stores f8e4m3 weights only")
    return Mapping({"dtype": cfg.compute_dtype, "note": "Neuron f8e4m3 weight storage (trn2/inf2 SDK >= 2.21)",
                    "quantization": {"quantized": True, "quantization_dtype": "f8e4m3",
                                     "quantization_type": "per_channel_symmetric"}})


def gguf(cfg: FP8Scheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()} has no GGUF type (llama.cpp has no FP8 blocks); nearest: Q8_0 "
                          "(scheme/weights=int8)")


register_weights("fp8", FP8Scheme, support, apply, checkpoint=checkpoint, neuron=neuron, gguf=gguf)
