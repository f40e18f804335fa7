"""The work of an export (``python -m quantlab.export`` is its command line):
rebuild a sweep point from its run's logged ``config.yaml`` (same quantizer,
same integers), write it (:mod:`~quantlab.export.checkpoint`,
:mod:`~quantlab.export.gguf`), check it (:mod:`~quantlab.export.roundtrip`),
rename it into place only when the round trip passes, log the outcome on the
run and optionally register it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from quantlab import hardware, model_files, models, point, tracking
from quantlab.compose import config_from_dict
from quantlab.config import RunConfig
from quantlab.digest import sha256_file
from quantlab.divergence import kl_per_token
from quantlab.errors import UserError
from quantlab.export import checkpoint, formats, roundtrip
from quantlab.export import state as quantized_state
from quantlab.schemes import layers, registry
from quantlab.schemes.qlinear import QUANTIZED, dequantized

log = logging.getLogger("quantlab")


def rebuild(cfg: RunConfig, model: torch.nn.Module, tok, kv: bool = True,
            state: str | None = None) -> tuple[torch.nn.Module, dict, bool]:
    """The point's quantized model, what its KV scheme writes into a
    checkpoint (calibrated scales, measured on the quantized model as the
    sweep did; ``{}`` for a runtime-only cache, or with ``kv=False``: a format
    that holds no KV scales), and whether the model is the kept one. ``state``: the sha256 of the quantized model the
    point kept when it was measured (:mod:`~quantlab.export.state`): that model,
    when the cache still holds it unchanged; else ``model`` (the point's float
    model, loaded by the caller) quantized in place exactly as the sweep did,
    on CPU: same quantizer, same integers (calibration runs again)."""
    ctx = registry.ApplyContext(hw=hardware.cpu(), tokenizer=tok, cache_dir=cfg.cache_dir,
                                data_dir=cfg.data_dir, seed=cfg.seed)
    w, cache = cfg.scheme.weights, cfg.scheme.kv
    kept, why = quantized_state.load(cfg.cache_dir, state) if state else (None, "the point kept no quantized state")
    if kept is not None:
        log.info("export: the point's own quantized tensors (sha256 %s...), as measured", state[:12])
        model = kept
    else:
        if w.calibration_set() is not None:
            log.info("export: %s; quantizing again (calibration included)", why)
        registry.weights_handler(w).apply(model, w, ctx)
    model.eval()
    return model, registry.kv_handler(cache).apply(model, cache, ctx).checkpoint if kv else {}, kept is not None


def dense_twins(model: torch.nn.Module, float_model: torch.nn.Module, dtype: torch.dtype):
    """``(float model, dense model holding the point's dequantized weights)``,
    both copies of ``float_model`` in ``dtype`` (the checkpoint's): what a
    faithful reload must equal, and what a reload that lost the quantization
    would equal instead."""
    float_twin, dense = copy.deepcopy(float_model), copy.deepcopy(float_model)
    state = {k: v.float() for k, v in model.state_dict().items() if k in dense.state_dict()}
    dense.load_state_dict(state, strict=False)  # non-quantized parameters as the point holds them
    for name, mod in model.named_modules():
        if isinstance(mod, QUANTIZED):
            dense.get_submodule(name).weight.data = dequantized(mod).contiguous()
    for m in (float_twin, dense):  # as transformers reloads the checkpoint: parameters in dtype (RoPE's
        layers.cast_parameters(m, dtype)  # inv_freq stays fp32) and config.dtype too (masks, kernels follow it)
        m.config.dtype = dtype
    return float_twin.eval(), dense.eval()


def export_run(source: tracking.Run, out: Path, force: bool = False, register: str | None = None,
               tolerance: float | None = None) -> dict:
    """Rebuild, write, verify, rename into place, log and (optionally) register.
    The model is loaded once: the point, the compressor's fp32 copy and the
    two dense twins of the round trip are copies of that one load."""
    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to replace it")
    run_id, run = source.id, source.get()
    cfg = run_config(source)
    spec = formats.mapping("checkpoint", cfg.scheme.weights)  # refuse a scheme without a format before rebuilding
    log.info("export: %s from run %s", run.info.run_name, run_id)
    float_model, tok = models.load(cfg.model, cfg.cache_dir)
    state = run.data.tags.get(quantized_state.TAG)
    model, kv, model_from_state = rebuild(cfg, copy.deepcopy(float_model), tok, state=state)
    if kv:
        log.info("export: %s's calibrated k_scale/v_scale go into the checkpoint (kv_cache_scheme, %d tensors)",
                 cfg.scheme.kv.short_name(), len(kv["tensors"]))
    elif cfg.scheme.kv.short_name():
        log.info("export: %s is a KV-cache setting of the runtime, not part of a checkpoint: the export holds "
                 "the weights; quantlab.json records it (kv_scheme)", cfg.scheme.kv.short_name())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        fmt = checkpoint.write(model, tok, spec, copy.deepcopy(float_model), tmp, kv)
        ids = roundtrip.check_input(tok)
        float_twin, dense = dense_twins(model, float_model, getattr(torch, spec["dtype"]))
        del float_model
        # W8A8 quantizes activations at run time, in the point and in the reload alike, not in a dense twin;
        # else logits and greedy text from the dense twin: the reload's arithmetic (the packed kernels' own
        # greedy text can differ at a near-tie: SmolLM2 int4-g64, tinygemm against bf16 matmuls)
        logits, greedy = roundtrip.logits_and_greedy(model if "input_activations" in spec else dense, ids)
        float_logits = roundtrip.logits_and_greedy(float_twin, ids)[0]
        point_from_float = float(kl_per_token(float_logits, logits).mean())
        del float_twin, dense
        with tempfile.TemporaryDirectory() as ref_dir:
            ref_file = Path(ref_dir) / "reference.safetensors"
            save_file({"ids": ids, "logits": logits.contiguous(), "greedy": greedy,
                       "float_logits": float_logits.contiguous()}, ref_file)
            load = checkpoint.transformers_load(spec)  # in the checkpoint's config: a plain reload reads it
            check = roundtrip.verify_in_fresh_process(tmp, ref_file)
        check.update(roundtrip.round_trip_verdict(check, point_from_float, tolerance))
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"source_run_id": run_id, "run_name": run.info.run_name, "format": fmt,
                    "scheme": cfg.scheme.weights.to_dict(), "kv_scheme": cfg.scheme.kv.to_dict(),
                    "model": dataclasses.asdict(cfg.model),
                    "metrics": run.data.metrics, "versions": tracking.versions(
                        ("torch", "transformers", "compressed-tensors", "torchao", "quantlab")),
                    "round_trip": check, "transformers_load": load, "files_sha256": files,
                    "quantized_state_sha256": state if model_from_state else None,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / "quantlab.json").write_text(json.dumps(manifest, indent=2, default=str))
        tags = {"export.format": fmt, "export.round_trip": "passed" if check["passed"] else "failed",
                "export.kl_mean": f"{check['kl_mean']:.3e}", "export.greedy_match": str(check["greedy_match"])}
        source.set_tags(tags)
        if not check["passed"]:
            raise UserError(f"round trip failed: {check['why']}; nothing written to {out}")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if register:  # the registry's version points at a copy in the run's artifacts
        log.info("export: copying %s into run %s's artifacts (export/) for the registry", out, run_id)
        source.log_files(out, under="export")
        _register(source.tracker, register, run, fmt)
    log.info("export: %s written (%s), round trip KL %.2e, greedy text %s", out, fmt, check["kl_mean"],
             "identical" if check["greedy_match"] else "DIFFERENT")
    return manifest


def run_config(run: tracking.Run) -> RunConfig:
    """The point's config as its run logged it."""
    with tempfile.TemporaryDirectory() as d:
        path = run.tracker.download(run.id, "config.yaml", Path(d))
        if path is None:
            raise UserError(f"run {run.id} logged no config.yaml: not a quantlab point")
        text = path.read_text()
    try:
        return config_from_dict(yaml.safe_load(text))
    except ValueError as e:
        raise UserError(f"run {run.id}: {e}") from None


def export_gguf(source: tracking.Run, out: Path, force: bool = False) -> dict:
    """The point as one GGUF file (its own integers; see :mod:`quantlab.export.gguf`),
    kept only when llama.cpp reproduces the point (:func:`roundtrip.gguf_check`);
    a ``<out>.quantlab.json`` manifest beside it."""
    from quantlab.engines.llamacpp import LlamaCppEngine
    from quantlab.export import gguf

    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to replace it")
    run_id = source.id
    cfg = run_config(source)
    w = cfg.scheme.weights
    spec = formats.mapping("gguf", w)
    if spec.get("quantize"):
        return _ship_made_gguf(source, cfg, spec["type"], out)
    gguf_type = spec["type"]
    log.info("export: rebuilding %s from run %s for GGUF (%s)", w.short_name(), run_id, gguf_type)
    model, tok = models.load(cfg.model, cfg.cache_dir)
    state = source.get().data.tags.get(quantized_state.TAG)
    model, _, _ = rebuild(cfg, model, tok, kv=False, state=state)  # GGUF: llama.cpp scales its cache itself
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        counts = gguf.write(model, tok, tmp, getattr(model, "quantlab_gguf", None), name=w.short_name())
        ids = roundtrip.check_input(tok)
        engine = LlamaCppEngine(tmp, "F16", model.config.vocab_size, n_ctx=max(64, ids.shape[1] + 8))
        try:
            check = roundtrip.gguf_check(tmp, engine, model, ids, gguf_type)
        finally:
            engine.close()
        source.set_tags({"export.gguf.round_trip": "passed" if check["passed"] else "failed",
                         "export.gguf.kl_mean": f"{check['kl_mean']:.3e}"})
        if not check["passed"]:
            raise UserError(f"GGUF round trip failed: KL {check['kl_mean']:.3e} (tolerance "
                            f"{check['tolerance_kl_mean']:g}), tensor types {check['tensor_types']} "
                            f"(expected {check['expected_type']}); nothing written to {out}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = {"source_run_id": run_id, "format": formats.format_name("gguf", {"type": gguf_type}), "tensor_types": counts,
                "scheme": w.to_dict(), "round_trip": check, "sha256": sha256_file(out),
                "versions": tracking.versions(("torch", "transformers", "gguf", "llama_cpp_python", "quantlab"))}
    out.with_name(out.name + ".quantlab.json").write_text(json.dumps(manifest, indent=2, default=str))
    log.info("export: %s written (%s), llama.cpp round trip KL %.2e, top-1 %.3f", out,
             ", ".join(f"{v} {k}" for k, v in counts.items()), check["kl_mean"], check["top1_agree"])
    return manifest


def _ship_made_gguf(source: tracking.Run, cfg: RunConfig, gguf_type: str, out: Path) -> dict:
    """A point llama.cpp's quantizer made (``gguf-*``): the file it measured,
    copied from ``target.gguf_cache`` once its sha256 equals the run's; one
    line when the cache no longer holds it (llama.cpp made it, not quantlab's
    integers: there is nothing to rebuild it from here but the point)."""
    from quantlab.export import gguf

    tags = source.get().data.tags
    name, digest = tags.get(gguf.MADE_FILE_TAG), tags.get(gguf.MADE_SHA_TAG)
    kept = Path(cfg.target.gguf_cache).expanduser() / name if name else None
    if kept is None or not kept.is_file() or sha256_file(kept) != digest:
        raise UserError(f"the {gguf_type} file run {source.id} measured is no longer in {cfg.target.gguf_cache} "
                        "(or no longer hashes to the run's gguf.sha256): run the point again with force=true "
                        "to have llama.cpp make it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(kept, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = {"source_run_id": source.id, "format": formats.format_name("gguf", {"type": gguf_type}),
                "tensor_types": model_files.gguf_type_mix(str(out)), "scheme": cfg.scheme.weights.to_dict(), "sha256": digest,
                "measured_file": True, "versions": tracking.versions(("gguf", "llama_cpp_python", "quantlab"))}
    out.with_name(out.name + ".quantlab.json").write_text(json.dumps(manifest, indent=2, default=str))
    log.info("export: %s is the file run %s measured (%s, sha256 %s...)", out, source.id, gguf_type, digest[:12])
    return manifest


def _register(tracker: tracking.Tracker, name: str, run, fmt: str) -> None:
    keys = ("fid/kl_mean", "lat/tpot_ms_p50", "size/weight_mb", "size/bits_per_weight")
    tags = {k: f"{run.data.metrics[k]:.4g}" for k in keys if k in run.data.metrics}
    tags.update({"format": fmt, "scheme": run.data.tags.get(point.SCHEME_TAG, "?")})
    tracker.register(name, f"{run.info.artifact_uri}/export", run.info.run_id, tags)
