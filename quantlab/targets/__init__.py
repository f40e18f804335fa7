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
