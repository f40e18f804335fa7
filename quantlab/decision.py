"""What a point loses against the sweep's baseline, with a pessimistic bound.

The decision metric's loss is relative and oriented so that 0 means nothing
lost: ``1 - point / baseline`` for accuracies, ``1 - PPL(baseline) / PPL(point)``
for perplexities (both as llm-compressor's recovery), ``1 - agreement`` for
top-1 agreement with the reference, and the value itself for KL divergence.

Where both runs logged their per-item values (``items.json``: token NLLs,
0/1 document scores) the loss comes from the *paired* differences on the same
items, and its upper bound is the loss at the 95 % end of that difference
(``quantlab.uncertainty``). A budget decision uses that upper bound, so noise
can never qualify a point. Without per-item values the bound equals the
estimate and the loss is marked unbounded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from quantlab.uncertainty import Z, Paired, paired

HIGHER_IS_BETTER = ("acc/", "acc_norm/", "exact_match/")
LOWER_IS_BETTER = ("ppl_token_wikitext2_w", "perplexity/", "word_perplexity/", "byte_perplexity/",
                   "bits_per_byte/")
KL = ("fid/kl", "kvfid/kl")


@dataclass(frozen=True)
class Loss:
    value: float
    upper: float  # 95 % pessimistic bound; == value when unbounded
    bounded: bool


def base_metric(metric: str) -> str:
    """``recovery/acc/x`` and ``acc/x`` name the same decision."""
    return metric.removeprefix("recovery/")


def compare(metric: str, items: dict, base_items: dict) -> Paired | None:
    """Paired ``point - baseline`` on ``metric``'s items (token NLL for
    perplexities, 0/1 for accuracies), or None when either run lacks them or
    they were not measured on the same items."""
    a, b = items.get(metric), base_items.get(metric)
    if not a or not b or len(a) != len(b):
        return None
    task = metric.partition("/")[2]
    if task and items.get(f"doc_ids/{task}") != base_items.get(f"doc_ids/{task}"):
        return None
    return paired(a, b, binary=metric.startswith(HIGHER_IS_BETTER))


def loss(metric: str, metrics: dict, items: dict, base_metrics: dict, base_items: dict) -> Loss | None:
    """The point's loss on ``metric`` against the baseline; None if unmeasured."""
    metric = base_metric(metric)
    v = metrics.get(metric)
    if v is None:
        return None
    if metric.startswith(KL):
        se = metrics.get(f"{metric}_stderr")
        return Loss(v, v + Z * se if se is not None else v, se is not None)
    if metric == "fid/top1_agree":
        se = metrics.get("fid/top1_agree_stderr")
        return Loss(max(0.0, 1 - v), max(0.0, 1 - v + Z * (se or 0.0)), se is not None)
    b = base_metrics.get(metric)
    if b is None or b <= 0 or v <= 0:
        return None
    pair = compare(metric, items, base_items)
    if metric.startswith(LOWER_IS_BETTER):
        if pair is None:
            est = 1 - b / v
            return Loss(max(0.0, est), max(0.0, est), False)
        # per-token NLL difference: its mean is ln(PPL(point) / PPL(base))
        return Loss(max(0.0, 1 - math.exp(-pair.diff)), max(0.0, 1 - math.exp(-(pair.diff + Z * pair.stderr))), True)
    if metric.startswith(HIGHER_IS_BETTER):
        if pair is None:
            est = 1 - v / b
            return Loss(max(0.0, est), max(0.0, est), False)
        return Loss(max(0.0, -pair.diff / b), max(0.0, (-pair.diff + Z * pair.stderr) / b), True)
    return None
