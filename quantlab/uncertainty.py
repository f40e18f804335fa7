"""Standard errors and paired tests for the figures a decision rests on.

Conventions (those of lm-eval and llama.cpp's ``--kl-divergence``):
- the standard error of a mean is the sample standard deviation (``ddof=1``)
  over sqrt(n); for 0/1 outcomes that is lm-eval's ``acc_stderr``;
- two points evaluated on the same items are compared *paired*: the mean of
  the per-item differences and its standard error, and for 0/1 outcomes the
  exact McNemar test on the discordant items;
- intervals are normal, at ``Z`` = 1.96 (95 % two-sided).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z = 1.96
ALPHA = 0.05


def mean_stderr(x: Sequence[float] | np.ndarray) -> float:
    """Standard error of the mean; 0 for fewer than two items."""
    a = np.asarray(x, dtype=np.float64)
    return float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else 0.0


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for ``b`` items only the first point got
    right and ``c`` only the second got right (binomial test of b vs c at 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class Paired:
    """``point - baseline`` over the same items."""

    diff: float  # mean of the per-item differences
    stderr: float  # its standard error
    n: int
    p_value: float  # McNemar for 0/1 items, normal approximation otherwise

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA


def paired(point: Sequence[float], base: Sequence[float], binary: bool = False) -> Paired:
    """Paired comparison of per-item values (same items, same order)."""
    a, b = np.asarray(point, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired comparison needs equal, non-empty item lists ({a.size} vs {b.size})")
    d = a - b
    se = mean_stderr(d)
    if binary:
        p = mcnemar_p(int(((a > 0.5) & (b < 0.5)).sum()), int(((a < 0.5) & (b > 0.5)).sum()))
    elif se == 0.0:
        p = 1.0 if d.mean() == 0.0 else 0.0
    else:
        p = math.erfc(abs(d.mean() / se) / math.sqrt(2.0))
    return Paired(float(d.mean()), se, int(a.size), p)
