"""What one sweep point measured: probes fill it, one step logs it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Measurement:
    """Metrics, tags and artifacts (name -> content) of one point.

    Probes and the pipeline only add to it; ``tracking.log_measurement`` writes
    it to the point's run once, at the end (also when the point failed half-way:
    what was measured before the failure is kept)."""

    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, str | bytes] = field(default_factory=dict)  # bytes: a binary file (PNG)
    params: dict[str, str] = field(default_factory=dict)  # known only once measured (bits per weight)
    # per-item values behind a metric (token NLLs, 0/1 document scores), logged
    # as items.json so that two points can be compared paired (quantlab.uncertainty)
    items: dict[str, list[float]] = field(default_factory=dict)
