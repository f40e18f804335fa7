"""Linear layers that store their weight in a block-scaled format (NVFP4,
MXFP4, MXFP8, FP8 blocks, W4A8's INT4 groups) and emulate its GEMM.

Storage is the format's own, under compressed-tensors' parameter names
(``weight_packed`` nibbles or an E4M3 ``weight``, ``weight_scale`` in the
format's scale type, NVFP4's ``weight_global_scale``), so the size probe
counts the bits a checkpoint holds (NVFP4 4.5 per weight, MXFP4 4.25, MXFP8
8.25, FP8 blocks 8 + 32 per block, INT4 groups 4 + 32 per group).

The product is emulated: no kernel on a CPU reads these formats. The
input is rounded through the activation format where the scheme has one
(:mod:`quantlab.schemes.fpquant`, the values an FP4 or FP8 kernel would
multiply), then multiplied in fp32 by the dequantized weight and rounded to
the compute dtype. The dequantized weight is kept beside the codes after
its first use (an fp32 copy outside the state dict): an emulated point's
memory and latency are not the format's, which is why its points are
tagged ``emulated=true`` and never recommended.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantlab.schemes import fpquant as fq
from quantlab.schemes import layers
from quantlab.schemes.registry import Support

ACTIVATIONS = ("none", "fp8-token", "fp8-group", "mxfp4", "mxfp8", "nvfp4")


class KeptWeight(nn.Module):
    """A layer whose float weight is made from its stored codes on first use
    (:meth:`make_weight`) and kept outside the state dict; moving or casting
    the layer drops it, to be made again."""

    _kept: torch.Tensor | None = None

    def make_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def kept_weight(self) -> torch.Tensor:
        if self._kept is None:
            self._kept = self.make_weight()
        return self._kept

    def _apply(self, fn, recurse=True):
        self._kept = None
        return super()._apply(fn, recurse)


class FormatLinear(KeptWeight):
    """Base: activation rounding, the emulated product, the kept fp32 weight.
    Subclasses store their format and implement :meth:`dequantize` and
    :meth:`checkpoint_tensors`."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype, activations: str = "none", act_group: int = 0):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations {activations!r}; valid: {', '.join(ACTIVATIONS)}")
        self.out_features, self.in_features = out_features, in_features
        self.compute_dtype = compute_dtype
        self.activations, self.act_group = activations, act_group
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight the stored codes and scales stand for."""
        raise NotImplementedError

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """compressed-tensors' uncompressed module parameters (``weight``,
        ``weight_scale`` as floats, ``weight_global_scale``, ``input_global_scale``)
        from which its compressor re-derives exactly this layer's codes."""
        raise NotImplementedError

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (fp32) rounded as the scheme's activation format rounds it."""
        if self.activations == "fp8-token":
            return fq.fp8_tokens(x)
        if self.activations == "fp8-group":
            return fq.fp8_tokens(x, self.act_group)
        if self.activations in ("mxfp4", "mxfp8"):
            return fq.mx_tokens(x, self.activations[2:])
        if self.activations == "nvfp4":
            return fq.nvfp4_tokens(x, self.input_global_scale)
        return x

    def make_weight(self) -> torch.Tensor:
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = self.quantize_input(x.reshape(-1, shape[-1]).to(self.compute_dtype).float())
        y = F.linear(x2, self.kept_weight()).to(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(dtype)


class NVFP4Linear(FormatLinear):
    GROUP = 16  # values a scale

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, bias, compute_dtype,
                 activations: str = "none", input_global_scale: torch.Tensor | None = None):
        n, k = codes.shape
        super().__init__(n, k, bias, compute_dtype, activations)
        self.register_buffer("weight_packed", fq.pack_nibbles(codes.to(torch.uint8)))
        self.register_buffer("weight_scale", scale.to(torch.float8_e4m3fn))
        self.register_buffer("weight_global_scale", global_scale.float().reshape(1))
        if activations == "nvfp4":
            if input_global_scale is None:
                raise ValueError("NVFP4 activations need a calibrated input_global_scale")
            self.register_buffer("input_global_scale", input_global_scale.float().reshape(1))

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, compute_dtype, activations: str = "none",
                 input_global_scale: torch.Tensor | None = None) -> "NVFP4Linear":
        """Round to nearest (the reference's RTN)."""
        return cls(*fq.nvfp4_quantize(weight), bias, compute_dtype, activations, input_global_scale)

    def dequantize(self) -> torch.Tensor:
        return fq.nvfp4_dequantize(fq.unpack_nibbles(self.weight_packed), self.weight_scale.float(),
                                   self.weight_global_scale)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.dequantize(), "weight_scale": self.weight_scale.float(),
               "weight_global_scale": self.weight_global_scale}
        if self.activations == "nvfp4":
            out["input_global_scale"] = self.input_global_scale
        return out


