"""Hydra sweeper plugin: Hydra's basic grid, plus explicit extra points.

A grid crosses every value of every key; some comparisons need a point off the
grid (the headline sweep's int4 weights *with* an INT8 KV cache, without
crossing every weight scheme with every cache). ``hydra.sweeper.points`` lists
such points as override strings; each runs like a grid job (same command-line
overrides) with its own keys replacing the grid's. Plugins must live in the
``hydra_plugins`` namespace package for Hydra to load them.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional  # Hydra's scanner runs this module outside sys.modules:
# no `from __future__ import annotations`, and OmegaConf reads these types

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore


@dataclass
class QuantlabSweeperConf:
    _target_: str = "hydra_plugins.quantlab_sweeper.QuantlabSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None
    points: List[str] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/sweeper", name="quantlab", node=QuantlabSweeperConf,
                             provider="quantlab")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def with_points(jobs: List[List[str]], points: List[str]) -> List[List[str]]:
    """The grid's jobs, then one job per extra point: the first grid job with the
    point's overrides replacing (or adding) their keys. Duplicates of a grid job
    are dropped."""
    out = list(jobs)
    base = jobs[0] if jobs else []
    for point in points:
        extra = point.split()
        keys = {_key(o) for o in extra}
        job = [o for o in base if _key(o) not in keys] + extra
        if sorted(job) not in (sorted(j) for j in out):
            out.append(job)
    return out


class QuantlabSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Optional[int], params: Optional[Dict[str, str]] = None,
                 points: Optional[List[str]] = None) -> None:
        super().__init__(max_batch_size, params)
        self.points = list(points or [])

    def split_arguments(self, overrides, max_batch_size):  # BasicSweeper calls it through self
        batches = BasicSweeper.split_arguments(overrides, None)
        jobs = with_points(batches[0], self.points)
        n = max_batch_size or len(jobs)
        return [jobs[i:i + n] for i in range(0, len(jobs), n)]
