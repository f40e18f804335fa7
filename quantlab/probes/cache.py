"""Accuracy through the KV cache: teacher-forced decoding over long contexts.

lm-eval's log-likelihood requests run without a cache, so a KV scheme cannot
move them. Here each window is prefilled for ``prefix_tokens`` through the
point's cache, then the continuation is fed ``chunk`` tokens at a time, every
step attending to the (quantized) cached keys and values. The continuation's
log-probs give perplexity and the KL divergence against the same model run
without a cache: the error the cache scheme adds on top of the weight scheme
(the fidelity probe already measures the weights' error against fp32).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from quantlab import models
from quantlab.probes.configs import CacheProbeConfig
from quantlab.divergence import kl_per_token
from quantlab.probes.fidelity import logprobs


def cached_logprobs(engine, ids: torch.Tensor, prefix: int, chunk: int) -> tuple[torch.Tensor, int]:
    """Log-probs ``[T - prefix, V]`` predicting tokens ``prefix+1 .. T`` (and the
    last one), computed through the engine's cache by the shared decode loop fed
    the known tokens ``chunk`` at a time; also the bytes the cache held."""
    ids = ids.to(engine.device)
    starts = list(range(prefix, ids.shape[1] - 1, chunk))
    rows: list[torch.Tensor] = []

    def teacher(_logits, i: int) -> torch.Tensor:
        s = starts[min(i, len(starts) - 1)]
        return ids[:, s:min(s + chunk, ids.shape[1] - 1)]

    out = engine.decode(ids[:, :prefix], len(starts) + 1, choose=teacher,
                        record=lambda logits: rows.append(logits[0].float()))
    return torch.log_softmax(torch.cat(rows), dim=-1).cpu(), out.kv_bytes


def probe(engine, config, windows: torch.Tensor, cfg: CacheProbeConfig, compute_bytes: int) -> dict[str, float]:
    """``windows: [n, T]`` with ``T = prefix_tokens + continuation``. Perplexity over
    the continuation, KL against the same engine run without a cache, and the
    bytes the cache holds at context ``T - 1`` vs a dense cache of
    ``compute_bytes``-byte elements (``config``: the transformers config)."""
    p = cfg.prefix_tokens
    nll, count, kls, kv_bytes = 0.0, 0, [], 0
    for row in windows:
        lp, kv_bytes = cached_logprobs(engine, row[None], p, cfg.chunk)
        target = row[p:]  # lp[j] predicts token p + j
        nll -= lp.gather(-1, target[:, None]).sum().item()
        count += target.numel()
        kls.append(kl_per_token(logprobs(engine, row[None])[p - 1:-1], lp, logits=False).numpy())
    ctx = windows.shape[1] - 1
    c = config.get_text_config(decoder=True)
    dense = 2 * c.num_hidden_layers * c.num_key_value_heads * models.head_dim(c) * ctx * compute_bytes
    kl = np.concatenate(kls)
    return {
        "kvfid/ppl": math.exp(nll / count),
        "kvfid/kl_mean": float(kl.mean()),
        "kvfid/kl_p99": float(np.percentile(kl, 99)),
        "kv/bytes_at_ctx": float(kv_bytes),
        "kv/bytes_per_token": kv_bytes / ctx,
        "kv/ratio_vs_dense": kv_bytes / dense,
        "kv/ctx_tokens": float(ctx),
    }

