"""The load probe's knee: the capacity a point offers under its SLOs.

The rates of one policy are walked from the lowest offered rate up; a rate
passes when it ended normally, kept up (achieved >= ``KEEP_UP`` x the
realized arrival rate), completed at least ``P90_MIN`` requests, and its
tail percentile of TTFT and of per-request TPOT each met its SLO (an SLO
left unset is not checked). The knee is the highest *achieved* rate among
the rates that passed in a row from the lowest, so pass / fail / pass stops
at the first failure instead of returning the last pass, and it is the rate
the server sustained, not the one the generator aimed at (a Poisson draw of
2 req/s over 8 s has a realized rate with sd ~24 %).

The tail percentile is P99 when every rate completed at least ``P99_MIN``
requests (below that numpy's P99 interpolates into the sample maximum), else
P90; the percentile used is logged. The pessimistic bound resamples each
rate's completed requests and walks the rates again: its ``alpha`` quantile
is the capacity a report can promise at that level, as the loss rule uses
the upper bound of a loss. Requests that follow each other share a queue (a
slow one delays the next), so the resampling is a circular moving-block
bootstrap (Kunsch 1989; blocks of ``ceil(n ** (1/3))`` consecutive
requests, ``BOOT`` draws), not one of independent requests. Where the
probe picks the best of several policies by this bound, each policy's bound
is taken at ``alpha / policies`` (Bonferroni), so the one picked still holds
at ``alpha``. The achieved rates themselves are not resampled: they are what
the server did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from quantlab import uncertainty
from quantlab.serving.requests import Request

P99_MIN = 100  # completed requests per rate for a P99 that is not the sample maximum
P90_MIN = 10
KEEP_UP = 0.9
BOOT = 1000


@dataclass(frozen=True)
class Knee:
    rps: float  # highest achieved rate of the rates that passed in a row from the lowest; 0 if the lowest failed
    lower: float  # its one-sided 1 - alpha lower bound (moving-block bootstrap over each rate's requests)
    percentile: int  # the tail percentile judged against the SLOs: 99 or 90
    passed: int  # rates passed in a row from the lowest
    why: str  # why the next rate failed ('' when every rate passed)


def latencies(requests: list[Request]) -> tuple[np.ndarray, np.ndarray]:
    """TTFT (ms) of each completed request, and its TPOT (ms: (last - first
    token) / (tokens - 1), for those with two tokens or more)."""
    done = [r for r in requests if r.done]
    ttft = np.array([(r.tokens_s[0] - r.sent_s) * 1e3 for r in done])
    tpot = np.array([(r.tokens_s[-1] - r.tokens_s[0]) * 1e3 / (len(r.tokens_s) - 1)
                     for r in done if len(r.tokens_s) > 1])
    return ttft, tpot


def _fails(row: dict, ttft: np.ndarray, tpot: np.ndarray, q: int, slo_ttft_ms, slo_tpot_ms) -> str:
    if row["stopped"]:
        return f"stopped ({row['stopped']})"
    if row["achieved_rps"] < KEEP_UP * row["sent_rps"]:
        return f"fell behind (achieved {row['achieved_rps']:.3g} of {row['sent_rps']:.3g} sent)"
    if ttft.size < P90_MIN:
        return f"{ttft.size} completed (< {P90_MIN} for a P90)"
    if slo_ttft_ms is not None and (v := np.percentile(ttft, q)) > slo_ttft_ms:
        return f"TTFT P{q} {v:.0f} ms > {slo_ttft_ms:g}"
    if slo_tpot_ms is not None and tpot.size and (v := np.percentile(tpot, q)) > slo_tpot_ms:
        return f"TPOT P{q} {v:.1f} ms > {slo_tpot_ms:g}"
    return ""


def block_resample(rng: np.random.Generator, a: np.ndarray) -> np.ndarray:
    """A circular moving-block bootstrap draw of ``a`` (in arrival order):
    blocks of ``ceil(n ** (1/3))`` consecutive values from random starts,
    wrapping at the end, cut to ``n``."""
    n = a.size
    if n == 0:
        return a
    b = max(1, math.ceil(n ** (1 / 3)))
    starts = rng.integers(0, n, math.ceil(n / b))
    return a[((starts[:, None] + np.arange(b)) % n).ravel()[:n]]


def find(rows: list[dict], samples: list[tuple[np.ndarray, np.ndarray]], slo_ttft_ms: float | None,
         slo_tpot_ms: float | None, seed: int = 0, boot: int = BOOT,
         alpha: float = 1 - uncertainty.LEVEL) -> Knee:
    """The knee of one policy's rates: ``rows`` (the load table's, any
    order) and ``samples[i]``, the :func:`latencies` of ``rows[i]``'s
    requests in arrival order; its lower bound one-sided at ``1 - alpha``."""
    if not rows:
        return Knee(0.0, 0.0, 90, 0, "no rates")
    order = sorted(range(len(rows)), key=lambda i: rows[i]["offered_rps"])
    q = 99 if min(rows[i]["completed"] for i in order) >= P99_MIN else 90

    def walk(draw: Callable[[int], tuple[np.ndarray, np.ndarray]]) -> tuple[float, int, str]:
        best, n = 0.0, 0
        for i in order:
            if why := _fails(rows[i], *draw(i), q, slo_ttft_ms, slo_tpot_ms):
                return best, n, f"{rows[i]['offered_rps']:.3g} req/s offered: {why}"
            best, n = max(best, rows[i]["achieved_rps"]), n + 1
        return best, n, ""

    rps, n, why = walk(lambda i: samples[i])
    rng = np.random.default_rng(seed)

    def resample(i: int) -> tuple[np.ndarray, np.ndarray]:
        return tuple(block_resample(rng, a) for a in samples[i])

    lower = float(np.quantile([walk(resample)[0] for _ in range(boot)], alpha)) if boot else rps
    return Knee(rps, min(lower, rps), q, n, why)
