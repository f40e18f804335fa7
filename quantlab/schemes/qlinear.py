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
  dtype on first use and kept beside the codes (outside the state dict). That
  is an *emulation* (no FP8 GEMM on CPU): storage is real, latency and memory
  are not those of an FP8 kernel.

``dequantize()`` returns the float weight each module computes with, for
numerics tests and export.

Where ATen's two weight-only kernels have no vectorized path for the
activation dtype on this CPU, they cost ~0.4 ms per token per 576x1536 layer
(46 ms at 128 tokens against 2.1 ms dense; ``benchmarks/prefill_path.py``).
They have one for bf16 in ATen's AVX2 and AVX-512 builds of its CPU kernels,
whatever oneDNN can do; none for fp32 or fp16 activations, nor for bf16 in the
generic build (measured with ``ATEN_CPU_CAPABILITY=default``); on other
instruction sets (ARM) none is assumed, not measured. There,
a call of at least ``DENSE_MIN_TOKENS`` tokens (prefill, lm-eval, perplexity,
calibration) multiplies the activations, rounded to the compute dtype as the
kernel takes them, by the dequantized weight in fp32 (the kernel's own
arithmetic: exact products, fp32 sums) and rounds the result to the compute
dtype, as vLLM's AWQ layer dequantizes for large batches. Decode (one token
a sequence) stays on the kernel. The weights stay packed; the dense weight is
one layer's, for the call's duration. Points tag which path ran
(:func:`prefill_tags`).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from quantlab import hardware
from quantlab.schemes.fplinear import FormatLinear, KeptWeight


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


# Tokens from which a call on a slow kernel path takes the dense one, from the
# measured crossover (benchmarks/prefill_path.py, fp32 activations, ms per
# 576x1536 call, kernel vs dense): int8 at 1 token 0.4 vs 1.9, at 4 tokens
# 1.4 vs 0.9; int4-g64 (its codes unpacked per call) at 4 tokens about even
# (0.8-1.7x across runs), from 16 tokens 2.5-40x faster dense.
DENSE_MIN_TOKENS = 4


def kernel_fast(dtype: torch.dtype) -> bool:
    """Whether ATen's CPU weight-only kernels are vectorized for activations
    of ``dtype`` here: bf16 where ATen dispatches its AVX2 or AVX-512 kernels
    (:func:`quantlab.hardware.cpu_vector_isa`); fp16 and fp32 never (40-100x
    slower than the bf16 path at 512 tokens on an AVX-512 CPU, as slow with
    ATen's generic kernels; ``benchmarks/prefill_path.py``)."""
    return dtype == torch.bfloat16 and hardware.cpu_vector_isa() in ("AVX2", "AVX512")


def dense_path(tokens: int, dtype: torch.dtype) -> bool:
    """A call of ``tokens`` rows goes through the dequantized weight in fp32."""
    return tokens >= DENSE_MIN_TOKENS and not kernel_fast(dtype)


def prefill_tags(dtype: torch.dtype) -> dict[str, str]:
    """The ``kernel.prefill`` tag of a point whose layers are Int8/Int4Linear."""
    if kernel_fast(dtype):
        return {"kernel.prefill": "packed kernel"}
    return {"kernel.prefill": f"dequantized fp32 GEMM from {DENSE_MIN_TOKENS} tokens (the packed kernel has no "
                              f"vectorized {str(dtype).removeprefix('torch.')} path on this CPU); decode on the kernel"}


