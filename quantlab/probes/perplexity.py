"""Token-level WikiText-2 perplexity over fixed non-overlapping windows.

This is the number GPTQ-style papers report: the test split's rows joined with
"\\n\\n", tokenized once, cut into ``window``-token windows (the tail shorter
than a window is dropped), each window scored on its own with no context from
the previous one. Reported as ``ppl_token_wikitext2_w<window>``; not comparable
to lm-eval's word-level ``word_perplexity/wikitext2_local``.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from quantlab.errors import UserError


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


def windows(ids: torch.Tensor, window: int, max_windows: int | None) -> torch.Tensor:
    """``[n, window]`` non-overlapping windows from the start of ``ids: [T]``."""
    n = ids.numel() // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {window}")
    return ids[: n * window].reshape(n, window)


@torch.inference_mode()
def token_perplexity(engine, wins: torch.Tensor) -> dict[str, float]:
    """exp(mean NLL) over every predicted token of every window (window-1 per window)."""
    nll, count = 0.0, 0
    for row in wins:
        logits = engine.logits(row[None])[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = row[1:].to(logp.device)
        nll -= logp.gather(-1, target[:, None]).sum().item()
        count += target.numel()
    window = wins.shape[1]
    return {f"ppl_token_wikitext2_w{window}": math.exp(nll / count),
            f"ppl_token_wikitext2_w{window}_windows": float(wins.shape[0])}
