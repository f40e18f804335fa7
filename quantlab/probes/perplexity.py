"""Token-level WikiText-2 perplexity over fixed non-overlapping windows.

This is the number GPTQ-style papers report: the test split's rows joined with
"\\n\\n", tokenized once, cut into ``window``-token windows (the tail shorter
than a window is dropped), each window scored on its own with no context from
the previous one. Reported as ``ppl_token_wikitext2_w<window>`` (``..._first<n>``
when only the first n windows are scored); not comparable to lm-eval's
word-level ``word_perplexity/wikitext2_local``. The per-token NLLs are kept so
that two points can be compared paired, token by token.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantlab import decision, sequential
from quantlab.errors import UserError
from quantlab.uncertainty import block_stderr, mean_stderr


def wikitext2_text(data_dir: str | None) -> str:
    """Rebuild the HF ``wikitext-2-raw-v1`` test rows and join them like GPTQ."""
    if not data_dir:
        raise UserError("perplexity probe needs data_dir (or QUANTLAB_DATA_DIR) with wikitext-2-raw/wiki.test.raw")
    path = Path(data_dir).expanduser() / "wikitext-2-raw" / "wiki.test.raw"
    if not path.is_file():
        raise UserError(f"perplexity probe: expected {path}")
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    rows = ["" if line.strip() == "" else line + "\n" for line in lines]
    return "\n\n".join(rows)


def windows(ids: torch.Tensor, window: int, max_windows: int | None) -> tuple[torch.Tensor, int]:
    """``([n, window]`` non-overlapping windows from the start of ``ids: [T]``,
    how many whole windows the text has)."""
    total = ids.numel() // window
    n = total if max_windows is None else min(total, max_windows)
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {window}")
    return ids[: n * window].reshape(n, window), total


def metric_name(window: int, n: int, total: int) -> str:
    """``ppl_token_wikitext2_w2048`` over the whole text; ``..._first4`` over
    its first 4 windows only (a different, noisier number)."""
    return f"ppl_token_wikitext2_w{window}" + (f"_first{n}" if n < total else "")


@torch.inference_mode()
def token_nll(engine, wins: torch.Tensor) -> np.ndarray:
    """Negative log-likelihood ``[n, window - 1]`` of every predicted token."""
    return np.stack([-engine.token_logprobs(row[None])[0][0].numpy() for row in wins])


def summary(nll: np.ndarray, name: str) -> dict[str, float]:
    """Perplexity exp(mean NLL) over every predicted token; the standard error
    of ln(PPL) (``<name>_ln_stderr``) from block means of the tokens in text
    order (``<name>_blocks`` of them: a window's tokens are correlated, see
    :mod:`quantlab.uncertainty`), the per-token one as
    ``<name>_ln_stderr_tokens`` (a narrower, secondary figure); the window count."""
    se, blocks = block_stderr(nll.ravel())
    return {name: math.exp(float(nll.mean())), f"{name}_ln_stderr": se,
            f"{name}_ln_stderr_tokens": mean_stderr(nll.ravel()), f"{name}_blocks": float(blocks),
            f"{name}_windows": float(nll.shape[0])}


def token_perplexity(engine, wins: torch.Tensor, total: int | None = None) -> dict[str, float]:
    """:func:`summary` of :func:`token_nll`; ``total``: whole windows in the text."""
    n, window = wins.shape
    return summary(token_nll(engine, wins), metric_name(window, n, total or n))


@dataclass(frozen=True)
class Stopped:
    """What an adaptive perplexity evaluation scored and why it stopped."""

    nll: np.ndarray  # [windows scored, window - 1]
    reason: str
    lower: float  # the running anytime-valid bounds on the loss against the reference at the last look
    upper: float


def adaptive_nll(engine, wins: torch.Tensor, ref_nll: np.ndarray, chunk: int, budgets: Sequence[float],
                 alpha: float, score_all: bool = False, progress: Callable[[str], None] = lambda _: None) -> Stopped:
    """Score ``wins`` (the cap) ``chunk`` windows a look; after each look,
    bound the loss ``1 - PPL(reference) / PPL(point)`` on the windows so far
    (paired per-token NLL differences against ``ref_nll``, t on block means,
    each look at its share of ``alpha``: :mod:`quantlab.sequential`) and stop
    once every budget is decided. ``score_all``: score the cap whatever the
    bounds say (the sweep's baseline candidates: every other point is paired
    against their tokens)."""
    cap = len(wins)
    looks = sequential.schedule(cap, chunk)
    parts, run_lo, run_hi, before = [], -math.inf, math.inf, 0
    for n, level in zip(looks, sequential.levels(alpha, looks, cap)):
        parts.append(token_nll(engine, wins[before:n]))
        before = n
        nll = np.concatenate(parts)
        diffs = (nll - ref_nll[:n]).ravel()
        d_lo, d_hi = sequential.mean_bounds(diffs, level)
        run_lo, run_hi = max(run_lo, decision.relative(d_lo)), min(run_hi, decision.relative(d_hi))
        lo, hi = sequential.effective(run_lo, run_hi, decision.relative(d_lo), decision.relative(d_hi),
                                      decision.relative(float(diffs.mean())))
        progress(f"{n}/{cap} windows: loss against the reference in [{lo:.4f}, {hi:.4f}] (level {level:.2g})")
        if n < cap and not score_all and sequential.decided(lo, hi, budgets):
            within = [f"{b:g}" for b in budgets if hi <= b]
            return Stopped(nll, f"decided at {n} of {cap} windows: within {', '.join(within) or 'none'} of "
                                f"budgets {', '.join(f'{b:g}' for b in budgets)}", lo, hi)
    return Stopped(np.concatenate(parts), "baseline candidate: scored the cap" if score_all
                   else f"cap of {cap} windows reached", lo, hi)
