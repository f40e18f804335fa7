"""llama.cpp as an engine, through llama-cpp-python: a GGUF file loaded in
this process, logits of every position from ``llama_decode``, greedy requests
timed around each ``llama_decode`` call in the shared loop; under load,
llama.cpp's own scheduler is ``llama-server`` (:mod:`quantlab.serving.llama_server`).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import torch

from quantlab import hardware
from quantlab.decode import Decoded, decode_loop, greedy
from quantlab.engines.base import CAPABILITIES, Engine
from quantlab.errors import UserError
from quantlab.serving import llama_server

INSTALL = "pip install 'quantlab[llamacpp]' (builds llama-cpp-python from source, a few minutes)"


def llama_cpp():
    """The llama_cpp module, or None when llama-cpp-python is not installed."""
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

    def __init__(self, path: Path, kv_type: str, vocab_size: int, n_ctx: int = 2048, n_batch: int = 512,
                 threads: int | None = None):
        """``kv_type``: llama.cpp's K/V cache type (``F16``, ``Q8_0``, ``Q4_0``);
        ``n_ctx``: context slots; ``threads``: None for all cores."""
        lc = llama_cpp()
        if lc is None:
            raise UserError(f"llama-cpp-python is not installed: {INSTALL}")
        ggml = getattr(lc, f"GGML_TYPE_{kv_type}")
        threads = threads or os.cpu_count() or 1
        extra = extra_buffers_ok(hardware.cpu_flags())
        try:
            with _model_params(use_extra_bufts=extra):
                self.llm = lc.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch,
                                    n_ubatch=n_batch, n_threads=threads, n_threads_batch=threads, type_k=ggml,
                                    type_v=ggml, flash_attn=kv_type != "F16", verbose=False)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"llama.cpp cannot load {path}: {str(e).splitlines()[0]}") from e
        super().__init__(vocab_size, n_ctx)
        self.extra_buffers = extra
        self.metrics["llamacpp/extra_buffers"] = float(extra)
        self.path = Path(path)
        self.n_vocab = self.llm.n_vocab()
        self.threads = threads
        self.kv_type = kv_type
        self._lc = lc
        self._batch = lc._internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1)

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

    def _forward(self, ids: list[int], start: int, all_logits: bool) -> np.ndarray:
        """Decode ``ids`` at ``start`` (n_batch at a time); logits ``[1, k, V]`` of
        the last token (prefill) or of every token, as a numpy array (a copy)."""
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
        return (rows[0] if len(rows) == 1 else np.concatenate(rows))[None]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.from_numpy(self._forward(row.tolist(), 0, True)) for row in ids])

    def decode(self, prompt: torch.Tensor, n_new: int, clock=None, choose=greedy, record=None) -> Decoded:
        """Greedy (or ``choose``) decoding with numpy logits between steps
        (``record`` and ``choose`` see numpy arrays): torch's work per token
        was most of quantlab's own time around each ``llama_decode``
        (benchmarks/llamacpp_peers.py). ``chosen`` comes back as torch."""
        if prompt.shape[0] != 1:
            raise UserError(f"llamacpp: the engine decodes one sequence; probe.latency.batch_size={prompt.shape[0]} "
                            "(and grid_batch_sizes) must be 1 on this target")

        def forward(ids, start: int) -> np.ndarray:
            return self._forward(np.asarray(ids).reshape(-1).tolist(), start, start > 0)

        out = decode_loop(forward, prompt, n_new, clock or self.clock(), choose, record)
        out.chosen = [torch.as_tensor(c) for c in out.chosen]  # torch, as every engine's, once timing is done
        out.kv_bytes = int(self._lc.llama_state_seq_get_size(self.llm.ctx, 0))
        return out

    def reset(self) -> None:
        self._clear()

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None
