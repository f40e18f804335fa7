"""Targets: where a point runs. ``get(cfg)`` picks the implementation by config type.

A target answers ``supports(weights, kv)`` before anything is loaded (so an
impossible point is recorded as skipped, not crashed) and ``engine(model, kv)``
turns the quantized model into the engine the probes talk to. A new runtime is
its config dataclass (``targets/configs.py``, importable without torch, so a
bad value is refused at compose time), one module that defines its target and
calls :func:`register`, and its YAML preset under ``conf/target/``.

This package imports only the standard library at start: the Neuron worker
(``quantlab.targets.neuron_worker``) runs under an interpreter without
quantlab's dependencies.
"""
from __future__ import annotations

import importlib
from typing import Any

_MODULES = ("quantlab.targets.cpu", "quantlab.targets.cuda", "quantlab.targets.neuron",
            "quantlab.targets.llamacpp", "quantlab.targets.vllm")
_TARGETS: dict[type, type] = {}


def register(config_type: type, target_cls: type) -> None:
    """Make ``target_cls(cfg)`` the target of configs of ``config_type``."""
    _TARGETS[config_type] = target_cls


def _load() -> None:
    for mod in _MODULES:
        importlib.import_module(mod)


def config_types() -> list[type]:
    """Every target config dataclass (stored in Hydra's ConfigStore) without
    loading a target (no torch): quantlab's own
    (:data:`quantlab.targets.configs.CONFIGS`) and any a plugin registered."""
    from quantlab.targets.configs import CONFIGS

    return [*CONFIGS, *(t for t in _TARGETS if t not in CONFIGS)]


def registered() -> list[type]:
    """The config types the target modules registered (loading them); equal
    to :func:`config_types` (a test holds them so)."""
    _load()
    return list(_TARGETS)


def get(cfg: Any):
    _load()
    try:
        cls = _TARGETS[type(cfg)]
    except KeyError:
        known = ", ".join(sorted(t.__name__ for t in _TARGETS))
        raise TypeError(f"no target for {type(cfg).__name__}; known: {known}") from None
    return cls(cfg)