class MXLinear(FormatLinear):
    GROUP = 32  # values a scale

    def __init__(self, elements: torch.Tensor, exponents: torch.Tensor, bias, compute_dtype, elem: str,
                 activations: str = "none"):
        n, k = elements.shape
        super().__init__(n, k, bias, compute_dtype, activations)
        self.elem = elem
        if elem == "fp4":
            self.register_buffer("weight_packed", fq.pack_nibbles(elements.to(torch.uint8)))
        else:
            self.register_buffer("weight", elements.to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", exponents.to(torch.uint8))  # E8M0: biased exponents

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, compute_dtype, elem: str, activations: str = "none") -> "MXLinear":
        """Round to nearest (the reference's RTN)."""
        return cls(*fq.mx_quantize(weight, elem), bias, compute_dtype, elem, activations)

    def elements(self) -> torch.Tensor:
        """FP4 codes (uint8) or E4M3 values, ``[N, K]``."""
        return fq.unpack_nibbles(self.weight_packed) if self.elem == "fp4" else self.weight

    def dequantize(self) -> torch.Tensor:
        return fq.mx_dequantize(self.elements(), self.weight_scale)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.dequantize(), "weight_scale": fq.mx_scale(self.weight_scale)}


class FP8BlockLinear(FormatLinear):
    def __init__(self, weight: torch.Tensor, bias, compute_dtype, block: int, activations: str = "none"):
        n, k = weight.shape
        super().__init__(n, k, bias, compute_dtype, activations, act_group=block)
        self.block = block
        q, scale = fq.fp8_block_quantize(weight, (block, block))
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)

    def dequantize(self) -> torch.Tensor:
        return fq.fp8_block_dequantize(self.weight, self.weight_scale, (self.block, self.block))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.dequantize(), "weight_scale": self.weight_scale}


class W4A8Linear(FormatLinear):
    """Symmetric INT4 groups (codes ``q + 8`` packed two per byte) and FP8 tokens."""

    def __init__(self, weight: torch.Tensor, bias, compute_dtype, group_size: int):
        n, k = weight.shape
        super().__init__(n, k, bias, compute_dtype, "fp8-token")
        self.group_size = group_size
        q, scale = fq.int4_sym_quantize(weight, group_size)
        self.register_buffer("weight_packed", fq.pack_nibbles((q + 8).to(torch.uint8)))
        self.register_buffer("weight_scale", scale)

    def codes(self) -> torch.Tensor:
        """The signed INT4 values ``[N, K]`` (-8..7, int8)."""
        return fq.unpack_nibbles(self.weight_packed).to(torch.int8) - 8

    def dequantize(self) -> torch.Tensor:
        return fq.int4_sym_dequantize(self.codes(), self.weight_scale, self.group_size)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.dequantize(), "weight_scale": self.weight_scale}


def emulated_support(hw, what: str, native: tuple[int, int]):
    """The support answer of every block-scaled format in quantlab's own
    engines: emulated on a CPU and on CUDA (no GEMM of these formats wired
    into the torch engine), its reason saying whether the GPU's compute
    capability reaches ``native``, where vLLM's kernels run the export
    (``target=vllm``, not verified here); unsupported elsewhere."""
    if hw.device == "cpu":
        return Support("emulated", f"no {what} GEMM on a CPU: the format's codes and scales are stored, "
                                   "dequantized and multiplied in fp32")
    if hw.device == "cuda":
        sm = f"sm_{native[0]}{native[1]}"
        where = (f"this GPU reaches {sm}: serve the export with target=vllm for vLLM's {what} kernels"
                 if hw.cuda_capability is not None and tuple(hw.cuda_capability) >= native
                 else f"vLLM's {what} kernels need {sm} or newer")
        return Support("emulated", f"quantlab's torch engine has no {what} GEMM wired: dequantized and multiplied "
                                   f"in fp32; {where}")
    return Support("unsupported", f"{what} on {hw.device}")


def selected(model: nn.Module, skip: list[str], group: int, scheme: str) -> list[tuple[str, nn.Linear]]:
    """The Linears a scheme quantizes (:func:`layers.select`), refused in one
    line where ``group`` (0: none) does not divide an input width."""
    linears = layers.select(model, skip)
    if group:
        layers.check_group_size(linears, group, scheme)
    return linears


def replace_all(model: nn.Module, linears: list[tuple[str, nn.Linear]], make) -> None:
    """Replace each ``(name, linear)`` by ``make(name, linear)``."""
    for name, lin in linears:
        layers.replace(model, name, make(name, lin))
