"""Fidelity against the reference model: KL divergence and top-1 agreement.

Needs no labels and is far more sensitive than perplexity (llama.cpp compares
its quant types this way). Reference log-probs are computed once per (model,
corpus, reference dtype) and cached on disk as safetensors, so every point of a
sweep compares against identical numbers.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)


@torch.inference_mode()
def logprobs(engine, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probs ``[T, V]`` in float32 for one sequence ``ids: [1, T]``."""
    return torch.log_softmax(engine.logits(ids)[0].float(), dim=-1).cpu()


def compare(ref_logp: torch.Tensor, logp: torch.Tensor) -> dict[str, float]:
    """KL(ref || point) per position (mean, P99, max) and top-1 agreement.

    Identical inputs give exactly 0 KL and agreement 1.
    """
    if ref_logp.shape != logp.shape:
        raise ValueError(f"reference {tuple(ref_logp.shape)} vs point {tuple(logp.shape)}")
    ref64, p64 = ref_logp.double(), logp.double()
    kl = (ref64.exp() * (ref64 - p64)).sum(-1).clamp_min(0.0).numpy()
    agree = (ref_logp.argmax(-1) == logp.argmax(-1)).double().mean().item()
    return {
        "fid/kl_mean": float(kl.mean()),
        "fid/kl_p99": float(np.percentile(kl, 99)),
        "fid/kl_max": float(kl.max()),
        "fid/top1_agree": float(agree),
        "fid/tokens": float(kl.size),
    }


def reference(key: dict, ids: torch.Tensor, cache_dir: str, build: Callable[[], object]) -> torch.Tensor:
    """Cached reference log-probs. ``key`` identifies model + reference precision;
    the token ids are hashed in, so another corpus or length gets another entry.
    ``build`` returns the reference engine and is only called on a cache miss."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
    digest.update(ids.numpy().tobytes())
    path = Path(cache_dir).expanduser() / "reference" / f"{digest.hexdigest()[:24]}.safetensors"
    if path.is_file():
        return load_file(path)["logp"]
    log.info("computing reference log-probs (cached at %s)", path)
    model = build()
    logp = logprobs(model, ids)
    del model
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"logp": logp.contiguous()}, tmp)
    tmp.replace(path)
    return logp
