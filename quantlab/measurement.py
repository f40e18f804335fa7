"""What one sweep point measured: probes fill it, one step logs it."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

TIME_PREFIX = "time/"  # time/<stage>_s: wall seconds a point spent in one stage


def weight_bytes_read(metrics: dict[str, float]) -> float:
    """Weight bytes one decode step reads: the runtime's own where it stores
    them differently (llama.cpp's blocks), less the rows of an untied embedding
    table a step does not read."""
    return metrics.get("size/runtime_weight_bytes", metrics["size/weight_bytes"]) \
        - metrics.get("size/embedding_unread_bytes", 0.0)


@dataclass
class Measurement:
    """Metrics, tags and artifacts (name -> content) of one point.

    Probes and the pipeline only add to it; ``tracking.Run.log_measurement`` writes
    it to the point's run once, at the end (also when the point failed half-way:
    what was measured before the failure is kept)."""

    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, str | bytes] = field(default_factory=dict)  # bytes: a binary file (PNG)
    params: dict[str, str] = field(default_factory=dict)  # known only once measured (bits per weight)
    # per-item values behind a metric (token NLLs, 0/1 document scores), logged
    # as items.json so that two points can be compared paired (quantlab.uncertainty)
    items: dict[str, list[float]] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, stage: str):
        """Adds the block's wall seconds to ``time/<stage>_s`` (also when it
        raises: a failed point shows where its time went)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"{TIME_PREFIX}{stage}_s"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - start
