"""Fidelity against the reference model: KL divergence, top-1 agreement and the
perplexity ratio on the same tokens, each with its standard error.

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

from quantlab.digest import computed_once
from quantlab.divergence import kl_per_token
from quantlab.uncertainty import mean_stderr, unit_stderr

log = logging.getLogger(__name__)


@torch.inference_mode()
def logprobs(engine, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probs ``[W * L, V]`` in float32 of ``ids: [W, L]``, each
    window scored on its own, in order (one sequence: ``[1, T]`` -> ``[T, V]``)."""
    return torch.cat([torch.log_softmax(engine.logits(row[None])[0].float(), dim=-1).cpu() for row in ids])


def compare(ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor | None = None,
            windows: int = 1) -> dict[str, float]:
    """llama.cpp-grade fidelity statistics of ``logp`` against ``ref_logp``
    (``[T, V]``: ``windows`` equal windows of positions, in order).

    Per position: KL(ref || point), summarised as mean (with its standard
    error from the window means, ``fid/windows`` of them: the unit, see
    :mod:`quantlab.uncertainty`; the per-position one as ``*_stderr_tokens``),
    median, P99, P99.9 and max; top-1 agreement ("same top p") with its
    standard errors likewise. With ``targets`` (``[windows, T / windows - 1]``:
    each window's next tokens) also ln(PPL(point) / PPL(ref)) and the mean
    change of the probability given to the actual next token (delta-p), each
    with its standard error, from the per-token differences (paired, as
    llama.cpp's ``--kl-divergence``). Identical inputs give exactly 0 KL,
    agreement 1, a ratio of 0 and ``fid/identical`` 1.
    """
    if ref_logp.shape != logp.shape:
        raise ValueError(f"reference {tuple(ref_logp.shape)} vs point {tuple(logp.shape)}")
    ref64, p64 = ref_logp.double(), logp.double()
    kl = kl_per_token(ref64, p64, logits=False).numpy()
    same = (ref_logp.argmax(-1) == logp.argmax(-1)).double().numpy()
    out = {
        **_mean("fid/kl_mean", kl, windows),
        "fid/kl_median": float(np.median(kl)),
        "fid/kl_p99": float(np.percentile(kl, 99)),
        "fid/kl_p999": float(np.percentile(kl, 99.9)),
        "fid/kl_max": float(kl.max()),
        **_mean("fid/top1_agree", same, windows),
        "fid/tokens": float(kl.size),
        "fid/windows": float(windows),
        "fid/identical": float(torch.equal(ref_logp, logp)),
    }
    if targets is not None:
        length = kl.size // windows
        if targets.numel() != windows * (length - 1):
            raise ValueError(f"{targets.numel()} targets for {windows} windows of {length} positions "
                             "(need one fewer a window)")
        idx = targets.reshape(windows, length - 1, 1).long()
        lr = ref64.reshape(windows, length, -1)[:, :-1].gather(-1, idx)[..., 0].numpy().ravel()
        lq = p64.reshape(windows, length, -1)[:, :-1].gather(-1, idx)[..., 0].numpy().ravel()
        dnll, dp = lr - lq, np.exp(lq) - np.exp(lr)
        out.update({**_mean("fid/ln_ppl_ratio", dnll, windows), **_mean("fid/dp_token_mean", dp, windows)})
    return out


def _mean(name: str, per_position: np.ndarray, windows: int) -> dict[str, float]:
    """``name``: the mean over positions; ``name_stderr``: its standard error
    from the means of the ``windows`` windows (the unit; 0 for one window);
    ``name_stderr_tokens``: the per-position one (treats positions as
    independent: narrower, a secondary figure)."""
    return {name: float(per_position.mean()), f"{name}_stderr": unit_stderr(per_position, windows),
            f"{name}_stderr_tokens": mean_stderr(per_position)}


