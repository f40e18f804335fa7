"""llama.cpp as a target, through llama-cpp-python: the CPU runtime small
quantized LMs are deployed with (ollama and LM Studio load the same GGUF files).

Per point: quantlab quantizes as on the CPU target (its own integers), writes
them into llama.cpp block types (:mod:`quantlab.gguf_export`), caches the file
by content under ``target.gguf_cache`` (an unchanged point is not re-exported;
a sidecar sha256 catches a corrupt entry), loads it once and every probe talks
to :class:`LlamaCppEngine`: logits of every position from ``llama_decode``,
greedy requests timed around each ``llama_decode`` call in the shared loop.

KV schemes map onto llama.cpp's cache types (real quantized K/V, attention
reads them through flash attention): ``int8`` -> ``q8_0``, ``int4`` -> ``q4_0``
(both blocks of 32 along the head dimension with one fp16 scale, llama.cpp's
layout rather than quantlab's per-head scales).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from quantlab import gguf_export, hardware
from quantlab.config import TargetConfig
from quantlab.decode import Decoded, decode_loop, greedy
from quantlab.digest import sha256_file
from quantlab.engines.base import CAPABILITIES, Engine
from quantlab.errors import UserError
from quantlab.hardware import Hardware
from quantlab.probes import llama_server
from quantlab.schemes.registry import Applied, Support, kv_handler, weights_handler
from quantlab.targets import register
from quantlab.targets.base import Target, worst

log = logging.getLogger("quantlab")
INSTALL = "pip install 'quantlab[llamacpp]' (builds llama-cpp-python from source, a few minutes)"


@dataclass
class LlamaCppTargetConfig(TargetConfig):
    """``threads``: llama.cpp threads (None: all cores). ``n_ctx``: context slots
    of the KV cache. ``gguf_cache``: where exported points are kept by content."""

    name: str = "llamacpp"
    threads: Optional[int] = None
    n_ctx: int = 2048
    n_batch: int = 512
    gguf_cache: str = "~/.cache/quantlab/gguf"


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def extra_buffers_ok(flags: frozenset[str]) -> bool:
    """Whether llama.cpp may use its extra CPU buffer types (weight repacking,
    AMX). On CPUs with AMX-INT8, llama-cpp-python 0.3.36 built natively
    segfaults in its first decode of a Q8_0, Q4_0 or Q4_1 model (measured on
    SmolLM2 and the tiny test model; BF16 runs), and runs them all with the
    extra buffers off; elsewhere they stay on (repacking is faster)."""
    return "amx_int8" not in flags


@contextlib.contextmanager
def _model_params(**fields):
    """``llama_cpp.Llama`` takes no argument for some model params
    (``use_extra_bufts``): set them on its defaults while it loads."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        for k, v in fields.items():
            setattr(p, k, v)
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


