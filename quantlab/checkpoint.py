"""The work of an export (``python -m quantlab.export`` is its command line):
a sweep point as a checkpoint that transformers (and vLLM) load, or a GGUF file.

The point is rebuilt from the run's logged ``config.yaml`` (same quantizer,
same integers), then written as:

* float schemes: plain safetensors in the scheme's dtype;
* int8 / int4 RTN / GPTQ / FP8: compressed-tensors (the format vLLM loads,
  and transformers decompresses on load): int8 per channel as
  ``int-quantized``, int4 packed eight to an int32 as ``pack-quantized``
  (asymmetric groups as ``block [1, g]`` with int8 zero points, see
  ``schemes.int4.checkpoint``), FP8 as ``float-quantized``.

Then a fresh process reloads the directory (safetensors only, no remote code)
and compares its logits and greedy text with the in-memory point; the export is
renamed into place only when that round trip is within tolerance.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from quantlab import export, hardware, models, tracking
from quantlab.config import RunConfig, TrackingConfig, register_configs
from quantlab.digest import sha256_file
from quantlab.errors import UserError
from quantlab.probes import corpus
from quantlab.schemes import layers, registry
from quantlab.schemes.qlinear import FP8Linear, Int4Linear, Int8DynLinear, Int8Linear

log = logging.getLogger("quantlab")

# The round trip compares the reload with a dense model holding the point's own
# dequantized weights in the checkpoint's dtype (same arithmetic as the reload):
# mean KL over the check tokens must be at most KL_TOLERANCE. (Against the
# packed-kernel point itself the kernels alone differ by ~1.7e-3 on SmolLM2's
# int8, about as much as int8 quantization costs, so that could not tell a
# reload that lost its quantization.) And the reload must stay as far from the
# float model as the point is: KL(float || reload) >= QUANTIZED_SHARE x
# KL(float || dense point).
# The second check applies once the point is measurably away from float
# (FLOAT_NOISE: a faithful reload of the tiny test model differs from its dense
# twin by ~2e-7, bf16 run to run).
KL_TOLERANCE = 1e-4
QUANTIZED_SHARE = 0.5
FLOAT_NOISE = 1e-6
CHECK_TOKENS = 64
GREEDY_TOKENS = 16


def config_from_dict(d: dict) -> RunConfig:
    """Inverse of ``pipeline.config_dict``: polymorphic slots by their type name."""
    from quantlab.config import (CPUTargetConfig, CUDATargetConfig, ModelConfig, NeuronTargetConfig,
                                 ProbeConfig, SchemeConfig)

    register_configs()
    types = {t.__name__: t for t in (*registry.weight_schemas().values(), *registry.kv_schemas().values(),
                                     CPUTargetConfig, CUDATargetConfig, NeuronTargetConfig)}

    def poly(node: dict):
        node = dict(node)
        return types[node.pop("type")](**node)

    def typed(cls, node: dict):
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))

    rest = {k: v for k, v in d.items() if k not in ("model", "scheme", "target", "probe", "tracking")}
    return RunConfig(model=typed(ModelConfig, d["model"]),
                     scheme=SchemeConfig(weights=poly(d["scheme"]["weights"]), kv=poly(d["scheme"]["kv"])),
                     target=poly(d["target"]), probe=typed(ProbeConfig, d["probe"]),
                     tracking=typed(TrackingConfig, d["tracking"]), **rest)


def rebuild(cfg: RunConfig):
    """The point's model on CPU, quantized exactly as the sweep did."""
    model, tok = models.load(cfg.model, cfg.cache_dir)
    ctx = registry.ApplyContext(hw=hardware.cpu(), tokenizer=tok, cache_dir=cfg.cache_dir,
                                data_dir=cfg.data_dir, seed=cfg.seed)
    w = cfg.scheme.weights
    registry.weights_handler(w).apply(model, w, ctx)
    return model.eval(), tok


QUANTIZED = (Int4Linear, Int8Linear, Int8DynLinear, FP8Linear)  # the modules a checkpoint stores quantized


