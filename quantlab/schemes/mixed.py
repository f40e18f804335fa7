"""Mixed precision: one round-to-nearest scheme per Linear layer, from a recipe.

A recipe (written by ``python -m quantlab.sensitivity``, or by hand) names a
candidate per layer; layers it does not name take ``default``:

    name: 5.0b                       # the run is named mixed-5.0b
    default: int4-g64
    layers:
      model.layers.0.mlp.down_proj: int8
      model.layers.29.mlp.down_proj: bf16   # kept in the compute dtype

Candidates: ``bf16`` (kept as it is, in the compute dtype), ``int8`` (per
channel) and ``int4-g<32|64|128|256>[-sym]``, each on the same real kernel as
its uniform scheme. With ``awq: true``, AWQ's per-channel scales are searched
first (``schemes.awq.scale_model``), each layer group against its own members'
candidates, and folded into the model before the layers are quantized. The
recipe's assignment is copied into the config when the
point is composed, so the run's ``config.yaml`` and its point hash hold the
recipe itself, not a path to a file that may change.
"""
from __future__ import annotations

import functools

import torch

from quantlab import calibration
from quantlab.errors import UserError
from quantlab.hardware import Hardware
from quantlab.schemes import awq, layers
from quantlab.schemes.configs import AWQ_GRID, CANDIDATES, FORMAT_CANDIDATES, KEEP, MixedScheme, _INT4
from quantlab.schemes.fplinear import FormatLinear, FP8BlockLinear, MXLinear, NVFP4Linear
from quantlab.schemes.awq import rtn_dequantized
from quantlab.schemes.qlinear import Int4Linear, Int8Linear, prefill_tags, rtn_int8
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights



def _int8_readback(w: torch.Tensor) -> torch.Tensor:
    q, scale = rtn_int8(w)
    return q.float() * scale[:, None]


# a block-scaled candidate's layer from a float weight, bias and compute dtype
_FORMAT_LAYERS = {
    "nvfp4-a16": lambda w, b, dtype: NVFP4Linear.quantize(w, b, dtype),
    "mxfp4-a16": lambda w, b, dtype: MXLinear.quantize(w, b, dtype, "fp4"),
    "mxfp8-a16": lambda w, b, dtype: MXLinear.quantize(w, b, dtype, "fp8"),
    "fp8-block-a16": lambda w, b, dtype: FP8BlockLinear(w, b, dtype, 128),
}
_FORMAT_GROUP = {"nvfp4-a16": NVFP4Linear.GROUP, "mxfp4-a16": MXLinear.GROUP, "mxfp8-a16": MXLinear.GROUP,
                 "fp8-block-a16": 1}


def readback(candidate: str):
    """The weight ``candidate``'s kernel reads back for a weight (``bf16``: itself)."""
    if candidate == KEEP:
        return lambda w: w
    if candidate == "int8":
        return _int8_readback
    if candidate in _FORMAT_LAYERS:
        return lambda w: _FORMAT_LAYERS[candidate](w.float(), None, torch.float32).dequantize()
    m = _INT4.match(candidate)
    return functools.partial(rtn_dequantized, group_size=int(m["g"]), symmetric=bool(m["sym"]))


def quantize_linear(lin: torch.nn.Linear, candidate: str, dtype: torch.dtype) -> torch.nn.Module:
    """``lin`` as ``candidate`` would store it (``bf16``: the layer itself)."""
    if candidate == KEEP:
        return lin
    if candidate == "int8":
        return Int8Linear.from_linear(lin, dtype)
    if candidate in _FORMAT_LAYERS:
        if lin.in_features % _FORMAT_GROUP[candidate]:
            raise UserError(f"{candidate}: group {_FORMAT_GROUP[candidate]} does not divide in_features "
                            f"{lin.in_features}")
        return _FORMAT_LAYERS[candidate](lin.weight.detach().float(), lin.bias, dtype)
    m = _INT4.match(candidate)
    if m is None:
        raise UserError(f"unknown mixed-precision candidate {candidate!r}; valid: {CANDIDATES}")
    group = int(m["g"])
    if lin.in_features % group:
        raise UserError(f"{candidate}: group {group} does not divide in_features {lin.in_features}")
    return Int4Linear.from_linear(lin, group, bool(m["sym"]), dtype)


