"""Quantized replacements for ``nn.Linear`` and the round-to-nearest math.

Each module holds its weight in the packed form a real kernel reads, and its
``forward`` calls that kernel:

* ``Int8Linear``: int8 ``[N, K]`` + per-output-channel scale, ATen's
  ``_weight_int8pack_mm`` (CPU). torchao's eager int8 weight-only path
  dequantizes on every call (measured ~2x slower than this kernel here).
* ``Int4Linear``: int4 packed two per byte + per-group scale/zero in the
  "tinygemm" layout, ATen's ``_weight_int4pack_mm_for_cpu`` (the kernel torchao's
  ``Int4OpaqueTensor`` uses); symmetric and asymmetric both map onto it.
* ``FP8Linear``: float8 storage + per-channel scale, dequantized to the compute
  dtype inside ``forward``. That is an *emulation* (no FP8 GEMM on CPU):
  storage is real, latency is not that of an FP8 kernel.

``dequantize()`` returns the float weight each module computes with, for
numerics tests and export.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def rtn_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``w ~= q * scale[:, None]``, q in [-127, 127]."""
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_qparams(g: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset of int4 groups along the last dim, so that a weight is
    stored as ``q in [0, 15]`` and read back as ``q * scale + offset``, with
    ``offset = -zero_point * scale`` for an *integer* zero point (the GPTQ, AWQ
    and compressed-tensors convention, so exports hold the very same integers).
    Symmetric: zero point 8 and all 16 levels, the rule of llama.cpp's Q4_0: the
    group's value of largest magnitude ``m`` lands exactly on level 0, i.e.
    ``scale = m / -8`` (negative when ``m`` is positive), so the other side
    reaches ``7/8`` of it. (``amax / 7`` would leave level 0 unused: a 12.5 %
    coarser step; measured on SmolLM2 Q4_0, KL 0.38 vs 0.29.) Asymmetric: the
    group's range (widened to include 0) over the 16 levels."""
    if symmetric:
        m = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
        scale = torch.where(m >= 0, m.clamp_min(1e-8), m.clamp_max(-1e-8)) / -8.0
        return scale, -8.0 * scale
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8)
    zero_point = torch.round(-lo / scale).clamp(0, 15)
    return scale, -zero_point * scale


