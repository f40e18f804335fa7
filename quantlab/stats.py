"""Summary statistics for latency samples."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize(prefix: str, samples_ms: Sequence[float]) -> dict[str, float]:
    """``{prefix}_mean``, ``_p50``, ``_p90``, ``_p99`` and ``_count`` of the samples.

    Percentiles use linear interpolation between order statistics (numpy's
    default), the convention of optimum-benchmark and most load tools.
    """
    if len(samples_ms) == 0:
        raise ValueError(f"no samples for {prefix}")
    a = np.asarray(samples_ms, dtype=np.float64)
    out = {f"{prefix}_mean": float(a.mean()), f"{prefix}_count": float(a.size)}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}"] = float(np.percentile(a, p))
    return out
