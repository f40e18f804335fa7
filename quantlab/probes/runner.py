"""Runs a point's probes in order: each one timed as its own stage, skipped
with a tag when its data is missing, watched for other work on the cores when
its figures are timings, and its result merged into the point's Measurement.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

from quantlab import contention, plugins, point
from quantlab.config import RunConfig
from quantlab.errors import UserError
from quantlab.measurement import TIME_PREFIX, Measurement
from quantlab.probes.base import Probe, ProbeContext

log = logging.getLogger("quantlab")


@functools.cache
def registered() -> tuple[Probe, ...]:
    """One instance of every probe registered under ``quantlab.probes``, in
    run order (``order``, then name)."""
    probes = [cls() for cls in plugins.load(plugins.PROBES).values()]
    return tuple(sorted(probes, key=lambda p: (p.order, p.name)))


def run(ctx_fields: dict, m: Measurement, probes: tuple[Probe, ...] | None = None) -> None:
    """Every enabled probe of ``probes`` (default :func:`registered`) on one
    point; ``ctx_fields`` build each probe's :class:`ProbeContext` (it sees
    what the probes before it measured). Each is timed as ``time/<name>_s``,
    less the sub-stages it timed itself (those keep their own names). A
    probe's exception other than a UserError propagates (the point fails;
    what earlier probes returned stays in ``m``)."""
    cfg: RunConfig = ctx_fields["cfg"]
    for probe in registered() if probes is None else probes:
        if not probe.enabled(cfg):
            continue
        ctx = ProbeContext.of(m, **ctx_fields)
        result = None
        with m.timed(probe.name), _optional(probe.name, ctx.name, m):
            before = contention.snapshot() if probe.contention_metric else None
            result = probe.run(ctx)
            if before is not None:
                _contention(probe, cfg, ctx.name, contention.foreign_cores(before, contention.snapshot()), result, m)
        if result is None:
            continue
        # its sub-stages (time/<stage>_s it timed itself) are stages of their own, not also its
        m.metrics[f"{TIME_PREFIX}{probe.name}_s"] -= sum(v for k, v in result.metrics.items()
                                                         if k.startswith(TIME_PREFIX))
        m.metrics.update(result.metrics)
        m.tags.update(result.tags)
        m.items.update(result.items)
        m.artifacts.update(result.artifacts)
        m.params.update(result.params)


@contextlib.contextmanager
def _optional(probe: str, name: str, m: Measurement):
    """A probe whose data is missing (UserError) is skipped with a
    ``probe.<probe>.skipped`` tag naming what it expected; the point goes on."""
    try:
        yield
    except UserError as e:
        log.warning("[%s] %s probe skipped: %s", name, probe, e)
        m.tags[f"probe.{probe}.skipped"] = str(e)


def _contention(probe: Probe, cfg: RunConfig, name: str, foreign: float, result, m: Measurement) -> None:
    """Cores other processes used while a timing probe ran: a metric, and past
    ``probe.latency.contention_warn`` a warning and the contended tag the
    report marks (†)."""
    result.metrics[probe.contention_metric] = foreign
    if foreign <= cfg.probe.latency.contention_warn:
        return
    cores = os.cpu_count() or 1
    log.warning("[%s] other processes used %.2f of %d cores while its %s probe ran: its figures are inflated and "
                "the report marks them", name, foreign, cores, probe.name)
    was = m.tags.get(point.CONTENDED_TAG)
    result.tags[point.CONTENDED_TAG] = (was + "; " if was else "") + \
        f"{probe.name} timed beside {foreign:.2f} cores of other work ({cores} cores)"