def support(cfg: MixedScheme, hw: Hardware) -> Support:
    if hw.device == "cpu":
        if emulated := sorted({cfg.default, *cfg.layers.values()} & set(FORMAT_CANDIDATES)):
            return Support("emulated", f"{', '.join(emulated)} layers have no CPU kernel (dequantized per layer)")
        return Support("real", "each layer on its uniform scheme's CPU kernel")
    return Support("unsupported", f"mixed recipes run on CPU only so far (not {hw.device})")


def apply(model: torch.nn.Module, cfg: MixedScheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    linears = layers.select(model, cfg.skip)
    unknown = sorted(set(cfg.layers) - {n for n, _ in linears})
    if unknown:
        raise UserError(f"mixed-{cfg.name}: the recipe names {len(unknown)} layers this model does not have "
                        f"(first: {unknown[0]}): a recipe is made for one model")
    tags: dict[str, str] = {}
    if cfg.awq:
        model.float()
        ids, tags = calibration.batch_or_builtin(cfg.calibration, "awq", ctx, cfg.n_samples, cfg.seq_len)
        tags.update(awq.scale_model(model, {n: readback(cfg.layers.get(n, cfg.default)) for n, _ in linears},
                                    ids, AWQ_GRID))
    counts: dict[str, int] = {}
    for name, lin in linears:
        choice = cfg.layers.get(name, cfg.default)
        layers.replace(model, name, quantize_linear(lin, choice, dtype))
        counts[choice] = counts.get(choice, 0) + 1
    layers.cast_parameters(model, dtype)
    tags.update({f"mixed.layers.{c}": str(n) for c, n in sorted(counts.items())})
    emulated = any(isinstance(m, FormatLinear) for m in model.modules())  # a block-scaled layer has no CPU kernel
    how = "; block-scaled layers dequantized (emulated)" if emulated else ""
    return Applied(backend=f"mixed{'+awq' if cfg.awq else ''}: aten int8/int4 CPU kernels per layer{how}",
                   emulated=emulated, tags={**tags, **prefill_tags(dtype)})


def checkpoint(cfg: MixedScheme) -> Mapping:
    """compressed-tensors, one config group per candidate, each in its
    uniform scheme's format (``pack-quantized`` 8-bit int8 and 4-bit int4,
    asymmetric int4 as ``block`` groups: see ``int4.checkpoint``);
    ``bf16`` layers stay dense. The model's format is ``mixed-precision``
    where the groups' formats differ, else theirs (as compressed-tensors
    writes it: int8 and int4 groups are both ``pack-quantized``)."""
    from quantlab.schemes import fp8block, int4, int8, mx, nvfp4
    from quantlab.schemes.configs import FP8BlockScheme, MXScheme, NVFP4Scheme

    formats = {"nvfp4-a16": lambda d: nvfp4.checkpoint(NVFP4Scheme(activations="none", compute_dtype=d)),
               "mxfp4-a16": lambda d: mx.checkpoint(MXScheme(elem="fp4", activations="none", compute_dtype=d)),
               "mxfp8-a16": lambda d: mx.checkpoint(MXScheme(elem="fp8", activations="none", compute_dtype=d)),
               "fp8-block-a16": lambda d: fp8block.checkpoint(FP8BlockScheme(activations="none", compute_dtype=d))}
    candidates = {}
    for c in sorted({cfg.default, *cfg.layers.values()} - {KEEP}):
        if c in formats:
            m = formats[c](cfg.compute_dtype)
        elif c == "int8":
            m = int8.checkpoint(int8.Int8Scheme(compute_dtype=cfg.compute_dtype))
        else:
            g = _INT4.match(c)
            m = int4.checkpoint(int4.Int4Scheme(group_size=int(g["g"]), symmetric=bool(g["sym"]),
                                                compute_dtype=cfg.compute_dtype), asymmetric_as="block")
        candidates[c] = m.spec
    one = {m["format"] for m in candidates.values()}  # compressed-tensors names a uniform model by its format
    return Mapping({"format": one.pop() if len(one) == 1 else "mixed-precision", "candidates": candidates,
                    "layers": dict(cfg.layers), "default": cfg.default, "scale_dtype": cfg.compute_dtype,
                    "dtype": cfg.compute_dtype})


def no_gguf(cfg: MixedScheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()}: mixed recipes do not export to GGUF yet")


register_weights("mixed", MixedScheme, support, apply, checkpoint=checkpoint, gguf=no_gguf)