def int4_quantize(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Nearest level in [0, 15] for ``w`` given broadcastable ``scale``/``offset``."""
    return torch.round((w - offset) / scale).clamp(0, 15)


def rtn_int4(w: torch.Tensor, group_size: int, symmetric: bool):
    """Groupwise round-to-nearest int4 along K. Returns ``q`` (int32 in [0, 15]),
    ``scale`` and ``zero`` ``[N, K // group]`` in the tinygemm convention
    ``w ~= (q - 8) * scale + zero``."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    scale, offset = int4_qparams(g, symmetric)
    q = int4_quantize(g, scale[..., None], offset[..., None])
    return q.reshape(n, k).to(torch.int32), scale, offset + 8 * scale


class Int8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.compute_dtype = compute_dtype
        self.register_buffer("qweight", q.contiguous())  # [N, K] int8
        self.register_buffer("scale", scale.to(compute_dtype))  # [N]
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype) -> "Int8Linear":
        q, scale = rtn_int8(linear.weight.detach().float())
        return cls(q, scale, linear.bias, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.compute_dtype),
                                      self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]

    def int_weights(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``(q [N, K] in -127..127, scale [N, 1], None)``: symmetric, ``w = q * scale``."""
        return self.qweight.float(), self.scale.float()[:, None], None


class Int4Linear(nn.Module):
    _N_ALIGN = 16  # the CPU packing kernel needs N % 16 == 0; pad and slice

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None, compute_dtype: torch.dtype):
        super().__init__()
        n, k = q.shape
        self.in_features, self.out_features = k, n
        self.group_size, self.compute_dtype = group_size, compute_dtype
        pad = (-n) % self._N_ALIGN
        if pad:
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        self.register_buffer("packed", packed)  # [N, K/2] uint8, two nibbles per byte
        self.register_buffer("scales_and_zeros", sz.to(compute_dtype))
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, symmetric: bool,
                    compute_dtype: torch.dtype) -> "Int4Linear":
        q, scale, zero = rtn_int4(linear.weight.detach().float(), group_size, symmetric)
        return cls(q, scale, zero, group_size, linear.bias, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(self.compute_dtype).contiguous(),
            self.packed, self.group_size, self.scales_and_zeros)
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, read back through the kernel itself."""
        eye = torch.eye(self.in_features, dtype=self.compute_dtype)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, self.scales_and_zeros)
        return w_t[:, : self.out_features].T.float()

    def int_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [N, K] in 0..15, scale [N, K/g], zero_point [N, K/g])`` with
        ``w = (q - zero_point) * scale``, recovered from the packed kernel data."""
        sz = self.scales_and_zeros.float().transpose(0, 1)[: self.out_features]  # [N, K/g, 2]
        scale, zero = sz[..., 0], sz[..., 1]
        zero_point = torch.round(8 - zero / scale)
        n, k, g = self.out_features, self.in_features, self.group_size
        w = self.dequantize().reshape(n, k // g, g)
        q = torch.round(w / scale[..., None] + zero_point[..., None]).clamp(0, 15)
        return q.reshape(n, k), scale, zero_point


class FP8Linear(nn.Module):
    """FP8 weight storage, per-output-channel scale; emulated GEMM (see module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp8_dtype: torch.dtype,
                 compute_dtype: torch.dtype, quantize_activations: bool = False):
        super().__init__()
        self.act_dtype = fp8_dtype if quantize_activations else None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.compute_dtype = compute_dtype
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / torch.finfo(fp8_dtype).max
        self.register_buffer("weight_fp8", (w / scale[:, None]).to(fp8_dtype))
        self.register_buffer("scale", scale)  # [N] fp32
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype, x = x.dtype, x.to(self.compute_dtype)
        if self.act_dtype is not None:  # W8A8: per-token dynamic scale, round-trip through FP8
            s = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / torch.finfo(self.act_dtype).max
            x = ((x.float() / s).to(self.act_dtype).float() * s).to(self.compute_dtype)
        w = self.weight_fp8.to(self.compute_dtype) * self.scale.to(self.compute_dtype)[:, None]
        return F.linear(x, w, self.bias).to(in_dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight_fp8.float() * self.scale[:, None]


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix over ``sqrt(n)`` (fp32,
    orthogonal and symmetric: ``H @ H = I``); ``n`` a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n}; valid: a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotate_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (fp32, last dim a multiple of ``block``) times the block-diagonal
    Hadamard ``diag(H, H, ...)``: each run of ``block`` channels mixed into
    ``block`` channels of the same energy, so one outlier channel spreads over
    its block. Its own inverse."""
    shape = x.shape
    return (x.reshape(*shape[:-1], shape[-1] // block, block) @ hadamard(block)).reshape(shape)


class Int8DynLinear(nn.Module):
    """W8A8 INT8: int8 weights per output channel and int8 activations with a
    dynamic per-token scale, multiplied by ``torch._int_mm`` (int8 x int8 ->
    int32, a real integer GEMM on CPU), then rescaled by both scales.

    ``rotate > 0`` (QuaRot's online Hadamard): the input is multiplied by a
    block-diagonal Hadamard (``rotate_blocks``) before its quantization and
    the weight stored rotated the same way, so the float product is unchanged
    while per-token outliers spread across their block."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype, rotate: int = 0):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.compute_dtype = compute_dtype
        self.rotate = rotate
        self.register_buffer("qweight_t", q.T.contiguous())  # [K, N] int8, as _int_mm takes it
        self.register_buffer("scale", scale.float())  # [N] fp32
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype, rotate: int = 0) -> "Int8DynLinear":
        w = linear.weight.detach().float()
        if rotate:
            if w.shape[1] % rotate:
                raise ValueError(f"Hadamard block {rotate} does not divide the {w.shape[1]} input channels")
            w = rotate_blocks(w, rotate)
        q, scale = rtn_int8(w)
        return cls(q, scale, linear.bias, compute_dtype, rotate)

    @staticmethod
    def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int8 [M, K], scale [M, 1])`` with ``x ~= q * scale`` per row (token)."""
        s = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-8) / 127.0
        return torch.round(x.float() / s).clamp(-127, 127).to(torch.int8), s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1])
        xq, sx = self.quantize_tokens(rotate_blocks(x.float(), self.rotate) if self.rotate else x)
        y = (torch._int_mm(xq, self.qweight_t).float() * sx * self.scale).to(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The float weight this layer computes with, in its input's own basis
        (the rotation undone)."""
        w = self.qweight_t.T.float() * self.scale[:, None]
        return rotate_blocks(w, self.rotate) if self.rotate else w

    def int_weights(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``(q [N, K] in -127..127, scale [N, 1], None)``: symmetric, ``w = q * scale``."""
        return self.qweight_t.T.float(), self.scale.float()[:, None], None


# The modules a checkpoint stores quantized (export writes their integers).
QUANTIZED = (Int4Linear, Int8Linear, Int8DynLinear, FP8Linear)


def dequantized(mod) -> torch.Tensor:
    """The fp32 weight a quantized linear stands for, from its own integers
    (``(q - zero_point) * scale`` per group; FP8: value * scale)."""
    if isinstance(mod, FP8Linear):
        return mod.dequantize()
    q, scale, zp = mod.int_weights()
    n, k = q.shape
    groups = scale.shape[1]
    zp_full = torch.zeros_like(scale) if zp is None else zp
    return ((q.reshape(n, groups, k // groups) - zp_full[..., None]) * scale[..., None]).reshape(n, k)
