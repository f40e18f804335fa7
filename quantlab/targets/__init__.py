"""Targets: where a point runs. ``get(cfg)`` picks the implementation by config type.

A target answers ``supports(weights, kv)`` before anything is loaded (so an
impossible point is recorded as skipped, not crashed) and ``compile(model)``
turns the quantized model into the runnable that the probes time.
"""
from __future__ import annotations

from quantlab.config import CPUTargetConfig, CUDATargetConfig, NeuronTargetConfig, TargetConfig
from quantlab.targets.base import Target


def get(cfg: TargetConfig) -> Target:
    from quantlab.targets.cpu import CPUTarget
    from quantlab.targets.cuda import CUDATarget
    from quantlab.targets.neuron import NeuronTarget

    table = {CPUTargetConfig: CPUTarget, CUDATargetConfig: CUDATarget, NeuronTargetConfig: NeuronTarget}
    try:
        return table[type(cfg)](cfg)
    except KeyError:
        raise TypeError(f"no target for {type(cfg).__name__}") from None


def label(cfg: TargetConfig) -> str:
    """The target part of a run name: ``cpu``, ``cpu+compile``, ``cuda+graphs+static``.
    A pure function of the config (no validation), so a bad option still names its run."""
    parts = [cfg.name]
    if isinstance(cfg, (CPUTargetConfig, CUDATargetConfig)):
        if cfg.compile:
            mode = cfg.compile_mode
            parts.append("graphs" if mode == "reduce-overhead" else "compile" if mode == "default"
                         else f"compile-{mode}")
        if cfg.static_cache:
            parts.append("static")
    return "+".join(parts)