def _ct_config(model, spec: dict):
    """compressed-tensors QuantizationConfig (the scheme's ``checkpoint`` mapping)
    over the quantized modules of ``model``. A ``mixed-precision`` mapping
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


def exportable_tags(w) -> dict[str, str]:
    """``exportable.<format>`` tags for a point of weight scheme ``w``: what
    ``quantlab.export`` will write, or ``no: <why>`` (so the command line can
    refuse before loading anything)."""
    tags = {}
    for fmt in export.FORMATS:
        m = registry.weights_handler(w).mapping(fmt, w)
        if not m.ok:
            tags[export.exportable_tag(fmt)] = f"no: {m.reason}"
        elif fmt == "gguf":
            tags[export.exportable_tag(fmt)] = f"gguf/{m.spec['type']}"
        else:
            fmt_name = f"hf-{m.spec['dtype']}" if m.spec["format"] == "hf" else f"compressed-tensors/{m.spec['format']}"
            tags[export.exportable_tag(fmt)] = fmt_name
    return tags


def checkpoint_mapping(w) -> dict:
    """The scheme's checkpoint format, or one line saying it has none."""
    m = registry.weights_handler(w).mapping("checkpoint", w)
    if not m.ok:
        raise UserError(f"checkpoint export of {w.short_name()} is not supported ({m.reason})")
    return m.spec


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


def dense_twins(model, cfg: RunConfig, dtype: torch.dtype):
    """``(float model, dense model holding the point's dequantized weights)``,
    both in ``dtype`` (the checkpoint's): what a faithful reload must equal,
    and what a reload that lost the quantization would equal instead."""
    float_model, _ = models.load(cfg.model, cfg.cache_dir)
    dense, _ = models.load(cfg.model, cfg.cache_dir)
    state = {k: v.float() for k, v in model.state_dict().items() if k in dense.state_dict()}
    dense.load_state_dict(state, strict=False)  # non-quantized parameters as the point holds them
    for name, mod in model.named_modules():
        if isinstance(mod, QUANTIZED):
            dense.get_submodule(name).weight.data = dequantized(mod).contiguous()
    for m in (float_model, dense):  # as transformers reloads the checkpoint: parameters in dtype (RoPE's
        layers.cast_parameters(m, dtype)  # inv_freq stays fp32) and config.dtype too (masks, kernels follow it)
        m.config.dtype = dtype
    return float_model.eval(), dense.eval()


def write_checkpoint(model, tok, cfg: RunConfig, dest: Path) -> str:
    """Write ``model`` (a rebuilt point) to ``dest``; returns the format name."""
    w = cfg.scheme.weights
    spec = checkpoint_mapping(w)
    if spec["format"] == "hf":
        model.save_pretrained(dest, safe_serialization=True)
        tok.save_pretrained(dest)
        return f"hf-{spec['dtype']}"
    fmt = spec["format"]
    qcfg = _ct_config(model, spec)
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    dtype = getattr(torch, getattr(w, "compute_dtype", "bfloat16"))
    # Compress in fp32 so that compressed-tensors re-derives exactly our integers
    # (w = (q - zp) * s is exact in fp32, not in bf16); cast afterwards.
    dense, _ = models.load(cfg.model, cfg.cache_dir)
    dense.load_state_dict({k: v.float() for k, v in model.state_dict().items() if k in dense.state_dict()},
                          strict=False)  # non-quantized parameters exactly as the point holds them
    apply_quantization_config(dense, qcfg)
    for name, mod in model.named_modules():
        if not isinstance(mod, QUANTIZED):
            continue
        target = dense.get_submodule(name)
        if isinstance(mod, FP8Linear):
            target.weight.data = mod.dequantize().to(target.weight.dtype)
            target.weight_scale.data = mod.scale[:, None].to(target.weight_scale.dtype)
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
        if name.endswith("weight_scale"):
            p.data = p.data.to(scale_dtype)
        elif p.is_floating_point() and not name.endswith("weight_zero_point") and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
    dense.config.dtype = dtype
    dense.save_pretrained(dest, safe_serialization=True)
    compressor.update_config(str(dest))
    tok.save_pretrained(dest)
    return f"compressed-tensors/{fmt}"


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


def check_input(tok) -> torch.Tensor:
    return corpus.token_ids(tok, "builtin", CHECK_TOKENS)


