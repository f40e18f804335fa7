"""The rounding of the block-scaled formats engines ship: NVFP4, MXFP4, MXFP8,
FP8 with 128 x 128 blocks, and W4A8's INT4 groups with FP8 tokens.

Every function here reproduces compressed-tensors 0.20.1 (the library
llm-compressor writes these checkpoints with and vLLM reads them through)
value for value, in fp32; ``tests/test_formats.py`` holds each one equal,
bit for bit, to the library's own ``calculate_qparams`` / ``quantize`` /
compressors on random and edge tensors. The conventions, read from its code:

* **E2M1** (FP4): round to nearest, ties to even (0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at 6. A code
  is ``sign << 3 | index`` into (0, 0.5, 1, 1.5, 2, 3, 4, 6); a negative
  value rounded to zero keeps its sign (code 8), an input of -0.0 does not
  (code 0): the reference multiplies by ``torch.sign``, and its packer reads
  the ``signbit`` of that.
* **NVFP4** (tensor-group): a global scale ``448 * 6 / amax(tensor)``; per
  16 values ``fp8_e4m3(global * amax16 / 6)`` (0 becomes 0.125); the values
  divided by ``scale / global``.
* **MX** (groups of 32, E8M0 scales): the group's amax rounded up to the next
  power of two when its significand is at least 1.75 (the reference's
  ``round_to_power_2``: the largest element would otherwise saturate), the
  biased exponent ``floor(log2) + 127 - emax`` (emax 2 for E2M1, 8 for
  E4M3) clamped to 0..255. This is not the OCP spec's plain ``floor``; it is
  what the checkpoints carry.
* **FP8 blocks**: ``amax / 448`` per 128 x 128 block (a partial block at the
  edge takes the values it has, as the reference pads with zeros); E4M3 by
  PyTorch's round-to-nearest-even cast after clamping to +-448.
* **Zero's sign**: the reference adds its (zero) zero point to the scaled
  values before rounding, so an input of -0.0 is stored as +0 in every
  format (``+ 0.0`` below), while a negative value that rounds to zero keeps
  its sign.
* **Dynamic activations**: the same rules per token (FP8, ``amax / 448``),
  per group of 128 (FP8 blocks' activations), of 32 (MX) or of 16 with a
  calibrated global scale (NVFP4 W4A4).
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# magnitude thresholds of round-half-to-even onto E2M1: (bound, inclusive?) per step up
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
MX_EMAX = {"fp4": 2, "fp8": 8}  # floor(log2(largest element))
_FP8_EPS = 0.125  # what the reference puts in place of a zero E4M3 scale
_FP32_EPS = torch.finfo(torch.float32).eps


def e2m1_index(x: torch.Tensor) -> torch.Tensor:
    """Index 0..7 of the E2M1 magnitude nearest ``|x|`` (ties to even), saturating."""
    a = x.abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8)
    for bound, inclusive in _E2M1_STEPS:
        idx += (a >= bound if inclusive else a > bound).to(torch.uint8)
    return idx


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (``sign << 3 | index``, uint8) of ``x`` already scaled to E2M1's range."""
    return e2m1_index(x) | ((x < 0).to(torch.uint8) << 3)  # -0.0 < 0 is False: code 0, as the reference


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes."""
    mag = E2M1_VALUES[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -mag, mag)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Codes of ``x`` (already divided by its scale) saturated at +-6 and rounded onto E2M1."""
    return e2m1_codes(x.clamp(-E2M1_MAX, E2M1_MAX))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` 4-bit codes -> ``[N, K/2]`` uint8, element ``2j`` in the low nibble
    (compressed-tensors' ``pack_fp4_to_uint8`` layout)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"{x.shape[-1]} columns are not a multiple of the group of {group}")
    return x.float().unflatten(-1, (x.shape[-1] // group, group))


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (already divided by its scale) saturated at +-448 and rounded to E4M3
    (``float8_e4m3fn``); -0.0 becomes +0 (see the module doc)."""
    return (x + 0.0).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _symmetric_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """``amax / top``, a zero replaced by fp32's eps (the reference's guard)."""
    scale = amax / top
    return torch.where(scale == 0, torch.tensor(_FP32_EPS), scale)


# --- NVFP4 -----------------------------------------------------------------

def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / amax`` (fp32, shape [1]); 1.0 where that is not finite."""
    amax = amax.float().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(E4M3_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_scales(x: torch.Tensor, global_scale: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Per-group E4M3 scales (fp32 values) ``[..., K/group]``, global scale folded in."""
    amax = _grouped(x, group).abs().amax(-1)
    scale = e4m3(global_scale * (amax / E2M1_MAX)).float()
    return torch.where(scale == 0, torch.tensor(_FP8_EPS), scale)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor | None = None, group: int = 16):
    """``(codes [..., K] uint8, scales [..., K/group] fp32, global_scale [1])``;
    ``global_scale`` None: the tensor's own (weights)."""
    if global_scale is None:
        global_scale = nvfp4_global_scale(x.float().abs().amax())
    scale = nvfp4_scales(x, global_scale, group)
    g = _grouped(x, group) / (scale / global_scale)[..., None]
    return e2m1_round(g).flatten(-2), scale, global_scale


def nvfp4_dequantize(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     group: int = 16) -> torch.Tensor:
    v = _grouped(e2m1_decode(codes), group) * (scale / global_scale)[..., None]
    return v.flatten(-2)


# --- MX (E8M0 scales over 32 values) -----------------------------------------

def mx_exponents(x: torch.Tensor, elem: str, group: int = 32) -> torch.Tensor:
    """Biased E8M0 exponents (uint8) ``[..., K/group]`` of ``x``'s groups."""
    amax = _grouped(x, group).abs().amax(-1).contiguous()
    bits = amax.view(torch.int32)
    rounded = ((bits + (1 << 21)) >> 23) & 0xFF  # biased exponent after rounding a 1.75+ significand up
    return (rounded - MX_EMAX[elem]).clamp(0, 255).to(torch.uint8)


def mx_scale(exponents: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** (e - 127)`` of biased E8M0 exponents (2**-127 is an fp32 subnormal)."""
    return torch.ldexp(torch.ones(exponents.shape), exponents.int() - 127)


def mx_quantize(x: torch.Tensor, elem: str, group: int = 32):
    """``(elements, exponents)``: fp4 codes (uint8) or fp8 E4M3 values
    (``float8_e4m3fn``) ``[..., K]`` and E8M0 exponents ``[..., K/group]``."""
    e = mx_exponents(x, elem, group)
    g = _grouped(x, group) / mx_scale(e)[..., None]
    return (e2m1_round(g) if elem == "fp4" else e4m3(g)).flatten(-2), e


def mx_dequantize(elements: torch.Tensor, exponents: torch.Tensor, group: int = 32) -> torch.Tensor:
    v = e2m1_decode(elements) if elements.dtype == torch.uint8 else elements.float()
    return (_grouped(v, group) * mx_scale(exponents)[..., None]).flatten(-2)


# --- FP8 with 2-D blocks ---------------------------------------------------------

def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w [N, K]`` zero-padded to whole blocks, as ``[N/bh, K/bw, bh, bw]``."""
    bh, bw = block
    n, k = w.shape
    p = torch.nn.functional.pad(w.float(), (0, (-k) % bw, 0, (-n) % bh))
    return p.reshape(p.shape[0] // bh, bh, p.shape[1] // bw, bw).transpose(1, 2)


def _unblock(b: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    nb, kb, bh, bw = b.shape
    return b.transpose(1, 2).reshape(nb * bh, kb * bw)[: shape[0], : shape[1]]


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """``(float8_e4m3fn [N, K], scale fp32 [ceil(N/bh), ceil(K/bw)])``."""
    b = _blocks(w, block)
    scale = _symmetric_scale(b.abs().amax((-1, -2)), E4M3_MAX)
    return _unblock(e4m3(b / scale[..., None, None]), tuple(w.shape)), scale


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    b = _blocks(q.float(), block) * scale[..., None, None]
    return _unblock(b, tuple(q.shape))


# --- W4A8: symmetric INT4 groups ----------------------------------------------

def int4_sym_quantize(w: torch.Tensor, group: int):
    """compressed-tensors' symmetric INT4 groups: ``scale = amax / 7.5``,
    ``q = round(w / scale)`` (ties to even) in -8..7. Returns ``(q int8, scale fp32)``."""
    g = _grouped(w, group)
    scale = _symmetric_scale(g.abs().amax(-1), 7.5)
    q = torch.round(g / scale[..., None] + 0.0).clamp(-8, 7)
    return q.flatten(-2).to(torch.int8), scale


def int4_sym_dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return (_grouped(q.float(), group) * scale[..., None]).flatten(-2)


# --- dynamic activations (fake-quantized: the values a kernel would multiply) -------

def fp8_tokens(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """``x`` through E4M3 with a dynamic scale per token (``group`` 0) or per
    ``group`` columns of a token (a last, partial group scaled on its own)."""
    xf = x.float()
    if group:
        pad = (-xf.shape[-1]) % group
        g = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, group))
    else:
        g = xf.unsqueeze(-2)
    s = _symmetric_scale(g.abs().amax(-1, keepdim=True), E4M3_MAX)
    out = e4m3(g / s).float() * s
    return out.flatten(-2)[..., : xf.shape[-1]]


def mx_tokens(x: torch.Tensor, elem: str) -> torch.Tensor:
    elements, e = mx_quantize(x, elem)
    return mx_dequantize(elements, e)


def nvfp4_tokens(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    codes, scale, gs = nvfp4_quantize(x, global_scale)
    return nvfp4_dequantize(codes, scale, gs)
