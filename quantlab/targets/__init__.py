"""Targets: where a point runs. ``get(cfg)`` picks the implementation by config type.

A target answers ``supports(weights, kv)`` before anything is loaded (so an
impossible point is recorded as skipped, not crashed) and ``engine(model, kv)``
turns the quantized model into the engine the probes talk to. A new runtime is
its config dataclass (importable without torch, so a bad value is refused at
compose time; ``MODULE`` names the module that defines its target and calls
:func:`register`), an entry point in the ``quantlab.targets`` group naming the
config, and a preset under ``conf/target/`` (docs/guides/targets.md); quantlab's
own are declared in its pyproject.toml the same way.

This package imports only the standard library at start: the Neuron worker
(``quantlab.targets.neuron_worker``) runs under an interpreter without
quantlab's dependencies.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

_TARGETS: dict[type, type] = {}


def register(config_type: type, target_cls: type) -> None:
    """Make ``target_cls(cfg)`` the target of configs of ``config_type``."""
    _TARGETS[config_type] = target_cls


def declared() -> dict[str, type]:
    """Target name -> config dataclass of every ``quantlab.targets`` entry
    point, without loading a target (no torch); a config whose ``name``
    default differs from its entry point's name is refused."""
    return dict(_declared())


@functools.cache
def _declared() -> dict[str, type]:
    """The entry points, read once per process (as the schemes' are)."""
    from quantlab import plugins

    found = plugins.load(plugins.TARGETS)
    for name, cls in found.items():
        if getattr(cls, "name", None) != name:
            raise plugins.bad_name(plugins.TARGETS, name, f"its config's name default ({getattr(cls, 'name', None)!r})")
    return found


def config_types() -> list[type]:
    """Every target config dataclass (stored in Hydra's ConfigStore): the
    declared ones and any registered in this process."""
    found = list(declared().values())
    return [*found, *(t for t in _TARGETS if t not in found)]


def registered() -> list[type]:
    """The config types registered once every declared target's module is
    imported; equal to :func:`config_types` (a test holds them so)."""
    for cls in declared().values():
        importlib.import_module(cls.MODULE)
    return list(_TARGETS)


def get(cfg: Any):
    if type(cfg) not in _TARGETS and getattr(cfg, "MODULE", ""):
        importlib.import_module(cfg.MODULE)
    try:
        cls = _TARGETS[type(cfg)]
    except KeyError:
        known = ", ".join(sorted(t.__name__ for t in _TARGETS))
        raise TypeError(f"no target for {type(cfg).__name__} (its MODULE {getattr(cfg, 'MODULE', '') or 'is not set'} "
                        f"registered none); loaded: {known}") from None
    return cls(cfg)