class LlamaCppEngine(Engine):
    """A GGUF loaded in llama.cpp; batch 1 (one sequence)."""

    name = "llamacpp"

    def __init__(self, path: Path, cfg: LlamaCppTargetConfig, kv_type: str, vocab_size: int):
        lc = _llama_cpp()
        ggml = getattr(lc, f"GGML_TYPE_{kv_type}")
        threads = cfg.threads or os.cpu_count() or 1
        extra = extra_buffers_ok(hardware.cpu_flags())
        try:
            with _model_params(use_extra_bufts=extra):
                self.llm = lc.Llama(model_path=str(path), n_ctx=cfg.n_ctx, n_batch=cfg.n_batch,
                                    n_ubatch=cfg.n_batch, n_threads=threads, n_threads_batch=threads, type_k=ggml,
                                    type_v=ggml, flash_attn=kv_type != "F16", verbose=False)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"llama.cpp cannot load {path}: {str(e).splitlines()[0]}") from e
        super().__init__(vocab_size, cfg.n_ctx)
        self.extra_buffers = extra
        self.metrics["llamacpp/extra_buffers"] = float(extra)
        self.path = Path(path)
        self.n_vocab = self.llm.n_vocab()
        self.threads = threads
        self.kv_type = kv_type
        self._lc = lc
        self._batch = lc._internals.LlamaBatch(n_tokens=cfg.n_batch, embd=0, n_seq_max=1)

    def cannot(self, probe: str) -> str:
        if probe == "stages":
            return "llama.cpp runs a whole step natively: no per-module timing"
        if probe == "batch":
            return ("llama-cpp-python's Llama decodes one sequence (llama.cpp batches through llama-server's "
                    "slots: policy continuous)")
        if probe == "continuous" and llama_server.binary() is None:
            return (f"llama.cpp's parallel slots are llama-server's, and none was found: set QUANTLAB_LLAMA_SERVER "
                    f"or put llama-server on PATH ({llama_server.BUILD})")
        if probe == "cache":
            return ("llama.cpp attends through its (quantized) cache in every forward, so it has no cache-free "
                    "reference: compare fid/* and perplexity against the f16-cache point")
        return "" if probe in CAPABILITIES else super().cannot(probe)

    def scheduler(self, max_batch: int, max_tokens: int):
        """llama-server on this GGUF: ``max_batch`` slots with this engine's
        threads, KV cache type and batch size."""
        server = llama_server.LlamaServer(self.path, max_batch, max(256, max_tokens + 16), self.threads, self.kv_type,
                                          self.llm.n_batch, self.extra_buffers)
        return llama_server.ServerPolicy(server)

    def _clear(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self.llm.ctx), True)

    def _forward(self, ids: list[int], start: int, all_logits: bool) -> torch.Tensor:
        """Decode ``ids`` at ``start`` (n_batch at a time); logits ``[1, k, V]`` of
        the last token (prefill) or of every token."""
        if start == 0:
            self._clear()
        if start + len(ids) > self.max_length:
            raise UserError(f"llamacpp: {start + len(ids)} tokens exceed target.n_ctx={self.max_length}")
        rows = []
        for s in range(0, len(ids), self.llm.n_batch):
            chunk = ids[s:s + self.llm.n_batch]
            self._batch.set_batch(chunk, n_past=start + s, logits_all=all_logits)
            self.llm._ctx.decode(self._batch)
            n = len(chunk) if all_logits else 1
            if all_logits or s + len(chunk) == len(ids):
                ptr = self.llm._ctx.get_logits()
                rows.append(np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab)).copy())
        return torch.from_numpy(np.concatenate(rows)[None])

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._forward(row.tolist(), 0, True) for row in ids])

    def decode(self, prompt: torch.Tensor, n_new: int, clock=None, choose=greedy, record=None) -> Decoded:
        if prompt.shape[0] != 1:
            raise UserError(f"llamacpp: the engine decodes one sequence; probe.latency.batch_size={prompt.shape[0]} "
                            "(and grid_batch_sizes) must be 1 on this target")

        def forward(ids, start: int) -> torch.Tensor:
            return self._forward([int(t) for t in np.asarray(ids).reshape(-1)], start, start > 0)

        out = decode_loop(forward, prompt, n_new, clock or self.clock(), choose, record)
        out.kv_bytes = int(self._lc.llama_state_seq_get_size(self.llm.ctx, 0))
        return out

    def reset(self) -> None:
        self._clear()

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None


class LlamaCppTarget(Target):
    name = "llamacpp"
    cfg: LlamaCppTargetConfig

    def __init__(self, cfg: LlamaCppTargetConfig):
        super().__init__(cfg)
        if cfg.n_ctx < 16 or cfg.n_batch < 1:
            raise UserError(f"llamacpp: n_ctx must be >= 16 and n_batch >= 1 (got {cfg.n_ctx}, {cfg.n_batch})")

    def hardware(self) -> Hardware | None:
        return hardware.cpu() if _llama_cpp() is not None else None

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
        eng = LlamaCppEngine(path, self.cfg, cache_type, model.config.vocab_size)
        eng.ready_s = time.perf_counter() - t
        eng.metrics.update({"compile/gguf_export_s": export_s, "compile/gguf_cached": float(cached),
                            "size/gguf_mb": path.stat().st_size / 2**20,
                            "size/runtime_weight_bytes": gguf_export.tensor_bytes(path)})
        return eng

    def _export(self, model: torch.nn.Module, tokenizer, source: Path | None) -> tuple[Path, bool]:
        root = Path(self.cfg.gguf_cache).expanduser()
        key = gguf_export.content_key(model, extra=f"gguf-export-v1|{source or ''}")
        path, stamp = root / f"{key}.gguf", root / f"{key}.json"
        if path.is_file() and stamp.is_file():
            want = json.loads(stamp.read_text())["sha256"]
            if sha256_file(path) != want:
                raise UserError(f"llamacpp: GGUF cache entry {path} is corrupt (sha256 differs from {stamp.name}); "
                                "delete both files to re-export")
            return path, True
        counts = gguf_export.write(model, tokenizer, path, source)
        stamp.write_text(json.dumps({"sha256": sha256_file(path), "types": counts}))
        log.info("GGUF written: %s (%s)", path, ", ".join(f"{v} {k}" for k, v in counts.items()))
        return path, False


register(LlamaCppTargetConfig, LlamaCppTarget)
