"""``scheme/weights=as-is``: a checkpoint quantized elsewhere, kept as made.

compressed-tensors: the model arrives dequantized by compressed-tensors
(:func:`quantlab.models.load`); each quantized Linear is then rebuilt from the
checkpoint's own tensors (codes unpacked with compressed-tensors'
``unpack_from_int32``, its scales and zero points) as quantlab's int4 / int8 /
W8A8 / FP8 module, so the point runs the artifact's integers on quantlab's
kernels. A weight-only format with no quantlab kernel stays as
compressed-tensors decompressed it (exact weights, emulated). Sizes are counted
from the checkpoint's files.

GPTQ / AWQ: the model arrives with its packed Linears dequantized
(:func:`quantlab.gptq_awq.load`); each is rebuilt on quantlab's int4 kernel
from the checkpoint's own integers, zero points and scales.

bitsandbytes 4-bit: transformers loads the checkpoint as bitsandbytes'
Linear4bit modules, which run as they are (bitsandbytes' CPU kernels).

GGUF: the llama.cpp target runs the file itself (see
:mod:`quantlab.targets.llamacpp`); on PyTorch targets the model holds its
tensors as gguf-py dequantizes them per type (exact weights, emulated).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from quantlab import artifacts, gptq_awq, model_files, point
from quantlab.hardware import Hardware
from quantlab.schemes import bnb4, layers
from quantlab.schemes.configs import AsIsScheme
from quantlab.schemes.qlinear import FP8Linear, Int4Linear, Int8DynLinear, Int8Linear, prefill_tags
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

log = logging.getLogger("quantlab")

REAL_ON_CPU = ("int4", "int8", "int8-dyn")  # quantlab's own CPU kernels; fp8 stores codes, emulates the GEMM


def support(cfg: AsIsScheme, hw: Hardware) -> Support:
    if not cfg.family:
        return Support("unsupported", "as-is: the model is not a checkpoint quantized elsewhere")
    if cfg.family == "gguf":
        if hw.device == "cpu":
            return Support("emulated", f"GGUF {cfg.label} tensors dequantized per type by gguf-py (llama.cpp's "
                                       "kernels: target=llamacpp)")
        return Support("unsupported", f"a GGUF artifact on {hw.device}: runs on target=cpu (dequantized) or "
                                      "target=llamacpp (the file itself)")
    if hw.device != "cpu":
        return Support("unsupported", f"a {cfg.family} artifact as-is on {hw.device}: built for target=cpu")
    if cfg.kernel == "bnb4":
        bnb = bnb4.support(None, hw)
        return bnb if bnb.status != "real" else Support("real", f"{cfg.label}: bitsandbytes' own 4-bit kernels")
    if cfg.kernel in REAL_ON_CPU:
        return Support("real", f"{cfg.label}: the checkpoint's integers on quantlab's {cfg.kernel} kernel")
    return Support("emulated", f"{cfg.label}: weights as the {cfg.family} checkpoint dequantizes, GEMM emulated")


def apply(model: torch.nn.Module, cfg: AsIsScheme, ctx: ApplyContext) -> Applied:
    if cfg.family == "gguf":
        path = Path(model.quantlab_gguf)
        return Applied(backend="gguf-py dequantized (float32)", emulated=True, metrics=model_files.gguf_size(str(path)),
                       tags={"artifact": cfg.label, "artifact.file": path.name,
                             point.GGUF_TYPES_TAG: model_files.gguf_type_mix_text(str(path))})
    folder = Path(model.quantlab_artifact)
    dtype = getattr(torch, cfg.compute_dtype)
    tags = {"artifact": cfg.label, "artifact.file": folder.name}
    metrics = model_files.safetensors_size(folder)
    if cfg.kernel == "dequantized":
        return Applied(backend=f"{cfg.family} dequantized ({cfg.compute_dtype})", emulated=True, tags=tags,
                       metrics=metrics)
    if cfg.family in ("gptq", "awq"):
        return _gptq_awq(model, cfg, folder, dtype, tags, metrics)
    if cfg.family == "bitsandbytes":
        return _bitsandbytes(model, dtype, tags, metrics)
    tensors = model_files.Tensors(folder)
    groups = _groups(folder)
    n = 0
    for name, lin in list(model.named_modules()):
        if not isinstance(lin, torch.nn.Linear) or not tensors.has(f"{name}.weight_scale"):
            continue
        args = _args_of(name, lin, groups)
        layers.replace(model, name, _module(name, lin, cfg.kernel, args, tensors, dtype))
        n += 1
    layers.cast_parameters(model, dtype)
    log.info("as-is: %d layers rebuilt from %s (%s)", n, folder, cfg.label)
    backend = {"int4": "aten._weight_int4pack_mm_for_cpu", "int8": "aten._weight_int8pack_mm",
               "int8-dyn": "torch._int_mm (int8 x int8)", "fp8": "fp8 storage, emulated GEMM",
               "fp8-dyn": "fp8 storage, emulated GEMM"}[cfg.kernel]
    if cfg.kernel in ("int4", "int8"):
        tags.update(prefill_tags(dtype))
    return Applied(backend=backend, emulated=cfg.kernel not in REAL_ON_CPU, tags=tags, metrics=metrics)


def _gptq_awq(model: torch.nn.Module, cfg: AsIsScheme, folder: Path, dtype: torch.dtype, tags: dict,
              metrics: dict) -> Applied:
    """Each packed Linear of a GPTQ/AWQ checkpoint rebuilt on quantlab's int4
    kernel from its integers (``w = (q - 8) s + (8 - zero) s``); a GPTQ layer
    in activation order whose groups are not contiguous keeps its
    dequantized weight, and the point is then tagged emulated (it counts
    them: ``artifact.dequantized_layers``)."""
    lay, _ = artifacts.gptq_awq_layout(model_files.quantization_config(folder))
    tensors = model_files.Tensors(folder)
    modules = dict(model.named_modules())
    names = gptq_awq.quantized_names(tensors)
    kept = []
    for name in names:
        lin = modules[name]
        p = gptq_awq.read(lay, tensors, name, lin.out_features, lin.in_features)
        if p.contiguous_groups() != lay.group_size:
            kept.append(name)
            continue
        zero = p.zero.float()
        layers.replace(model, name, Int4Linear(p.q.int(), p.scale, (8 - zero) * p.scale, lay.group_size, lin.bias,
                                               dtype))
    layers.cast_parameters(model, dtype)
    log.info("as-is: %d %s layers on the int4 kernel, %d dequantized (activation order)",
             len(names) - len(kept), cfg.family, len(kept))
    tags = {**tags, **prefill_tags(dtype), "artifact.dequantized_layers": str(len(kept))}
    return Applied(backend="aten._weight_int4pack_mm_for_cpu" + (f" ({len(kept)} layers dequantized)" if kept else ""),
                   emulated=bool(kept), tags=tags, metrics=metrics)


def _bitsandbytes(model: torch.nn.Module, dtype: torch.dtype, tags: dict, metrics: dict) -> Applied:
    """A bitsandbytes checkpoint arrives as bitsandbytes' own Linear4bit
    modules (transformers loads them); they compute in ``dtype``."""
    import bitsandbytes as bnb

    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not quantized:
        raise ValueError("as-is: the bitsandbytes checkpoint loaded without a 4-bit layer")
    for m in quantized:
        m.compute_dtype = dtype
    layers.cast_parameters_except(model, dtype, bnb.nn.Params4bit)
    log.info("as-is: %d bitsandbytes 4-bit layers", len(quantized))
    return Applied(backend=f"bitsandbytes-{bnb.__version__}", emulated=False, tags=tags, metrics=metrics)


def _module(name: str, lin: torch.nn.Linear, kernel: str, args, tensors: model_files.Tensors, dtype: torch.dtype):
    """quantlab's module for Linear ``name`` from the checkpoint's tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scale = tensors.get(f"{name}.weight_scale").float()
    n, k = lin.out_features, lin.in_features
    if kernel == "int4":
        g = args.group_size
        if k % g:
            raise ValueError(f"as-is: {name} has {k} inputs, not a multiple of its groups of {g}")
        q = unpack_from_int32(tensors.get(f"{name}.weight_packed"), 4, torch.Size((n, k))).int() + 8  # 0..15
        zp = torch.full_like(scale, 8.0)
        if tensors.has(f"{name}.weight_zero_point"):  # asymmetric: packed along the output dim, -8..7
            zp = unpack_from_int32(tensors.get(f"{name}.weight_zero_point"), 4, torch.Size(scale.shape),
                                   packed_dim=0).float() + 8
        return Int4Linear(q, scale, (8 - zp) * scale, g, lin.bias, dtype)  # tinygemm: w = (q - 8) s + zero
    if kernel == "int8":
        q = unpack_from_int32(tensors.get(f"{name}.weight_packed"), 8, torch.Size((n, k))).to(torch.int8)
        return Int8Linear(q, scale.reshape(n), lin.bias, dtype)
    if kernel == "int8-dyn":
        return Int8DynLinear(tensors.get(f"{name}.weight").to(torch.int8), scale.reshape(n), lin.bias, dtype)
    codes = tensors.get(f"{name}.weight")  # fp8 / fp8-dyn
    return FP8Linear.from_codes(codes, scale.reshape(-1).expand(n), lin.bias, dtype, kernel == "fp8-dyn")