def compare_topk(ref_logp: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor,
                 target_logp: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                 windows: int = 1) -> dict[str, float]:
    """Fidelity from an engine that returns only its top ``k`` log-probabilities
    per position (``top_values``, ``top_ids``: ``[T, k]``, best first).

    ``fid/kl_topk_lb_mean``: per position KL(ref || point) over ``k + 1``
    outcomes, the point's top ``k`` tokens and "any other" (the reference's
    and the point's remaining mass each merged into one). Merging outcomes
    never raises a KL (the data-processing inequality), so this is a lower
    bound of ``fid/kl_mean``, equal to it when the reference puts no mass
    outside the point's top k; ``fid/kl_topk_ref_mass_outside`` says how much
    it leaves out. Top-1 agreement is exact (the point's best token is known);
    with ``target_logp`` (the point's log-probability of each actual next
    token, ``[windows, L - 1]``) and ``targets`` (likewise),
    ``fid/ln_ppl_ratio`` is exact too. Positions: ``windows`` equal windows,
    as in :func:`compare`."""
    if ref_logp.shape[0] != top_values.shape[0]:
        raise ValueError(f"reference has {ref_logp.shape[0]} positions, the point {top_values.shape[0]}")
    ref64, vals = ref_logp.double(), top_values.double()
    p_in = ref64.exp().gather(-1, top_ids.long())  # reference mass on the point's top k
    q_in = vals.exp()
    p_out = (1.0 - p_in.sum(-1)).clamp_min(0.0)
    q_out = (1.0 - q_in.sum(-1)).clamp_min(1e-300)
    kl_in = (p_in * (p_in.clamp_min(1e-300).log() - vals)).sum(-1)
    kl = (kl_in + torch.where(p_out > 0, p_out * (p_out.clamp_min(1e-300).log() - q_out.log()), 0.0))
    kl = kl.clamp_min(0.0).numpy()
    same = (ref_logp.argmax(-1) == top_ids[:, 0]).double().numpy()
    out = {**_mean("fid/kl_topk_lb_mean", kl, windows),
           "fid/kl_topk_k": float(top_ids.shape[1]), "fid/kl_topk_ref_mass_outside": float(p_out.mean()),
           **_mean("fid/top1_agree", same, windows), "fid/tokens": float(kl.size), "fid/windows": float(windows)}
    if target_logp is not None and targets is not None:
        length = kl.size // windows
        idx = targets.reshape(windows, length - 1, 1).long()
        lr = ref64.reshape(windows, length, -1)[:, :-1].gather(-1, idx)[..., 0].numpy().ravel()
        out.update(_mean("fid/ln_ppl_ratio", lr - target_logp.double().numpy().ravel(), windows))
    return out


def reference(key: dict, ids: torch.Tensor, cache_dir: str, build: Callable[[], object]) -> torch.Tensor:
    """Cached reference log-probs. ``key`` identifies model + reference precision;
    the token ids are hashed in, so another corpus or length gets another entry.
    ``build`` returns the reference engine and is only called on a cache miss."""
    return cached("reference", key, ids, cache_dir, lambda: logprobs(build(), ids))


def cached(kind: str, key: dict, ids: torch.Tensor, cache_dir: str,
           compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A tensor computed from the reference model, cached on disk under
    ``<cache_dir>/<kind>/`` by ``key`` and the token ids (written atomically:
    a rename, so concurrent points never read half a file); ``compute`` only
    runs on a miss, once for all the points (and nodes, on a shared
    ``cache_dir``) that miss together: they wait on a lock file beside it."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
    digest.update(ids.numpy().tobytes())
    path = Path(cache_dir).expanduser() / kind / f"{digest.hexdigest()[:24]}.safetensors"

    def compute_logged() -> torch.Tensor:
        log.info("computing the reference model's %s (cached at %s)", kind, path)
        return compute()

    return computed_once(path, lambda p: next(iter(load_file(p).values())),  # files before: "logp", one tensor
                         compute_logged, lambda value, tmp: save_file({"value": value.contiguous()}, tmp))


def as_parity(metrics: dict[str, float]) -> dict[str, float]:
    """``fid/*`` statistics computed against quantlab's in-memory point instead
    of the reference, renamed ``parity/*``: how far the served artifact is from
    the point quantlab quantized (0 KL, agreement 1: the same model)."""
    return {"parity/" + k.removeprefix("fid/"): v for k, v in metrics.items()}


def greedy_parity(served, local, prompt: torch.Tensor, n_new: int) -> dict[str, float]:
    """Greedy continuations of ``prompt`` (``[1, T]``) by the served engine and
    by the in-memory one: ``parity/greedy_match_tokens``, the length of their
    common prefix out of ``parity/greedy_tokens``."""
    a, b = (_token_list(e.decode(prompt, n_new).chosen) for e in (served, local))
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"parity/greedy_match_tokens": float(same), "parity/greedy_tokens": float(n_new)}


def _token_list(chosen: list) -> list[int]:
    return [int(np.asarray(c).reshape(-1)[0]) for c in chosen]
