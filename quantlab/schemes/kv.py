"""KV-cache schemes on the transformers Cache API.

* ``none``: transformers' ``DynamicCache`` in the model's dtype.
* ``int8``: int8 storage with symmetric scales per attention head (keys and
  values apart), computed from the prefill and frozen for decode (``static``),
  per head and token (``dynamic``), or per head from the calibration set before
  any request (``calibrated``: what a deployment fixes once). New tokens are
  appended as int8.
* ``int4``: KIVI: keys per channel, values per token, in groups, packed two
  per byte; tokens are quantized a whole group at a time, once, and the newest
  ``residual_length`` (up to ``residual_length + group_size - 1``) stay in full
  precision (see :class:`Int4Layer`).
* ``nvfp4``: E2M1 codes packed two per byte with an E4M3 scale per 16 along
  the head dimension and a per-tensor fp32 scale from the prefill
  (:mod:`quantlab.schemes.fpquant`'s NVFP4 rounding); emulated: the
  attention kernels that read FP4 K/V directly are Blackwell's.
* ``fp8``: transformers' own ``Fp8QuantizedLayer`` (E4M3, per-tensor scale
  from the prefill), or one scale per tensor from the calibration set
  (``calibrated``: vLLM's ``k_scale`` / ``v_scale``, which an export writes as
  compressed-tensors' ``kv_cache_scheme``), or one per KV head
  (``calibrated-head``: compressed-tensors' ``attn_head`` strategy, scales
  ``[heads, 1, 1]``), values past it saturated.

Calibrated scales (:func:`calibrate`) are the absolute maxima of the keys and
values the point itself (its quantized weights) writes into its cache over the
calibration windows, per layer and head, keys after RoPE, as the cache stores
them.

Every quantized layer dequantizes on read, so attention itself runs in the
compute dtype: on CPU a quantized cache saves memory, not time.
"""
from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import BaseQuantizedLayer, Cache, DynamicCache, DynamicLayer, Fp8QuantizedLayer

from quantlab.schemes.base import KVScheme
from quantlab.schemes import fpquant
from quantlab.schemes.configs import FP8KV, Int4KV, Int8KV, NoKV, NVFP4KV
from quantlab.hardware import Hardware
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_kv