@torch.inference_mode()
def logits_and_greedy(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    greedy = model.generate(ids[:, :16], max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                            do_sample=False)[0, 16:]
    return logits, greedy


def verify_in_fresh_process(dest: Path, reference: Path, trust_remote_code: bool = False) -> dict:
    """Reload ``dest`` in a new interpreter; compare with the saved reference."""
    cmd = [sys.executable, "-m", "quantlab.checkpoint", str(dest), str(reference)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"round trip: reloading {dest.name} failed: {tail}")
    return json.loads(lines[-1])


def verify_main(dest: str, reference: str, trust_remote_code: bool) -> int:
    """The fresh process of :func:`verify_in_fresh_process`: one JSON line."""
    from transformers import AutoModelForCausalLM

    ref = load_file(reference)
    model = AutoModelForCausalLM.from_pretrained(dest, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code).eval()
    logits, greedy = logits_and_greedy(model, ref["ids"])
    kl = kl_per_token(ref["logits"], logits)
    out = {"max_abs_diff": float((logits - ref["logits"]).abs().max()),
           "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
           "top1_agree": float((logits.argmax(-1) == ref["logits"].argmax(-1)).double().mean()),
           "greedy_match": bool(torch.equal(greedy, ref["greedy"]))}
    if "float_logits" in ref:
        out["kl_from_float"] = float(kl_per_token(ref["float_logits"], logits).mean())
    print(json.dumps(out))
    return 0


def kl_per_token(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    p, q = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def reload_dtype(cfg: RunConfig) -> torch.dtype:
    """The dtype the checkpoint declares (what transformers reloads it in)."""
    w = cfg.scheme.weights
    return getattr(torch, getattr(w, "compute_dtype", None) or getattr(w, "dtype", None) or "bfloat16")


def round_trip_verdict(check: dict, point_from_float: float, tolerance: float = KL_TOLERANCE) -> dict:
    """Pass when the reload equals the dense point (KL <= ``tolerance``) and is
    still as far from the float model as the point (a share of
    ``point_from_float``); ``why`` says which failed."""
    out = {"tolerance_kl_mean": tolerance, "point_kl_from_float": point_from_float}
    if check["kl_mean"] > tolerance:
        return {**out, "passed": False, "why": f"reload vs the point's dequantized weights: KL "
                f"{check['kl_mean']:.3e} > {tolerance:g} (max |diff| {check['max_abs_diff']:.3g})"}
    floor = QUANTIZED_SHARE * point_from_float
    if point_from_float > FLOAT_NOISE and check.get("kl_from_float", 0.0) < floor:
        return {**out, "passed": False, "why": f"the reload is the float model, not the point: KL from float "
                f"{check.get('kl_from_float', 0.0):.3e} < {floor:.3e} (the point's {point_from_float:.3e})"}
    return {**out, "passed": True, "why": ""}


def export_run(client, run_id: str, out: Path, force: bool = False, register: str | None = None,
               tolerance: float = KL_TOLERANCE) -> dict:
    """Rebuild, write, verify, rename into place, log and (optionally) register."""
    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to replace it")
    run = client.get_run(run_id)
    cfg = _run_config(client, run_id)
    spec = checkpoint_mapping(cfg.scheme.weights)  # refuse a scheme without a format before rebuilding it
    log.info("export: rebuilding %s from run %s", run.info.run_name, run_id)
    if cfg.scheme.kv.short_name():
        log.info("export: %s is a KV-cache setting of the runtime, not part of a checkpoint: the export holds "
                 "the weights; quantlab.json records it (kv_scheme)", cfg.scheme.kv.short_name())
    model, tok = rebuild(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        fmt = write_checkpoint(model, tok, cfg, tmp)
        ids = check_input(tok)
        point_logits, greedy = logits_and_greedy(model, ids)  # the point's own text, compared for information
        float_model, dense = dense_twins(model, cfg, reload_dtype(cfg))
        # W8A8 quantizes activations at run time, in the point and in the reload alike, not in a dense twin
        logits = point_logits if "input_activations" in spec else logits_and_greedy(dense, ids)[0]
        float_logits = logits_and_greedy(float_model, ids)[0]
        point_from_float = float(kl_per_token(float_logits, logits).mean())
        del float_model, dense
        with tempfile.TemporaryDirectory() as ref_dir:
            ref_file = Path(ref_dir) / "reference.safetensors"
            save_file({"ids": ids, "logits": logits.contiguous(), "greedy": greedy,
                       "float_logits": float_logits.contiguous()}, ref_file)
            check = verify_in_fresh_process(tmp, ref_file)
        check.update(round_trip_verdict(check, point_from_float, tolerance))
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"source_run_id": run_id, "run_name": run.info.run_name, "format": fmt,
                    "scheme": cfg.scheme.weights.to_dict(), "kv_scheme": cfg.scheme.kv.to_dict(),
                    "model": dataclasses.asdict(cfg.model),
                    "metrics": run.data.metrics, "versions": tracking.versions(
                        ("torch", "transformers", "compressed-tensors", "torchao", "quantlab")),
                    "round_trip": check, "files_sha256": files,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / "quantlab.json").write_text(json.dumps(manifest, indent=2, default=str))
        tags = {"export.format": fmt, "export.round_trip": "passed" if check["passed"] else "failed",
                "export.kl_mean": f"{check['kl_mean']:.3e}", "export.greedy_match": str(check["greedy_match"])}
        tracking.set_tags(client, run_id, tags)
        if not check["passed"]:
            raise UserError(f"round trip failed: {check['why']}; nothing written to {out}")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if register:  # the registry's version points at a copy in the run's artifacts
        log.info("export: copying %s into run %s's artifacts (export/) for the registry", out, run_id)
        client.log_artifacts(run_id, str(out), artifact_path="export")
        _register(client, register, run, fmt)
    log.info("export: %s written (%s), round trip KL %.2e, greedy text %s", out, fmt, check["kl_mean"],
             "identical" if check["greedy_match"] else "DIFFERENT")
    return manifest


def _run_config(client, run_id: str) -> RunConfig:
    with tempfile.TemporaryDirectory() as d:
        return config_from_dict(yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", d)).read_text()))


def export_gguf(client, run_id: str, out: Path, force: bool = False) -> dict:
    """The point as one GGUF file (its own integers; see ``quantlab.gguf_export``),
    kept only when llama.cpp reproduces the point (``gguf_export.round_trip``);
    a ``<out>.quantlab.json`` manifest beside it."""
    from quantlab import gguf_export

    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to replace it")
    cfg = _run_config(client, run_id)
    w = cfg.scheme.weights
    mapping = registry.weights_handler(w).mapping("gguf", w)
    if not mapping.ok:
        raise UserError(f"GGUF export of {w.short_name()}: {mapping.reason}")
    log.info("export: rebuilding %s from run %s for GGUF (%s)", w.short_name(), run_id, mapping.spec["type"])
    model, tok = rebuild(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        counts = gguf_export.write(model, tok, tmp, getattr(model, "quantlab_gguf", None), name=w.short_name())
        check = gguf_export.round_trip(tmp, model, check_input(tok), mapping.spec["type"])
        tracking.set_tags(client, run_id, {"export.gguf.round_trip": "passed" if check["passed"] else "failed",
                                           "export.gguf.kl_mean": f"{check['kl_mean']:.3e}"})
        if not check["passed"]:
            raise UserError(f"GGUF round trip failed: KL {check['kl_mean']:.3e} (tolerance "
                            f"{check['tolerance_kl_mean']:g}), tensor types {check['tensor_types']} "
                            f"(expected {check['expected_type']}); nothing written to {out}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = {"source_run_id": run_id, "format": f"gguf/{mapping.spec['type']}", "tensor_types": counts,
                "scheme": w.to_dict(), "round_trip": check, "sha256": sha256_file(out),
                "versions": tracking.versions(("torch", "transformers", "gguf", "llama_cpp_python", "quantlab"))}
    out.with_name(out.name + ".quantlab.json").write_text(json.dumps(manifest, indent=2, default=str))
    log.info("export: %s written (%s), llama.cpp round trip KL %.2e, top-1 %.3f", out,
             ", ".join(f"{v} {k}" for k, v in counts.items()), check["kl_mean"], check["top1_agree"])
    return manifest


def _register(client, name: str, run, fmt: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
            raise
    keys = ("fid/kl_mean", "lat/tpot_ms_p50", "size/weight_mb", "size/bits_per_weight")
    tags = {k: f"{run.data.metrics[k]:.4g}" for k in keys if k in run.data.metrics}
    tags.update({"format": fmt, "scheme": run.data.tags.get("scheme", "?")})
    source = f"{run.info.artifact_uri}/export"
    client.create_model_version(name, source, run_id=run.info.run_id, tags=tags)


if __name__ == "__main__":  # the round trip's fresh process: DEST REFERENCE [--trust-remote-code]
    raise SystemExit(verify_main(sys.argv[1], sys.argv[2], "--trust-remote-code" in sys.argv[3:]))
