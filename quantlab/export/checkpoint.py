"""The compressed-tensors (or plain safetensors) writer: a rebuilt point as a
checkpoint directory that transformers and vLLM load.

* float schemes: plain safetensors in the scheme's dtype;
* int8 / int4 RTN / GPTQ / AWQ / FP8 / W8A8 / mixed: compressed-tensors:
  weight-only int8 per channel packed four to an int32 as ``pack-quantized``
  (W8A16, the layout vLLM reads), W8A8 as ``int-quantized`` with dynamic
  per-token int8 input activations, int4 packed eight to an int32 as ``pack-quantized``
  (asymmetric groups with their zero points packed too; a mixed recipe's as
  ``block [1, g]`` with int8 zero points: see ``schemes.int4.checkpoint``),
  FP8 as ``float-quantized``, mixed recipes as
  one config group per candidate (``mixed-precision`` where their formats differ).

The integers written are the point's own (compressed-tensors re-derives them
exactly from the fp32 dequantized weights and the point's scales).
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from quantlab.errors import UserError
from quantlab.export.formats import format_name, groups
from quantlab.schemes.fplinear import FormatLinear
from quantlab.schemes.qlinear import QUANTIZED, FP8Linear, dequantized

log = logging.getLogger("quantlab")


def _ct_config(model, spec: dict):
    """compressed-tensors QuantizationConfig (the scheme's ``checkpoint`` mapping)
    over the quantized modules of ``model``. A mixed mapping
    (``candidates``, ``layers``, ``default``) gives one config group per
    candidate, each with its own format; every other mapping one group."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    def scheme(one: dict, targets: list[str], own_format: bool):
        acts = one.get("input_activations")
        return QuantizationScheme(targets=targets, weights=QuantizationArgs(**one["args"]),
                                  input_activations=QuantizationArgs(**acts) if acts else None,
                                  format=one["format"] if own_format else None)

    names = sorted({n for n, m in model.named_modules() if isinstance(m, QUANTIZED)})
    if "candidates" not in spec:
        return QuantizationConfig(config_groups={"group_0": scheme(spec, names, False)}, format=spec["format"],
                                  quantization_status="frozen")
    by_candidate: dict[str, list[str]] = {}
    for n in names:
        by_candidate.setdefault(spec["layers"].get(n, spec["default"]), []).append(n)
    groups = {f"group_{i}": scheme(spec["candidates"][c], targets, True)
              for i, (c, targets) in enumerate(sorted(by_candidate.items()))}
    return QuantizationConfig(config_groups=groups, format=spec["format"], quantization_status="frozen")


def write(model, tok, spec: dict, dense, dest: Path, kv: dict | None = None) -> str:
    """Write ``model`` (a rebuilt point) to ``dest`` as the scheme's checkpoint
    mapping ``spec`` says; returns the format name. ``dense``: a float (fp32)
    copy of the point's model before quantization, consumed here (the
    compressor fills and packs it). ``kv``: the KV scheme's
    ``Applied.checkpoint`` (calibrated scales), written beside the weights
    (:func:`write_kv_scales`)."""
    if spec["format"] == "hf":
        model.save_pretrained(dest, safe_serialization=True)
        tok.save_pretrained(dest)
        if kv:
            write_kv_scales(dest, kv)
        return format_name("checkpoint", spec)
    fmt = spec["format"]
    _check_activation_groups(model, spec)
    qcfg = _ct_config(model, spec)
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    dtype = getattr(torch, spec["dtype"])
    # Compress in fp32 so that compressed-tensors re-derives exactly our integers
    # (w = (q - zp) * s is exact in fp32, not in bf16); cast afterwards.
    dense.load_state_dict({k: v.float() for k, v in model.state_dict().items() if k in dense.state_dict()},
                          strict=False)  # non-quantized parameters exactly as the point holds them
    apply_quantization_config(dense, qcfg)
    for name, mod in model.named_modules():
        if not isinstance(mod, QUANTIZED):
            continue
        target = dense.get_submodule(name)
        if isinstance(mod, (FP8Linear, FormatLinear)):  # float formats: their own parameters, packed by the compressor
            for pname, value in mod.checkpoint_tensors().items():
                getattr(target, pname).data = value.to(getattr(target, pname).dtype)
            continue
        q, scale, zp = mod.int_weights()
        target.weight.data = dequantized(mod).to(target.weight.dtype)
        target.weight_scale.data = scale.to(target.weight_scale.dtype)
        if zp is not None and hasattr(target, "weight_zero_point"):
            target.weight_zero_point.data = (zp - 8).to(target.weight_zero_point.dtype)  # ct int4: -8..7
    mixed = "candidates" in spec  # each module's format is its group's, not one for the model
    with _one_line_format_warnings(fmt):
        compressor = ModelCompressor.from_pretrained_model(dense, quantization_format=None if mixed else fmt)
        compressor.compress_model(dense)
    scale_dtype = getattr(torch, (spec.get("args") or spec).get("scale_dtype", "float32"))  # exact: see mapping
    for name, p in dense.named_parameters():
        if name.endswith("global_scale"):  # NVFP4's per-tensor scales stay fp32, as the format defines them
            continue
        if name.endswith("weight_scale"):
            p.data = p.data.to(scale_dtype)
        elif p.is_floating_point() and not name.endswith("weight_zero_point") and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
    dense.config.dtype = dtype
    dense.save_pretrained(dest, safe_serialization=True)
    compressor.update_config(str(dest))
    if load := transformers_load(spec):  # plain from_pretrained(dest) reads it; vLLM ignores the key
        config = json.loads((dest / "config.json").read_text())
        config["quantization_config"].update(load["quantization_config"])
        (dest / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(dest)
    if kv:
        write_kv_scales(dest, kv)
    return format_name("checkpoint", spec)


def _check_activation_groups(model, spec: dict) -> None:
    """Refuse, in one line, a checkpoint whose dynamic activation groups do not
    divide a quantized layer's input width: compressed-tensors (transformers'
    reload) cannot split such an input into its groups, and vLLM's block
    kernels refuse the layer. The point itself measures fine (the emulation
    scales a last partial group on its own)."""
    for g in groups(spec):
        acts = g.get("input_activations") or {}
        size = acts.get("group_size")
        if acts.get("strategy") not in ("group", "tensor_group") or not size:
            continue
        bad = sorted({m.in_features for m in model.modules() if isinstance(m, QUANTIZED) and m.in_features % size})
        if bad:
            raise UserError(f"checkpoint export: activation groups of {size} do not divide the input widths {bad} of "
                            f"this model's layers (transformers and vLLM split each input into whole groups); "
                            f"export a scheme whose group divides them (fp8-block64) or its weight-only form")


def write_kv_scales(dest: Path, kv: dict) -> None:
    """Add calibrated KV scales to the checkpoint in ``dest``: the tensors into
    its safetensors (a sharded checkpoint gets ``kv_scales.safetensors`` and
    index entries) and ``kv_cache_scheme`` into its ``quantization_config``
    (a float checkpoint gets a compressed-tensors config with no weight groups,
    which is how llm-compressor writes a KV-only recipe). vLLM loads the scales
    onto its attention layers; transformers reloads the weights and reports
    the scales as unexpected keys, which it ignores."""
    from safetensors.torch import load_file, save_file

    index = dest / "model.safetensors.index.json"
    if index.exists():
        save_file(kv["tensors"], dest / "kv_scales.safetensors", metadata={"format": "pt"})
        mapping = json.loads(index.read_text())
        mapping["weight_map"].update({name: "kv_scales.safetensors" for name in kv["tensors"]})
        index.write_text(json.dumps(mapping, indent=2))
    else:
        single = dest / "model.safetensors"
        save_file({**load_file(single), **kv["tensors"]}, single, metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    qcfg = config.setdefault("quantization_config", {"quant_method": "compressed-tensors", "format": "dense",
                                                      "config_groups": {}, "quantization_status": "frozen"})
    qcfg["kv_cache_scheme"] = kv["kv_cache_scheme"]
    (dest / "config.json").write_text(json.dumps(config, indent=2))


def transformers_load(spec: dict) -> dict:
    """What transformers needs to reload a checkpoint of mapping ``spec``
    beyond its weights: ``CompressedTensorsConfig`` keywords, which
    :func:`write` puts in the checkpoint's own ``quantization_config`` so
    that a plain ``from_pretrained(path)`` reads it, and why (``{}``: none).
    Asymmetric ``pack-quantized`` ``group`` groups need ``dequantize=True``
    with transformers 5.24 / compressed-tensors 0.20.1 (the compressed path
    initialises their packed zero points unpacked and the load fails on the
    shape; transformers decompresses compressed-tensors int4 before its
    first forward either way); vLLM reads them packed as written and ignores
    the key."""
    if any(g["format"] == "pack-quantized" and not g["args"]["symmetric"] and g["args"]["strategy"] == "group"
           for g in groups(spec)):
        return {"quantization_config": {"dequantize": True},
                "why": "asymmetric pack-quantized zero points: transformers' compressed path initialises them "
                       "unpacked (shape mismatch); dequantize=True decompresses them with compressed-tensors"}
    return {}


@contextlib.contextmanager
def _one_line_format_warnings(fmt: str):
    """compressed-tensors warns (loguru) per module when the format we choose
    is not the one it infers (asymmetric int4 as ``block`` groups, see
    ``schemes.int4.checkpoint``): one line instead of hundreds."""
    from loguru import logger as loguru_logger

    loguru_logger.disable("compressed_tensors")
    try:
        yield
    finally:
        loguru_logger.enable("compressed_tensors")
    log.info("export: compressed-tensors' format warnings silenced (%s chosen on purpose)", fmt)
