"""llama.cpp as a target, through llama-cpp-python: the CPU runtime small
quantized LMs are deployed with (ollama and LM Studio load the same GGUF files).

Per point: quantlab quantizes as on the CPU target (its own integers), writes
them into llama.cpp block types (:mod:`quantlab.export.gguf`), caches the file
by content under ``target.gguf_cache`` (an unchanged point is not re-exported;
a sidecar sha256 catches a corrupt entry), loads it once and every probe talks
to :class:`~quantlab.engines.llamacpp.LlamaCppEngine`.

A ``scheme/weights=as-is`` point over a GGUF quant made elsewhere runs that
file unchanged (its sha256 is the point's ``gguf.sha256`` tag).

A ``scheme/weights=gguf-*`` point (llama.cpp's own quant menu) is made by
llama.cpp: the point's float weights are written as above, then llama.cpp's
quantizer makes the type (with the point's importance matrix when it has one),
cached by the float file's key, the type and the matrix; its per-tensor type
mix is the point's ``gguf.types`` tag and its sizes are read from the file.

KV schemes map onto llama.cpp's cache types (real quantized K/V, attention
reads them through flash attention): ``int8`` -> ``q8_0``, ``int4`` -> ``q4_0``
(both blocks of 32 along the head dimension with one fp16 scale, llama.cpp's
layout rather than quantlab's per-head scales).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
import time
from pathlib import Path
from typing import Any

import torch

from quantlab import hardware, model_files, point
from quantlab.targets.configs import LlamaCppTargetConfig
from quantlab.engines.llamacpp import INSTALL, LlamaCppEngine, llama_cpp
from quantlab.export import cache as export_cache
from quantlab.export import gguf as gguf_export
from quantlab.digest import sha256_file
from quantlab.export.cache import content_key
from quantlab.hardware import Hardware
from quantlab.schemes.registry import Applied, Support, kv_handler, weights_handler
from quantlab.targets import register
from quantlab.targets.base import Target, worst

log = logging.getLogger("quantlab")


class LlamaCppTarget(Target):
    name = "llamacpp"
    serves_export = True
    cfg: LlamaCppTargetConfig

    def __init__(self, cfg: LlamaCppTargetConfig):
        super().__init__(cfg)
        # a gguf-* point's file, whether it came from the cache, and its metrics
        self._made: tuple[Path, bool, dict[str, float]] | None = None

    def hardware(self) -> Hardware | None:
        return hardware.cpu() if llama_cpp() is not None else None

    def missing_reason(self) -> str:
        return f"llama-cpp-python is not installed: {INSTALL}"

    def supports(self, weights: Any, kv: Any) -> Support:
        if self.hardware() is None:
            return Support("unsupported", self.missing_reason())
        m = weights_handler(weights).mapping("gguf", weights)
        made = " (made by llama.cpp's quantizer)" if m.ok and m.spec.get("quantize") else ""
        w = Support("real", f"llama.cpp {m.spec['type']} kernels{made}") if m.ok else Support("unsupported", m.reason)
        c = kv_handler(kv).mapping("gguf", kv)
        k = (Support("unsupported", c.reason) if not c.ok else Support("real") if c.spec["type"] == "F16"
             else Support("real", f"llama.cpp {c.spec['type'].lower()} K/V cache"))
        return worst([w, k])

    def apply_weights(self, model: torch.nn.Module, weights: Any, ctx) -> Applied:
        """As every target; a scheme whose GGUF type llama.cpp's quantizer
        makes (``gguf-*``) is quantized here, so its time is the apply stage's
        and its tensor types are the point's tags."""
        applied = super().apply_weights(model, weights, ctx)
        self._made = None
        spec = weights_handler(weights).mapping("gguf", weights).spec or {}
        if spec.get("as_is"):  # a GGUF made elsewhere: the file itself, unchanged
            path = Path(model.quantlab_gguf)
            self._made = path, True, dict(applied.metrics)  # the file's sizes, counted by the scheme
            return dataclasses.replace(applied, emulated=False, backend="llama.cpp (the file as made)", tags={
                **applied.tags, gguf_export.MADE_FILE_TAG: path.name, gguf_export.MADE_SHA_TAG: sha256_file(path)})
        quant = spec.get("quantize")
        if not quant:
            return applied
        t = time.perf_counter()
        path, reused = self._quantize(model, ctx.tokenizer, quant, applied.importance)
        self._made = path, reused, {"compile/gguf_quantize_s": time.perf_counter() - t,
                                    **model_files.gguf_size(str(path))}
        tags = {**applied.tags, point.GGUF_TYPES_TAG: model_files.gguf_type_mix_text(str(path)),
                "imatrix": "yes" if applied.importance else "no",
                gguf_export.MADE_FILE_TAG: path.name, gguf_export.MADE_SHA_TAG: sha256_file(path)}  # what its GGUF export ships
        return dataclasses.replace(applied, tags=tags)

    def _quantize(self, model: torch.nn.Module, tokenizer, quant: str,
                  importance: dict[str, torch.Tensor]) -> tuple[Path, bool]:
        """The float GGUF (cached as every export), then llama.cpp's ``quant``
        of it, cached by the float file's key, ``quant``, the importance
        matrix and llama-cpp-python's version."""
        source = getattr(model, "quantlab_gguf", None)
        float_path, _ = self._export(model, tokenizer, source)
        names = gguf_export.matrix_names(model)
        imatrix = {names[n]: v.numpy() for n, v in importance.items() if n in names}
        h = hashlib.sha256(f"{float_path.stem}|{quant}|llama-cpp-python "
                           f"{importlib.metadata.version('llama-cpp-python')}".encode())
        for name in sorted(imatrix):
            h.update(name.encode())
            h.update(imatrix[name].tobytes())

        def write(tmp: Path) -> dict[str, str]:
            log.info("llama.cpp: quantizing to %s%s", quant, " with an importance matrix" if imatrix else "")
            gguf_export.quantize(float_path, tmp, quant, imatrix, self.cfg.threads or 0)
            return {"quant": quant}

        path, reused, _ = export_cache.cached(self.cfg.gguf_cache, h.hexdigest()[:24], ".gguf", write,
                                              f"llamacpp: {quant} GGUF")
        return path, reused

    def engine(self, model: torch.nn.Module, kv: Applied, tokenizer) -> LlamaCppEngine:
        """Export to the content-keyed GGUF cache (or reuse it), then load. The
        tokenizer block is copied from the model's source GGUF when it has one.
        A ``gguf-*`` point loads the file llama.cpp's quantizer made."""
        kv_cfg = kv.config
        t = time.perf_counter()
        if self._made is not None:
            path, cached, made = self._made
        else:
            path, cached = self._export(model, tokenizer, getattr(model, "quantlab_gguf", None))
            made = {}
        export_s = time.perf_counter() - t
        cache_type = kv_handler(kv_cfg).mapping("gguf", kv_cfg).spec["type"]
        eng = LlamaCppEngine(path, cache_type, model.config.vocab_size, self.cfg.n_ctx, self.cfg.n_batch,
                             self.cfg.threads)
        eng.ready_s = time.perf_counter() - t
        eng.metrics.update({"compile/gguf_export_s": export_s, "compile/gguf_cached": float(cached),
                            "size/gguf_mb": path.stat().st_size / 2**20,
                            "size/runtime_weight_bytes": gguf_export.tensor_bytes(path), **made})
        return eng

    def _export(self, model: torch.nn.Module, tokenizer, source: Path | None) -> tuple[Path, bool]:
        key = content_key(model, extra=f"gguf-export-v2|{source or ''}")

        def write(tmp: Path) -> dict[str, int]:
            counts = gguf_export.write(model, tokenizer, tmp, source)
            log.info("GGUF written (%s)", ", ".join(f"{v} {k}" for k, v in counts.items()))
            return counts

        path, reused, _ = export_cache.cached(self.cfg.gguf_cache, key, ".gguf", write, "llamacpp: GGUF")
        return path, reused


register(LlamaCppTargetConfig, LlamaCppTarget)