class Int8Layer(BaseQuantizedLayer):
    """int8 K/V ``[B, H, T, D]`` with symmetric scales ``[1, H, 1, 1]`` (static)
    or ``[B, H, T, 1]`` (dynamic); appendable, no full-precision copy kept."""

    def __init__(self, dynamic: bool, fixed: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``fixed``: calibrated (key, value) scales ``[1, H, 1, 1]``, used
        instead of the prefill's (values past them saturate at +-127)."""
        super().__init__()
        self.dynamic, self.fixed = dynamic, fixed

    @staticmethod
    def scale_of(amax: torch.Tensor) -> torch.Tensor:
        """The symmetric int8 scale of absolute maxima ``amax``."""
        return (amax.float() / 127.0).clamp_min(1e-8)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_of(x.abs().amax(dim=(-1,) if self.dynamic else (0, 2, 3), keepdim=True))

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor | None = None):
        scale = self._scale(x) if scale is None or self.dynamic else scale
        return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale

    def _dequantize(self, q):
        data, scale = q
        return (data.float() * scale).to(self.keys.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            k_scale, v_scale = self.fixed or (None, None)
            self._quantized_keys = self._quantize(key_states, k_scale)
            self._quantized_values = self._quantize(value_states, v_scale)
            return key_states, value_states  # the prefill attends its own states, as in every quantized layer
        pairs = []
        for stored, new in ((self._quantized_keys, key_states), (self._quantized_values, value_states)):
            q, s = self._quantize(new, stored[1])
            scale = torch.cat([stored[1], s], dim=-2) if self.dynamic else stored[1]
            pairs.append((torch.cat([stored[0], q], dim=-2), scale))
        self._quantized_keys, self._quantized_values = pairs
        return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def _quantize4(x: torch.Tensor, g: int):
    """Asymmetric 4-bit along the last dim in groups of ``g``: (packed uint8
    ``[..., n/2]``, scale and minimum ``[..., n/g, 1]`` in bf16)."""
    *lead, n = x.shape
    grouped = x.float().reshape(*lead, n // g, g)
    lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((grouped - lo) / scale).clamp(0, 15).to(torch.uint8).reshape(*lead, n)
    return _pack4(q), scale.to(torch.bfloat16), lo.to(torch.bfloat16)


def _dequantize4(packed: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    q = _unpack4(packed).float()
    *lead, n = q.shape
    g = n // scale.shape[-2]
    return (q.reshape(*lead, n // g, g) * scale.float() + lo.float()).reshape(*lead, n)


class Int4Layer(BaseQuantizedLayer):
    """KIVI (Liu et al., 2024): keys quantized per channel over groups of
    ``group_size`` tokens, values per token over groups of ``group_size``
    channels; asymmetric 4-bit, packed two per byte.

    Tokens reach the quantized store a whole group at a time, oldest first, and
    once: what is stored is never dequantized and quantized again. Until the
    sequence is longer than ``residual_length`` every token is full precision;
    after that the newest ``residual_length`` to ``residual_length + group_size
    - 1`` tokens are. Attention sees the stored tokens dequantized, then the
    full-precision ones. ``_quantized_keys``: (packed ``[B, H, D, Tq/2]``,
    scale, min ``[B, H, D, Tq/g, 1]``); ``_quantized_values``: (packed
    ``[B, H, Tq, D/2]``, scale, min ``[B, H, Tq, D/g, 1]``)."""

    def __init__(self, group_size: int, residual_length: int):
        super().__init__()
        Int4KV(group_size, residual_length)  # the same checks as the config
        self.group_size, self.residual_length = group_size, residual_length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        d = key_states.shape[-1]
        if d % self.group_size:
            raise ValueError(f"int4 kv: head_dim {d} is not a multiple of group_size {self.group_size} "
                             f"(values are grouped along the head dimension)")
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]

    def _quantize(self, x: torch.Tensor, axis: int = -1):
        """Keys (``axis=-2``): per channel over tokens; values: per token over channels."""
        return _quantize4(x.transpose(-1, -2) if axis == -2 else x, self.group_size)

    def _dequantize(self, qt, axis: int = -1) -> torch.Tensor:
        x = _dequantize4(*qt)
        return (x.transpose(-1, -2) if axis == -2 else x).to(self.keys.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        if self._quantized_keys is None:
            out_k, out_v = keys, values
        else:
            out_k = torch.cat([self._dequantize(self._quantized_keys, -2), keys], dim=-2)
            out_v = torch.cat([self._dequantize(self._quantized_values), values], dim=-2)
        over = keys.shape[-2] - self.residual_length
        move = over // self.group_size * self.group_size if over > 0 else 0
        if move:
            qk, qv = self._quantize(keys[..., :move, :], -2), self._quantize(values[..., :move, :])
            if self._quantized_keys is not None:
                (pk, sk, lk), (pv, sv, lv) = self._quantized_keys, self._quantized_values
                qk = (torch.cat([pk, qk[0]], -1), torch.cat([sk, qk[1]], -2), torch.cat([lk, qk[2]], -2))
                qv = (torch.cat([pv, qv[0]], -2), torch.cat([sv, qv[1]], -3), torch.cat([lv, qv[2]], -3))
            self._quantized_keys, self._quantized_values = qk, qv
            keys, values = keys[..., move:, :].clone(), values[..., move:, :].clone()  # free the moved
        self.keys, self.values = keys, values
        return out_k, out_v

    def quantized_tokens(self) -> int:
        return 0 if self._quantized_values is None else self._quantized_values[0].shape[-2]


class NVFP4Layer(BaseQuantizedLayer):
    """NVFP4 K/V ``[B, H, T, D]``: codes packed two per byte ``[B, H, T, D/2]``,
    E4M3 scales ``[B, H, T, D/16]`` (each token's, as it is written) and the
    per-tensor fp32 scale from the prefill; appendable, no full-precision copy."""

    def _quantize(self, x: torch.Tensor, global_scale: torch.Tensor):
        codes, scale, gs = fpquant.nvfp4_quantize(x, global_scale)
        return fpquant.pack_nibbles(codes), scale.to(torch.float8_e4m3fn), gs

    def _dequantize(self, q):
        packed, scale, gs = q
        return fpquant.nvfp4_dequantize(fpquant.unpack_nibbles(packed), scale.float(), gs).to(self.keys.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._quantized_keys, self._quantized_values = (
                self._quantize(x, fpquant.nvfp4_global_scale(x.float().abs().amax()))
                for x in (key_states, value_states))
            return key_states, value_states  # the prefill attends its own states, as in every quantized layer
        pairs = []
        for stored, new in ((self._quantized_keys, key_states), (self._quantized_values, value_states)):
            packed, scale, gs = self._quantize(new, stored[2])
            pairs.append((torch.cat([stored[0], packed], dim=-2), torch.cat([stored[1], scale], dim=-2), gs))
        self._quantized_keys, self._quantized_values = pairs
        return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)


class Fp8CalibratedLayer(Fp8QuantizedLayer):
    """FP8 E4M3 with fixed per-tensor scales (keys and values apart), values
    past ``448 * scale`` saturated (a plain cast would make them NaN)."""

    def __init__(self, k_scale: torch.Tensor, v_scale: torch.Tensor):
        super().__init__()
        self.k_scale, self.v_scale = k_scale, v_scale

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        DynamicLayer.lazy_initialization(self, key_states, value_states)
        self._quantized_keys = self._quantize(key_states, self.k_scale)
        self._quantized_values = self._quantize(value_states, self.v_scale)

    def _quantize(self, tensor, scale=None):
        return (tensor.float() / scale).clamp(-self.fp8_max, self.fp8_max).to(self.fp8_dtype), scale


class KVCache(Cache):
    """A cache of quantized layers, ``layer_factory(i)`` making layer ``i``."""

    def __init__(self, layer_factory, config):
        n = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[layer_factory(i) for i in range(n)])


class _Recorder(DynamicLayer):
    """Keeps the per-head absolute maxima of the K/V it is given and stores
    nothing: each window is one forward, attending its own states."""

    def __init__(self):
        super().__init__()
        self.k_amax = self.v_amax = None

    def update(self, key_states, value_states, *args, **kwargs):
        k, v = (x.detach().abs().float().amax(dim=(0, 2, 3)) for x in (key_states, value_states))
        self.k_amax = k if self.k_amax is None else torch.maximum(self.k_amax, k)
        self.v_amax = v if self.v_amax is None else torch.maximum(self.v_amax, v)
        return key_states, value_states


@torch.inference_mode()
def calibrate(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (key, value) absolute maxima ``[H]`` (per KV head) over
    the windows ``ids: [N, T]``, as the model writes them into its cache."""
    device = model.get_input_embeddings().weight.device
    cache = KVCache(lambda i: _Recorder(), model.config)
    for row in ids:
        model(input_ids=row[None].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    return [(layer.k_amax, layer.v_amax) for layer in cache.layers]


def cache_factory(cfg: KVScheme, amax: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """``factory(config=model_config) -> Cache`` for the latency and cache
    probes; ``amax``: :func:`calibrate`'s maxima, for calibrated scales."""
    if isinstance(cfg, NoKV):
        return DynamicCache
    calibrated = getattr(cfg, "scales", "").startswith("calibrated")
    if calibrated and amax is None:
        raise ValueError(f"{cfg.short_name()}: calibrated scales need the calibration's maxima")
    if isinstance(cfg, Int8KV):
        if calibrated:
            scales = [tuple(Int8Layer.scale_of(a).view(1, -1, 1, 1) for a in kv) for kv in amax]
            return partial(KVCache, lambda i: Int8Layer(False, scales[i]))
        return partial(KVCache, lambda i: Int8Layer(cfg.scales == "dynamic"))
    if isinstance(cfg, Int4KV):
        return partial(KVCache, lambda i: Int4Layer(cfg.group_size, cfg.residual_length))
    if isinstance(cfg, NVFP4KV):
        return partial(KVCache, lambda i: NVFP4Layer())
    if isinstance(cfg, FP8KV):
        if cfg.scales == "calibrated-head":
            scales = [tuple(fp8_head_scales(a).view(1, -1, 1, 1) for a in kv) for kv in amax]
            return partial(KVCache, lambda i: Fp8CalibratedLayer(*scales[i]))
        if calibrated:
            scales = [tuple(fp8_scale(a) for a in kv) for kv in amax]
            return partial(KVCache, lambda i: Fp8CalibratedLayer(*scales[i]))
        return partial(KVCache, lambda i: Fp8QuantizedLayer())
    raise TypeError(f"no cache for {type(cfg).__name__}")


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """One E4M3 scale per tensor (a 0-d float32) from per-head maxima: the
    dequantization factor vLLM's ``k_scale`` / ``v_scale`` are (x = fp8 * scale)."""
    return (amax.float().max().clamp_min(1e-8) / Fp8QuantizedLayer.fp8_max).reshape(())


def fp8_head_scales(amax: torch.Tensor) -> torch.Tensor:
    """One E4M3 scale per KV head ``[H]`` from per-head maxima."""
    return amax.float().clamp_min(1e-8) / Fp8QuantizedLayer.fp8_max


# compressed-tensors' description of a static per-tensor FP8 cache (llm-compressor writes the same)
FP8_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


def checkpoint_scales(model: torch.nn.Module, amax: list[tuple[torch.Tensor, torch.Tensor]],
                      per_head: bool = False) -> dict:
    """What an export of a calibrated FP8 cache writes: ``kv_cache_scheme`` and
    ``<attention module>.k_scale`` / ``.v_scale`` per layer (float32 ``[1]``, or
    ``[heads, 1, 1]`` with ``per_head``: the ``attn_head`` strategy), the names
    compressed-tensors writes and vLLM maps onto its attention layers.
    The attention modules are the model's ``*Attention`` modules in order, one
    per cache layer (a mismatch raises)."""
    attn = [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    if len(attn) != len(amax):
        raise ValueError(f"{len(attn)} attention modules for {len(amax)} cache layers: cannot name the KV scales")
    tensors = {}
    for name, (k, v) in zip(attn, amax):
        for what, a in (("k", k), ("v", v)):
            tensors[f"{name}.{what}_scale"] = fp8_head_scales(a).reshape(-1, 1, 1) if per_head else \
                fp8_scale(a).reshape(1)
    return {"kv_cache_scheme": {**FP8_KV_CACHE_SCHEME, "strategy": "attn_head" if per_head else "tensor"},
            "tensors": tensors}


def scale_tags(amax: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, str]:
    """What the run says about calibrated maxima: their range over layers and heads."""
    k = torch.stack([a for a, _ in amax])
    v = torch.stack([b for _, b in amax])
    return {"kv.calibrated.k_amax": f"{k.min():.3g}..{k.max():.3g}",
            "kv.calibrated.v_amax": f"{v.min():.3g}..{v.max():.3g}"}


def cache_bytes(cache: Cache) -> int:
    """Bytes the cache holds: quantized data, scales and any full-precision window."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None),
                  *(getattr(layer, "_quantized_keys", None) or ()),
                  *(getattr(layer, "_quantized_values", None) or ())):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def support(cfg: KVScheme, hw: Hardware) -> Support:
    if isinstance(cfg, NVFP4KV) and hw.device in ("cpu", "cuda"):
        return Support("emulated", "NVFP4 K/V stored packed, dequantized on read (no FP4 attention kernel wired)")
    if isinstance(cfg, NoKV) or hw.device in ("cpu", "cuda"):
        return Support("real", "" if isinstance(cfg, NoKV) else "dequantized on read; attention in compute dtype")
    return Support("unsupported", f"quantized KV cache on {hw.device}")


def apply(model: torch.nn.Module, cfg: KVScheme, ctx: ApplyContext) -> Applied:
    """The cache factory; calibrated scales are measured here, on the point's
    own (already quantized) model."""
    scales = getattr(cfg, "scales", "")
    backend = {NoKV: "transformers.DynamicCache", Int8KV: f"quantlab.Int8Layer({scales})",
               Int4KV: "quantlab.Int4Layer(KIVI)", NVFP4KV: "quantlab.NVFP4Layer(dequant)",
               FP8KV: "transformers.Fp8QuantizedLayer" if not scales.startswith("calibrated") else
               f"quantlab.Fp8CalibratedLayer({'per head' if scales == 'calibrated-head' else 'per tensor'})"}[type(cfg)]
    if not scales.startswith("calibrated"):
        return Applied(backend=backend, emulated=isinstance(cfg, NVFP4KV), cache_factory=cache_factory(cfg),
                       config=cfg)
    from quantlab import calibration

    ids, tags = calibration.batch_or_builtin(cfg.calibration, cfg.short_name(), ctx, cfg.n_samples, cfg.seq_len)
    amax = calibrate(model, ids)
    return Applied(backend=backend, emulated=False, cache_factory=cache_factory(cfg, amax), config=cfg,
                   tags={**{f"kv.{k}": v for k, v in tags.items()}, **scale_tags(amax)},
                   checkpoint=checkpoint_scales(model, amax, scales == "calibrated-head")
                   if isinstance(cfg, FP8KV) else {})


_GGUF_CACHE = {NoKV: "F16", Int8KV: "Q8_0", Int4KV: "Q4_0"}


def gguf(cfg: KVScheme) -> Mapping:
    """llama.cpp's K/V cache type: q8_0 / q4_0 blocks of 32 along the head
    dimension, one fp16 scale each (dynamic, not quantlab's per-head scales)."""
    if type(cfg) not in _GGUF_CACHE:
        return Mapping(reason=f"llama.cpp has no cache type for {cfg.short_name()} (q8_0 and q4_0 only)")
    if getattr(cfg, "scales", "").startswith("calibrated"):
        return Mapping(reason=f"{cfg.short_name()}: llama.cpp's q8_0 cache scales each block as it is written; "
                              f"it takes no calibrated scales")
    return Mapping({"type": _GGUF_CACHE[type(cfg)]})


_VLLM_CACHE = {NoKV: "auto", FP8KV: "fp8"}


def vllm(cfg: KVScheme) -> Mapping:
    """vLLM's ``--kv-cache-dtype`` and where its scales come from: fp8 with the
    calibrated per-tensor ``k_scale`` / ``v_scale`` the export writes
    (``scales: checkpoint``), or, for prefill-scaled fp8, vLLM's own default
    of 1.0 (vLLM 0.32 computes no scale from the prompt, so that point is not
    quantlab's prefill-scaled cache: ``scales: 1.0``); int8 and int4 layouts
    have no vLLM counterpart."""
    if type(cfg) not in _VLLM_CACHE:
        return Mapping(reason=f"{cfg.short_name()}: quantlab's cache layout has no vLLM --kv-cache-dtype (fp8 maps)")
    if getattr(cfg, "scales", "") == "calibrated-head":
        return Mapping(reason=f"{cfg.short_name()}: per-head k/v scales are read by vLLM's CUDA flash-attention "
                              "backend only (not tried here); its CPU build takes per-tensor scales: kvfp8-cal")
    scales = "" if isinstance(cfg, NoKV) else "checkpoint" if cfg.scales == "calibrated" else "1.0"
    return Mapping({"kv_cache_dtype": _VLLM_CACHE[type(cfg)], "scales": scales})


for _name, _cls in (("none", NoKV), ("int8", Int8KV), ("int4", Int4KV), ("fp8", FP8KV), ("nvfp4", NVFP4KV)):
    register_kv(_name, _cls, support, apply, gguf=gguf, vllm=vllm)
