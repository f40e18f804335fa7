"""KL divergence per position: the one computation every fidelity figure uses
(the fidelity probe, the KV-cache probe, the sensitivity table, both export
round trips)."""
from __future__ import annotations

import torch


def kl_per_token(ref: torch.Tensor, other: torch.Tensor, logits: bool = True) -> torch.Tensor:
    """``KL(ref || other)`` per position over the last axis (``[..., V]`` ->
    ``[...]``), in float64.

    ``logits=True``: the inputs are logits, normalised here with
    ``log_softmax`` in float64. ``logits=False``: they are log-probabilities
    already and are used as they are (no second normalisation, so a probe's
    figures are those of its own log-softmax). Rounding can make a value a
    hair below zero; it is clamped to 0, so identical inputs give exactly 0."""
    if ref.shape != other.shape:
        raise ValueError(f"KL of {tuple(ref.shape)} against {tuple(other.shape)}: shapes differ")
    p, q = ref.double(), other.double()
    if logits:
        p, q = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)