def _groups(folder: Path) -> list[tuple[list[str], list[str], object]]:
    """``(targets, ignore, weight QuantizationArgs)`` of each config group."""
    from compressed_tensors.quantization import QuantizationConfig

    q = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    return [(g.targets, q.ignore or [], g.weights) for g in q.config_groups.values()]


def _args_of(name: str, module: torch.nn.Module, groups):
    from compressed_tensors.utils.match import is_match

    for targets, ignore, args in groups:
        if is_match(name, module, targets, ignore):
            return args
    raise ValueError(f"as-is: {name} has quantized tensors in the checkpoint but no config group names it")


def gguf(cfg: AsIsScheme) -> Mapping:
    """A GGUF artifact is its own llama.cpp file (``as_is``); nothing else is."""
    if cfg.family != "gguf":
        return Mapping(reason=f"as-is {cfg.label or ''}: a {cfg.family} checkpoint runs on target=cpu "
                              "(llama.cpp would run a conversion, not the artifact)")
    return Mapping({"type": cfg.label, "as_is": True})


def checkpoint(cfg: AsIsScheme) -> Mapping:
    return Mapping(reason="an as-is point's artifact is the checkpoint in its model.path: ship that file or folder")


register_weights("asis", AsIsScheme, support, apply, gguf=gguf, checkpoint=checkpoint)
