"""How many sequences a KV-cache budget holds, found by allocating.

The point's own cache class (bf16 ``DynamicCache``, or a KV scheme's
quantized cache with its full-precision residual window) is filled with
``context`` tokens of K/V for every layer at a batch size, and its bytes are
read back (:func:`quantlab.schemes.kv.cache_bytes`); the capacity is the
largest batch whose filled cache fits the budget (doubling, then bisection).
Nothing is computed from a formula, so scales, zero points, group sizes and
residual windows are all counted as the cache really holds them.
"""
from __future__ import annotations

import numpy as np
import torch

from quantlab import models
from quantlab.schemes.kv import cache_bytes


def filled_bytes(engine, batch: int, context: int) -> int:
    """Bytes of the engine's request cache after ``context`` tokens of K/V for
    ``batch`` sequences went into every layer."""
    cfg = engine.model.config.get_text_config(decoder=True)
    dtype = engine.model.get_input_embeddings().weight.dtype
    cache = engine.cache_factory(config=engine.model.config)
    kv = torch.randn(batch, cfg.num_key_value_heads, context, models.head_dim(cfg), generator=torch.Generator().manual_seed(0))
    kv = kv.to(dtype=dtype, device=engine.device)
    with torch.inference_mode():
        for layer in range(cfg.num_hidden_layers):
            cache.update(kv, kv, layer)
    return cache_bytes(cache)


def capacity(engine, budget_bytes: float, context: int, ceiling: int = 4096) -> tuple[int, int]:
    """``(sequences, bytes of one)``: the largest batch whose filled cache fits
    ``budget_bytes`` (0 when one sequence does not), up to ``ceiling``."""
    one = filled_bytes(engine, 1, context)
    if one > budget_bytes:
        return 0, one
    lo, hi = 1, 2
    while hi <= ceiling and filled_bytes(engine, hi, context) <= budget_bytes:
        lo, hi = hi, hi * 2
    hi = min(hi, ceiling + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if filled_bytes(engine, mid, context) <= budget_bytes else (lo, mid)
    return lo, one


def measure(engine, prompt: torch.Tensor, cfg) -> dict[str, float]:
    """``load/kv_*`` metrics: capacity in ``cfg.kv_budget_mb`` at
    ``cfg.kv_context`` tokens, then one batch of that many sequences (at most
    ``cfg.kv_max_batch``) decoding ``cfg.new_tokens`` after a prompt of
    ``kv_context - new_tokens`` tokens (``prompt``, ``[P]``): tokens/s and the
    P50/P99 step latency at that concurrency."""
    budget = cfg.kv_budget_mb * 2**20
    seqs, one = capacity(engine, budget, cfg.kv_context)
    if seqs == 0:
        raise ValueError(f"probe.load.kv_budget_mb={cfg.kv_budget_mb:g} holds no sequence of {cfg.kv_context} tokens: "
                         f"one needs {one / 2**20:.2f} MiB with this point's KV cache")
    batch = min(seqs, cfg.kv_max_batch)
    n_prompt = max(1, cfg.kv_context - cfg.new_tokens)
    ids = prompt[:n_prompt].repeat(batch, 1)
    out = engine.decode(ids, cfg.new_tokens, engine.clock())
    steps = np.asarray(out.step_ms or [out.prefill_ms])
    return {"load/kv_capacity_seqs": float(seqs), "load/kv_seq_mb": one / 2**20,
            "load/kv_budget_mb": cfg.kv_budget_mb, "load/kv_context": float(cfg.kv_context),
            "load/kv_batch": float(batch), "load/kv_decode_tok_s": batch * 1e3 / float(steps.mean()),
            "load/kv_step_ms_p50": float(np.percentile(steps, 50)),
            "load/kv_step_ms_p99": float(np.percentile(steps, 99)),
            "load/kv_prefill_ms": out.prefill_ms, "load/kv_measured_mb": out.kv_bytes / 2**20}
