"""Token-level WikiText-2 perplexity over non-overlapping windows.

The whole split is the number GPTQ-style papers report: the test split's
rows joined with "\\n\\n", tokenized once, cut into ``window``-token windows
(the tail shorter than a window is dropped), each window scored on its own
with no context from the previous one: ``ppl_token_wikitext2_w<window>``. A
sample of it is ``n`` windows drawn at random, seeded, among the windows
inside each article (:func:`quantlab.corpus.random_windows`):
``ppl_token_wikitext2_w<window>_rand<n>``, a different, noisier number. Either
design records each window's article, the unit a bound resamples. Neither is comparable to lm-eval's
word-level ``word_perplexity/wikitext2_local``. The per-token NLLs are kept
(window by window, in draw order) so that two points can be compared paired.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantlab import corpus, decision, sequential
from quantlab.errors import UserError
from quantlab.uncertainty import MIN_UNITS, cluster_stderr, mean_stderr, paired, quantile, unit_stderr


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


def sample(tokenizer, raw: str, window: int, max_windows: int | None,
           seed: int) -> tuple[torch.Tensor, str, list[int] | None]:
    """``(windows [n, window], metric name, each window's article)``: every
    window of the split in text order (``max_windows`` None, GPTQ's design;
    each window's article is the one it begins in,
    :func:`quantlab.corpus.articles_of_consecutive`), else ``max_windows``
    drawn at random within articles (:func:`quantlab.corpus.windows_in_articles`).
    Either way a bound resamples articles: the claim covers articles like
    the split's, not its windows alone."""
    if max_windows is None:
        ids = tokenizer(raw, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        wins, _ = windows(ids, window, None)
        return wins, metric_name(window, len(wins), len(wins)), corpus.articles_of_consecutive(
            tokenizer, raw, window, len(wins))
    wins, _, articles = corpus.windows_in_articles(tokenizer, raw, window, max_windows, seed)
    return wins, metric_name(window, len(wins), None), articles


def metric_name(window: int, n: int, total: int | None) -> str:
    """``ppl_token_wikitext2_w2048`` over the whole text (``total`` windows,
    all scored); ``..._rand16`` over 16 windows drawn at random (``total``
    None); ``..._first4`` over the first 4 in text order (runs before the
    random draw)."""
    name = f"ppl_token_wikitext2_w{window}"
    return name + (f"_rand{n}" if total is None else f"_first{n}" if n < total else "")


# tokens one forward scores: 4 windows of 128 a batch (1.1-1.25x the row-by-row throughput of fp32, bf16,
# int8 and int4 on 2 AVX-512 cores; benchmarks/ppl_batch.py), one window of 512 or more
BATCH_TOKENS = 512


def batch_rows(window: int) -> int:
    """Windows per forward: a function of the window alone, so that the fixed
    design, every adaptive look (whose sizes are multiples of it at the
    defaults) and the cached reference batch a window with the same others."""
    return max(1, BATCH_TOKENS // window)


@torch.inference_mode()
def token_nll(engine, wins: torch.Tensor, rows: int | None = None) -> np.ndarray:
    """Negative log-likelihood ``[n, window - 1]`` of every predicted token,
    ``rows`` windows a forward (default :func:`batch_rows`; equal windows: no padding)."""
    step = rows or batch_rows(wins.shape[1])
    return np.concatenate([-engine.token_logprobs(wins[i:i + step])[0].numpy() for i in range(0, len(wins), step)])


def summary(nll: np.ndarray, name: str, articles: list[int] | None = None) -> dict[str, float]:
    """Perplexity exp(mean NLL) over every predicted token; the standard error
    of ln(PPL) (``<name>_ln_stderr``) from the window means (``<name>_windows``
    of them: see :mod:`quantlab.uncertainty`; 0 for one window), with each
    window's article given, cluster-robust over them (``<name>_articles``:
    the unit), the per-token one as ``<name>_ln_stderr_tokens`` (a narrower,
    secondary figure)."""
    out = {name: math.exp(float(nll.mean())), f"{name}_ln_stderr": unit_stderr(nll, nll.shape[0]),
           f"{name}_ln_stderr_tokens": mean_stderr(nll.ravel()), f"{name}_windows": float(nll.shape[0])}
    if articles is not None:
        se, n = cluster_stderr(nll.mean(axis=1), articles[:nll.shape[0]])
        out.update({f"{name}_ln_stderr": se, f"{name}_articles": float(n)})
    return out


def loss_lower(nll: np.ndarray, ref: np.ndarray, articles: list | None, alpha: float) -> float:
    """One-sided ``1 - alpha`` lower bound of the loss 1 - PPL(ref) / PPL(point)
    from paired per-token NLLs ``[windows, window - 1]``: t on the window
    means, cluster-robust over ``articles`` where given; -inf with fewer
    than ``MIN_UNITS`` units."""
    pair = paired(nll.ravel(), ref.ravel(), tokens=True, windows=nll.shape[0], clusters=articles)
    if pair.units < MIN_UNITS:
        return -math.inf
    return 1.0 - math.exp(-(pair.diff - quantile(alpha, pair.units) * pair.stderr))


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
                 alpha: float, score_all: bool = False, progress: Callable[[str], None] = lambda _: None,
                 articles: Sequence | None = None) -> Stopped:
    """Score ``wins`` (the cap, in their random draw order) ``chunk`` windows
    a look, the first look at ``MIN_UNITS`` windows; after each look, bound
    the loss ``1 - PPL(reference) / PPL(point)`` on the windows so far
    (paired per-token NLL differences against ``ref_nll``, t on window means,
    cluster-robust over the windows' ``articles`` where given, each look at
    its share of ``alpha``: :mod:`quantlab.sequential`) and stop once every
    budget is decided. ``score_all``: score the cap whatever the
    bounds say (the sweep's baseline candidates: every other point is paired
    against their tokens)."""
    cap = len(wins)
    looks = sequential.schedule(cap, chunk, MIN_UNITS)
    parts, run_lo, run_hi, before = [], -math.inf, math.inf, 0
    for n, level in zip(looks, sequential.levels(alpha, looks, cap)):
        parts.append(token_nll(engine, wins[before:n]))
        before = n
        nll = np.concatenate(parts)
        diffs = (nll - ref_nll[:n]).ravel()
        d_lo, d_hi = sequential.mean_bounds(diffs, n, level, None if articles is None else articles[:n])
        run_lo, run_hi = max(run_lo, decision.relative(d_lo)), min(run_hi, decision.relative(d_hi))
        lo, hi = sequential.effective(run_lo, run_hi, decision.relative(float(diffs.mean())))
        progress(f"{n}/{cap} windows: loss against the reference in [{lo:.4f}, {hi:.4f}] (level {level:.2g})")
        if n < cap and not score_all and sequential.decided(lo, hi, budgets):
            within = [f"{b:g}" for b in budgets if hi <= b]
            return Stopped(nll, f"decided at {n} of {cap} windows: within {', '.join(within) or 'none'} of "
                                f"budgets {', '.join(f'{b:g}' for b in budgets)}", lo, hi)
    return Stopped(np.concatenate(parts), "baseline candidate: scored the cap" if score_all
                   else f"cap of {cap} windows reached", lo, hi)
