"""Plain floating-point weights: fp32, fp16, bf16 (a cast, no quantization)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlab.hardware import Hardware
from quantlab.schemes import layers
from quantlab.schemes.base import WeightScheme
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass
class FloatScheme(WeightScheme):
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _SHORT:
            raise ValueError(f"float scheme dtype {self.dtype!r}; valid: {', '.join(_SHORT)}")

    def short_name(self) -> str:
        return _SHORT[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def support(cfg: FloatScheme, hw: Hardware) -> Support:
    """Real everywhere: weights stay in ``dtype`` in memory and the GEMM reads
    them as such. On CPUs without AVX512-FP16/BF16 the kernel widens to fp32 in
    registers, which costs compute but not memory traffic (decode is bound by
    the latter); the reason says so."""
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
    layers.cast_parameters(model, cfg.torch_dtype)
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
