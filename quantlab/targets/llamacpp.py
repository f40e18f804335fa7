"""llama.cpp as a target, through llama-cpp-python: the CPU runtime small
quantized LMs are deployed with (ollama and LM Studio load the same GGUF files).

Per point: quantlab quantizes as on the CPU target (its own integers), writes
them into llama.cpp block types (:mod:`quantlab.export.gguf`), caches the file
by content under ``target.gguf_cache`` (an unchanged point is not re-exported;
a sidecar sha256 catches a corrupt entry), loads it once and every probe talks
to :class:`~quantlab.engines.llamacpp.LlamaCppEngine`.

KV schemes map onto llama.cpp's cache types (real quantized K/V, attention
reads them through flash attention): ``int8`` -> ``q8_0``, ``int4`` -> ``q4_0``
(both blocks of 32 along the head dimension with one fp16 scale, llama.cpp's
layout rather than quantlab's per-head scales).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from quantlab import hardware
from quantlab.targets.configs import LlamaCppTargetConfig
from quantlab.engines.llamacpp import INSTALL, LlamaCppEngine, llama_cpp
from quantlab.export import cache as export_cache
from quantlab.export import gguf as gguf_export
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

    def hardware(self) -> Hardware | None:
        return hardware.cpu() if llama_cpp() is not None else None

    def missing_reason(self) -> str:
        return f"llama-cpp-python is not installed: {INSTALL}"

    def supports(self, weights: Any, kv: Any) -> Support:
        if self.hardware() is None:
            return Support("unsupported", self.missing_reason())
        m = weights_handler(weights).mapping("gguf", weights)
        w = Support("real", f"llama.cpp {m.spec['type']} kernels") if m.ok else Support("unsupported", m.reason)
        c = kv_handler(kv).mapping("gguf", kv)
        k = (Support("unsupported", c.reason) if not c.ok else Support("real") if c.spec["type"] == "F16"
             else Support("real", f"llama.cpp {c.spec['type'].lower()} K/V cache"))
        return worst([w, k])

    def engine(self, model: torch.nn.Module, kv: Applied, tokenizer) -> LlamaCppEngine:
        """Export to the content-keyed GGUF cache (or reuse it), then load. The
        tokenizer block is copied from the model's source GGUF when it has one."""
        kv_cfg = kv.config
        t = time.perf_counter()
        path, cached = self._export(model, tokenizer, getattr(model, "quantlab_gguf", None))
        export_s = time.perf_counter() - t
        cache_type = kv_handler(kv_cfg).mapping("gguf", kv_cfg).spec["type"]
        eng = LlamaCppEngine(path, cache_type, model.config.vocab_size, self.cfg.n_ctx, self.cfg.n_batch,
                             self.cfg.threads)
        eng.ready_s = time.perf_counter() - t
        eng.metrics.update({"compile/gguf_export_s": export_s, "compile/gguf_cached": float(cached),
                            "size/gguf_mb": path.stat().st_size / 2**20,
                            "size/runtime_weight_bytes": gguf_export.tensor_bytes(path)})
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
