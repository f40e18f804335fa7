"""A point's run as the report, the serving section, the scaling section and
the Python API read it: quantlab's own record, not MLflow's ``Run``
(standard library only). The tracker's runs become records once, where a
report reads a store (:func:`of`); everything downstream reads ``name``,
``metrics``, ``tags`` and ``params`` and never MLflow's data shapes.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from quantlab.point import OUTCOME_TAG, REUSED_FROM_TAG

DONE = ("finished", "reused")  # outcomes whose metrics count


@dataclass(frozen=True)
class PointRecord:
    """One run: ``id`` (the run's), ``name`` (``int8@cpu``), ``status``
    (FINISHED, FAILED, KILLED, RUNNING), ``start_time`` (ms since the epoch)
    and what it logged."""

    id: str
    name: str
    status: str = "FINISHED"
    start_time: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """The point was measured (here or, for a reused point's light run, earlier)."""
        return self.tags.get(OUTCOME_TAG) in DONE

    @property
    def origin(self) -> str:
        """The id of the run that measured this point (itself unless reused)."""
        return self.tags.get(REUSED_FROM_TAG, self.id)


def of(run) -> PointRecord:
    """The record of an MLflow ``Run`` (its info and data, copied)."""
    return PointRecord(run.info.run_id, run.info.run_name, run.info.status, run.info.start_time or 0,
                       dict(run.data.metrics), dict(run.data.tags), dict(run.data.params))
