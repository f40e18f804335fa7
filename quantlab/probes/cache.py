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

from quantlab.config import CacheProbeConfig
from quantlab.probes.fidelity import logprobs
from quantlab.schemes.kv import cache_bytes


@torch.inference_mode()
def cached_logprobs(model, ids: torch.Tensor, prefix: int, chunk: int, cache_factory):
    """Log-probs ``[T - prefix, V]`` predicting tokens ``prefix+1 .. T`` (and the
    last one), computed through a cache; also returns the filled cache."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = cache_factory(config=model.config)
    out = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1)
    rows = [out.logits[0, -1:].float()]
    for s in range(prefix, ids.shape[1] - 1, chunk):
        e = min(s + chunk, ids.shape[1] - 1)
        out = model(input_ids=ids[:, s:e], cache=cache, use_cache=True)
        rows.append(out.logits[0].float())
    return torch.log_softmax(torch.cat(rows), dim=-1).cpu(), cache


def probe(model, windows: torch.Tensor, cfg: CacheProbeConfig, cache_factory) -> dict[str, float]:
    """``windows: [n, T]`` with ``T = prefix_tokens + continuation``. Perplexity over
    the continuation, KL against the same model run without a cache, and the
    bytes the cache holds at context ``T - 1`` vs a dense cache in the compute dtype."""
    p = cfg.prefix_tokens
    nll, count, kls, kv_bytes = 0.0, 0, [], 0
    for row in windows:
        lp, cache = cached_logprobs(model, row[None], p, cfg.chunk, cache_factory)
        target = row[p:]  # lp[j] predicts token p + j
        nll -= lp.gather(-1, target[:, None]).sum().item()
        count += target.numel()
        kls.append(_kl(logprobs(model, row[None])[p - 1:-1], lp))
        kv_bytes = cache_bytes(cache)
    ctx = windows.shape[1] - 1
    c = model.config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dense = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * ctx * _compute_bytes(model)
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


def _compute_bytes(model) -> int:
    """Element size of the activations (the dtype an unquantized cache would hold)."""
    return model.get_input_embeddings().weight.element_size()


def _kl(ref: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    r, q = ref.double(), q.double()
    return (r.exp() * (r - q)).sum(-1).clamp_min(0).numpy()