def _dense(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` times the fp32 ``weight``, summed in fp32, rounded to ``dtype``."""
    return F.linear(x.to(dtype).float(), weight).to(dtype)


class WidenedLinear(nn.Linear):
    """A float ``nn.Linear`` in a half dtype this CPU has no native matmul for
    (:func:`quantlab.hardware.cpu_native_matmul`): a call of at least
    ``DENSE_MIN_TOKENS`` tokens multiplies in fp32 (the fallback's own
    arithmetic: exact widening, fp32 sums, result rounded to the half dtype),
    one token a sequence (decode) keeps PyTorch's own path on the half weight.
    Same parameters and state dict as ``nn.Linear``; :func:`widen` swaps it in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.numel() // max(x.shape[-1], 1) < DENSE_MIN_TOKENS:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def widen(model: nn.Module, dtype: torch.dtype) -> int:
    """Make every plain ``nn.Linear`` of a CPU model in ``dtype`` a
    :class:`WidenedLinear` where this CPU has no native ``dtype`` matmul;
    returns how many (0 where it has one, or for fp32)."""
    if hardware.cpu_native_matmul(dtype) or next(model.parameters()).device.type != "cpu":
        return 0
    plain = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == dtype]
    for m in plain:
        m.__class__ = WidenedLinear
    return len(plain)


def widened_tags(n: int, dtype: torch.dtype) -> dict[str, str]:
    """The ``kernel.half_linear`` tag of a point whose ``n`` float Linears
    :func:`widen` widened (none: no tag)."""
    if not n:
        return {}
    name = str(dtype).removeprefix("torch.")
    return {"kernel.half_linear": f"{n} {name} Linear layers multiply in fp32 from {DENSE_MIN_TOKENS} tokens "
                                  f"(no native {name} matmul on this CPU); decode on the half weights"}


class _PackedLinear(nn.Module):
    """A Linear over an integer-packed weight: a token count the kernel is slow
    at (:func:`dense_path`) multiplies the dequantized weight on the dense path,
    others call the packed kernel (:meth:`_packed_mm`, ``[M, K] -> [M, N]`` in
    ``compute_dtype``); then the bias, and the input's shape and dtype."""

    in_features: int
    out_features: int
    compute_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cpu and dense_path(x2.shape[0], self.compute_dtype):
            y = _dense(x2, self.dequantize(), self.compute_dtype)
        else:
            y = self._packed_mm(x2.to(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(_PackedLinear):
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

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2, self.qweight, self.scale)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]

    def int_weights(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``(q [N, K] in -127..127, scale [N, 1], None)``: symmetric, ``w = q * scale``."""
        return self.qweight.float(), self.scale.float()[:, None], None


class Int4Linear(_PackedLinear):
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

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.group_size,
                                                       self.scales_and_zeros)
        return y[:, : self.out_features]  # the rows padded to the kernel's alignment

    def codes(self) -> torch.Tensor:
        """The int4 codes ``[N, K]`` (0..15) unpacked from the kernel's layout."""
        n_pad = self.packed.shape[0]
        k = self.in_features
        block = _int4pack_block(k)
        full = n_pad - n_pad % block
        q = torch.empty(n_pad * k, dtype=torch.uint8)
        for rows, codes, packed in ((block, q[: full * k], self.packed[:full]),  # blocks share one layout
                                    (n_pad - full, q[full * k:], self.packed[full:])):
            if rows:
                pos = _int4pack_positions(rows, k)
                codes, packed = codes.view(-1, rows * k), packed.reshape(-1, rows * k // 2)
                codes[:, pos[0::2]] = packed & 0xF  # low nibbles, then high
                codes[:, pos[1::2]] = packed >> 4
        return q.reshape(n_pad, k)[: self.out_features]

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``(q - 8) * scale + zero`` per
        group in fp32 (tinygemm's convention; the kernel forms it in fp32 too)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        sz = self._scales_zeros()
        q = self.codes().float().reshape(n, k // g, g)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)

    def _scales_zeros(self) -> torch.Tensor:
        """``[N, K/g, 2]`` fp32: each group's tinygemm scale and zero, padding rows dropped."""
        return self.scales_and_zeros.float().transpose(0, 1)[: self.out_features]

    def int_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [N, K] in 0..15, scale [N, K/g], zero_point [N, K/g])`` with
        ``w = (q - zero_point) * scale``, recovered from the packed kernel data."""
        sz = self._scales_zeros()
        scale, zero = sz[..., 0], sz[..., 1]
        zero_point = torch.round(8 - zero / scale)
        return self.codes().float(), scale, zero_point


@functools.cache
def _int4pack_positions(n: int, k: int) -> torch.Tensor:
    """Where ``_convert_weight_to_int4pack_for_cpu`` puts each code of an
    ``[n, k]`` matrix, as flat indices in row-major order of the nibbles
    (byte by byte, low nibble first). Read off the packing function itself,
    one bit of the index at a time (its layout depends on the CPU's ISA), so
    it holds on any CPU. Asked for one row block (:func:`_int4pack_block`)
    and a tail, never for a whole large matrix."""
    index = torch.arange(n * k, dtype=torch.int64).reshape(n, k)
    where = torch.zeros(n * k, dtype=torch.int64)
    for bit in range((n * k - 1).bit_length()):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((index >> bit) & 1).int(), 1)
        where |= torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1).long() << bit
    return where


@functools.cache
def _int4pack_block(k: int) -> int:
    """Rows of the packing's repeating block at ``k`` columns (64 on AVX-512):
    the least of 16, 32, 64, 128 whose layout, stacked three times, is that
    of three times as many rows. A packing with no such block raises
    ValueError (never a silently wrong unpack)."""
    for rows in (16, 32, 64, 128):
        one = _int4pack_positions(rows, k)
        if torch.equal(_int4pack_positions(3 * rows, k), torch.cat([one + b * rows * k for b in range(3)])):
            return rows
    raise ValueError(f"tinygemm CPU packing at K={k}: no repeating row block of 16-128 rows found")


class FP8Linear(KeptWeight):
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

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   compute_dtype: torch.dtype, quantize_activations: bool = False) -> "FP8Linear":
        """The module over FP8 ``codes`` ``[N, K]`` and per-channel ``scale``
        ``[N]`` as a checkpoint stores them (its own, not recomputed)."""
        mod = cls(torch.zeros(codes.shape), bias, codes.dtype, compute_dtype, quantize_activations)
        mod.weight_fp8, mod.scale = codes.contiguous(), scale.float().contiguous()
        return mod

    def make_weight(self) -> torch.Tensor:
        return self.weight_fp8.to(self.compute_dtype) * self.scale.to(self.compute_dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype, x = x.dtype, x.to(self.compute_dtype)
        if self.act_dtype is not None:  # W8A8: per-token dynamic scale, round-trip through FP8
            s = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / torch.finfo(self.act_dtype).max
            x = ((x.float() / s).to(self.act_dtype).float() * s).to(self.compute_dtype)
        return F.linear(x, self.kept_weight(), self.bias).to(in_dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight_fp8.float() * self.scale[:, None]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """compressed-tensors' uncompressed ``weight`` and per-channel ``weight_scale``."""
        return {"weight": self.dequantize(), "weight_scale": self.scale[:, None]}


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
QUANTIZED = (Int4Linear, Int8Linear, Int8DynLinear, FP8Linear, FormatLinear)


def dequantized(mod) -> torch.Tensor:
    """The fp32 weight a quantized linear stands for, from its own integers
    (``(q - zero_point) * scale`` per group; FP8: value * scale; the
    block-scaled formats: their codes times their scales)."""
    if isinstance(mod, (FP8Linear, FormatLinear)):
        return mod.dequantize()
    q, scale, zp = mod.int_weights()
    n, k = q.shape
    groups = scale.shape[1]
    zp_full = torch.zeros_like(scale) if zp is None else zp
    return ((q.reshape(n, groups, k // groups) - zp_full[..., None]) * scale[..., None]).reshape(n, k)
