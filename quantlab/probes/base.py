"""The probe contract: what a probe is given and what it returns.

A probe is a class registered under the ``quantlab.probes`` entry-point group
(quantlab's own are declared in pyproject.toml like anyone else's):

    class MyProbe:
        name = "myprobe"        # its stage (time/myprobe_s) and skip tag (probe.myprobe.skipped)
        order = 100             # where it runs among the others (quantlab's: 10 to 60)
        contention_metric = None  # a metric name: its figures are timings; the runner watches other work

        def enabled(self, cfg: RunConfig) -> bool: ...
        def run(self, ctx: ProbeContext) -> ProbeResult: ...

``run`` reads the point through ``ctx`` (config, engine, tokenizer, the
in-memory model, what earlier probes measured) and returns what it measured;
it never writes to the tracking store. A UserError (its data is missing)
skips it with a tag; any other exception fails the point, keeping what earlier
probes measured (:mod:`quantlab.probes.runner`). Settings of a probe quantlab
does not know live under ``probe.plugins.<name>`` (part of the point's hash).
"""
from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from quantlab.config import RunConfig
from quantlab.measurement import Measurement, weight_bytes_read

log = logging.getLogger("quantlab")


class ProbeResult(Measurement):
    """What one probe measured: metrics, tags, items (per-unit values behind
    a metric, for paired comparisons), artifacts; ``timed(stage)`` for a
    sub-stage of its own."""


class Probe(Protocol):
    name: str
    order: int
    contention_metric: str | None

    def enabled(self, cfg: RunConfig) -> bool: ...

    def run(self, ctx: ProbeContext) -> ProbeResult: ...


@dataclass(frozen=True)
class ProbeContext:
    """One point, as its probes see it. ``metrics``/``tags``: read-only views
    of what was measured before this probe (model bytes, earlier probes)."""

    cfg: RunConfig
    name: str  # the point's run name, for log lines
    engine: Any  # quantlab.engines.base.Engine
    tokenizer: Any
    model: Any  # the in-memory point (torch.nn.Module), quantized
    serves_export: bool  # the engine runs an exported artifact, not ``model`` itself
    metrics: Mapping[str, float]
    tags: Mapping[str, str]

    @classmethod
    def of(cls, measured: Measurement, **fields) -> ProbeContext:
        return cls(metrics=types.MappingProxyType(measured.metrics), tags=types.MappingProxyType(measured.tags),
                   **fields)

    def log(self, message: str, *args) -> None:
        """One progress line, prefixed with the point's name."""
        log.info("[%s] " + message, self.name, *args)

    def settings(self, probe: str) -> Any:
        """``probe.plugins.<probe>`` of the config: the settings dataclass
        its probe declares (``quantlab.probe_specs``), filled and checked;
        a dict (empty when not given) where it declares none."""
        from quantlab.probes.configs import plugin_settings

        return plugin_settings(probe, self.cfg.probe.plugins.get(probe) or {})

    def reference_model(self):
        """The model config the accuracy probes compare against: ``reference``
        where given (an artifact's float original), else the point's model."""
        return self.cfg.reference.model(self.cfg.model)

    def reference_key(self) -> dict:
        """What identifies the reference model in its caches: the model and the reference precision."""
        return {"model": dataclasses.asdict(self.reference_model()), "dtype": self.cfg.probe.fidelity.reference_dtype}

    def reference_engine(self):
        """The unquantized model at the fidelity probe's reference precision,
        as an engine. A separate reference must tokenize as the point does
        (``UserError`` in one line otherwise: its log-probabilities would
        be over other tokens)."""
        import torch

        from quantlab import models
        from quantlab.engines.pytorch import TorchEngine
        from quantlab.errors import UserError

        dtype = getattr(torch, self.cfg.probe.fidelity.reference_dtype)
        model, tok = models.load(self.reference_model(), self.cfg.cache_dir, dtype)
        if self.cfg.reference.given and tok.get_vocab() != self.tokenizer.get_vocab():
            raise UserError(f"reference {self.reference_model().name} tokenizes differently from the point's model "
                            f"({len(tok.get_vocab())} against {len(self.tokenizer.get_vocab())} tokens): not its "
                            "original")
        return TorchEngine(model)

    def identical_to_reference(self) -> bool:
        """The fidelity probe found the point's log-probabilities equal to the
        reference model's at every position (``fid/identical``, shown by its
        outputs): its scores are the reference's, so the adaptive probes take
        them from the reference's cache, filled by this point's engine on a
        miss (no second model loaded, nothing scored twice)."""
        return self.metrics.get("fid/identical") == 1.0

    def engine_for_reference(self):
        """What scores the reference's windows and documents on a cache miss:
        the point's own engine where it is identical to the reference, else
        the reference model (:meth:`reference_engine`, loaded now)."""
        return self.engine if self.identical_to_reference() else self.reference_engine()

    def baseline_candidate(self) -> bool:
        """A point the sweep may take as its baseline (float weights, or the
        ``recovery_baseline`` scheme): adaptive probes score its cap, since
        every other point is paired against its items."""
        return self.metrics.get("size/bits_per_weight", 0.0) >= 15.99 or \
            self.cfg.recovery_baseline == self.cfg.scheme.weights.short_name()

    def weight_bytes_read(self) -> float:
        """Weight bytes one decode step reads: the runtime's own where it
        stores them differently (llama.cpp's blocks), less the rows of an
        untied embedding table a step does not read."""
        return weight_bytes_read(self.metrics)
