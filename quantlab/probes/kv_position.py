"""The KV cache's error by position: where a quantized cache starts to hurt.

Each window is fed through the point's cache ``chunk`` tokens at a time (the
first chunk prefilled), so every later position attends to keys and values
the cache stored; its next-token log-probs are compared with the same engine
run on the whole window without a cache. The per-position KL (and NLL
difference on the actual next token) is averaged inside position buckets
(``[0, e1), [e1, e2), ...``); each bucket's standard error is over windows,
the unit drawn independently (:mod:`quantlab.uncertainty`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from quantlab.divergence import kl_per_token
from quantlab.probes.cache import cached_logprobs
from quantlab.probes.fidelity import logprobs
from quantlab.uncertainty import LEVEL, t_upper


def bucket_edges(edges: list[int], length: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` of the buckets a window of ``length`` positions
    reaches (the last one cut at ``length``), from ascending ``edges``."""
    bounds = [0, *sorted(e for e in edges if 0 < e)]
    out = [(lo, min(hi, length)) for lo, hi in zip(bounds, bounds[1:]) if lo < length]
    if bounds[-1] < length:
        out.append((bounds[-1], length))
    return out


def tokens_name(n: int) -> str:
    """A token count in a metric name: ``256``, ``1k`` (multiples of 1024), ``0``."""
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def bucket_name(lo: int, hi: int) -> str:
    """``0_256``, ``256_1k``, ``1k_2k``: compact, sortable in metric names."""
    return f"{tokens_name(lo)}_{tokens_name(hi)}"


def bucket_stats(values: np.ndarray, buckets: list[tuple[int, int]]) -> list[dict[str, float]]:
    """``values: [windows, positions]`` (positions indexed from 0) -> per
    bucket: ``mean`` (of the window means), ``stderr`` (their sd / sqrt(W);
    NaN below 2 windows), ``upper`` (one-sided ``LEVEL`` t bound on W - 1 df;
    NaN below 2 windows) and ``windows``."""
    out = []
    for lo, hi in buckets:
        means = values[:, lo:hi].mean(axis=1)
        w = len(means)
        se = float(means.std(ddof=1) / math.sqrt(w)) if w > 1 else math.nan
        upper = t_upper(float(means.mean()), se, w, 1.0 - LEVEL) if w > 1 else math.nan
        out.append({"mean": float(means.mean()), "stderr": se, "upper": upper, "windows": float(w)})
    return out


def first_over(buckets: list[tuple[int, int]], stats: list[dict[str, float]], tolerance: float) -> str:
    """The first bucket whose upper bound (its mean, with one window) exceeds
    ``tolerance``, as ``"256_1k"``; ``""`` when none does."""
    for (lo, hi), s in zip(buckets, stats):
        bound = s["mean"] if math.isnan(s["upper"]) else s["upper"]
        if bound > tolerance:
            return bucket_name(lo, hi)
    return ""


def per_position(engine, windows: torch.Tensor, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kl, dnll)``, each ``[W, T - chunk]``: column ``j`` is the prediction
    of token ``chunk + j`` (the first ``chunk`` tokens are prefilled), the KL
    of the cached pass against the uncached one, and the cached pass's NLL
    minus the uncached one's on that actual token."""
    kls, dnlls = [], []
    for row in windows:
        cached, _ = cached_logprobs(engine, row[None], chunk, chunk)
        full = logprobs(engine, row[None])[chunk - 1:-1]
        target = row[chunk:, None]
        # in slices of rows: [8192, 49152] in float64 at once would take several GB per temporary
        kls.append(np.concatenate([kl_per_token(full[i:i + 512], cached[i:i + 512], logits=False).numpy()
                                   for i in range(0, len(full), 512)]))
        dnlls.append((full.gather(-1, target) - cached.gather(-1, target))[:, 0].double().numpy())
    return np.stack(kls), np.stack(dnlls)


def probe(engine, windows: torch.Tensor, chunk: int, edges: list[int], tolerance: float
          ) -> tuple[dict[str, float], dict[str, list[float]], str]:
    """Metrics ``kvpos/kl_<bucket>`` and ``kvpos/dnll_<bucket>`` (with
    ``_stderr``), the per-window bucket means as items (paired comparisons),
    and the first bucket whose KL bound exceeds ``tolerance`` ('' if none).
    A position is the index of the predicted token in its window; the first
    ``chunk`` tokens are the prefill's (no cache error), so the first bucket
    starts after them."""
    kl, dnll = per_position(engine, windows, chunk)
    buckets = bucket_edges(edges, windows.shape[1])
    shifted = [(max(lo - chunk, 0), hi - chunk) for lo, hi in buckets if hi > chunk]
    named = [(max(lo, chunk), hi) for lo, hi in buckets if hi > chunk]
    metrics: dict[str, float] = {"kvpos/windows": float(len(windows)), "kvpos/length": float(windows.shape[1])}
    items: dict[str, list[float]] = {}
    kl_stats = bucket_stats(kl, shifted)
    for what, values, stats in (("kl", kl, kl_stats), ("dnll", dnll, bucket_stats(dnll, shifted))):
        for (lo, hi), (slo, shi), s in zip(named, shifted, stats):
            key = f"kvpos/{what}_{bucket_name(lo, hi)}"
            metrics[key] = s["mean"]
            if not math.isnan(s["stderr"]):
                metrics[f"{key}_stderr"] = s["stderr"]
            items[key] = [float(f"{x:.6g}") for x in values[:, slo:shi].mean(axis=1)]  # 6 significant digits
    return metrics, items, first_over(named, kl_stats, tolerance)
