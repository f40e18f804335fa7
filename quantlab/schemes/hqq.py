"""HQQ: half-quadratic quantization (Badri & Shaji, 2023), calibration-free.

The maintained ``hqq`` package optimizes each group's zero point and scale
(a proximal solver on an lp error of the weights themselves, no data), then:

* 4 bit: the groups go onto the same tinygemm kernel as RTN/GPTQ/AWQ
  (``Int4Linear``; its float zero points take HQQ's non-integer zeros as they
  are, as torchao's HQQ int4 path does), so the point is real on CPU.
* 8 bit: asymmetric groups with float zero points have no integer kernel
  here (quantlab's int8 kernel is symmetric per channel), so the point
  dequantizes the uint8 groups in every forward (``GroupDequantLinear``) and
  is tagged ``emulated=true``: its size and numerics are HQQ's, its latency is not.

Neither exports: compressed-tensors and GGUF store integer zero points.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from quantlab.hardware import Hardware
from quantlab.schemes import layers
from quantlab.schemes.configs import HQQScheme
from quantlab.schemes.qlinear import Int4Linear, prefill_tags
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

log = logging.getLogger("quantlab")


def quantize(w: torch.Tensor, nbits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HQQ's optimized groups of ``w [N, K]``: ``(q [N, K] in 0..2^nbits-1,
    scale [N, K/g], zero [N, K/g])`` with ``w ~= (q - zero) * scale``."""
    from hqq.core.quantize import Quantizer

    n, k = w.shape
    q, meta = Quantizer.quantize(w.float(), nbits=nbits, group_size=group_size, optimize=True, axis=1,
                                 bitpack=False, device=str(w.device))
    return (q.reshape(n, k).round().to(torch.int32), meta["scale"].reshape(n, k // group_size).float(),
            meta["zero"].reshape(n, k // group_size).float())


def int4_linear(lin: nn.Linear, group_size: int, dtype: torch.dtype) -> Int4Linear:
    """HQQ's 4-bit groups in tinygemm's convention ``w = (q - 8) * s + z``:
    ``(q - zero) * scale = (q - 8) * scale + (8 - zero) * scale``."""
    q, scale, zero = quantize(lin.weight.detach(), 4, group_size)
    return Int4Linear(q, scale, (8 - zero) * scale, group_size, lin.bias, dtype)


class GroupDequantLinear(nn.Module):
    """uint8 groups with float scale and zero point, dequantized to the compute
    dtype in every ``forward`` (an emulation: no integer GEMM runs)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, compute_dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size, self.compute_dtype = group_size, compute_dtype
        self.register_buffer("qweight", q.to(torch.uint8).contiguous())
        self.register_buffer("scale", scale.to(compute_dtype))
        self.register_buffer("zero", zero.to(compute_dtype))
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    def dequantize(self) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        q = self.qweight.reshape(n, k // g, g).to(self.compute_dtype)
        return ((q - self.zero[..., None]) * self.scale[..., None]).reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self.dequantize(), self.bias).to(x.dtype)


def support(cfg: HQQScheme, hw: Hardware) -> Support:
    if hw.device != "cpu":
        return Support("unsupported", f"quantlab's HQQ packing is CPU-only (tinygemm CPU layout); not {hw.device}")
    if cfg.nbits == 8:
        return Support("emulated", "no integer kernel for asymmetric float-zero int8 groups: dequantized per forward")
    return Support("real", "HQQ-optimized groups on the int4 tinygemm kernel")


@torch.inference_mode()
def apply(model: nn.Module, cfg: HQQScheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    linears = layers.select(model, cfg.skip)
    layers.check_group_size(linears, cfg.group_size, cfg.short_name())
    for name, lin in linears:
        if cfg.nbits == 4:
            new = int4_linear(lin, cfg.group_size, dtype)
        else:
            new = GroupDequantLinear(*quantize(lin.weight.detach(), 8, cfg.group_size), cfg.group_size, lin.bias,
                                     dtype)
        layers.replace(model, name, new)
    layers.cast_parameters(model, dtype)
    log.info("hqq: %d linears, %d bit, groups of %d", len(linears), cfg.nbits, cfg.group_size)
    if cfg.nbits == 4:
        return Applied(backend="hqq+aten._weight_int4pack_mm_for_cpu", emulated=False, tags=prefill_tags(dtype))
    return Applied(backend="hqq+quantlab.GroupDequantLinear", emulated=True)


def _no_export(fmt: str):
    def mapping(cfg) -> Mapping:
        return Mapping(reason=f"HQQ zero points are floats; {fmt} stores integer zero points")
    return mapping


register_weights("hqq", HQQScheme, support, apply, checkpoint=_no_export("compressed-tensors"),
                 gguf=_no_export("GGUF"))
