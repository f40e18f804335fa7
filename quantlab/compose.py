"""Every config type in one place: Hydra's ConfigStore, and a :class:`RunConfig`
to and from the plain dict a run logs (``config.yaml``).

:mod:`quantlab.config` holds the schemas and imports nothing else of quantlab;
the polymorphic slots (weight scheme, KV scheme, target) are filled by types
that live beside their scheme or target, so the code that knows all of them
is here, above both registries.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from quantlab import targets
from quantlab.config import DecisionConfig, ModelConfig, ReferenceConfig, RunConfig, SchemeConfig
from quantlab.probes.configs import ProbeConfig
from quantlab.tracking_config import TrackingConfig
from quantlab.schemes import registry

_PLAIN = ("model", "reference", "probe", "tracking", "decision")  # dataclass slots: their fields alone
_POLY = ("scheme", "target")  # polymorphic slots: their type name under "type"


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore, and register the resolvers
    the presets use (``${quantlab_cores:}``: this machine's CPU count, the
    Ray preset's cores per point); idempotent."""
    if not OmegaConf.has_resolver("quantlab_cores"):
        OmegaConf.register_new_resolver("quantlab_cores", lambda: os.cpu_count() or 1)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    declared = _groups()
    # targets with those registered in this process only (tests' fakes: a schema, no preset of their own)
    for group, table in {**declared, "target": {t.name: t for t in targets.config_types()}}.items():
        for name, node in table.items():
            cs.store(group=group, name=f"_{name}", node=node)
            if name in declared[group] and not _ours(node):  # a plugin's own preset: target=<name>, ...
                cs.store(group=group, name=name, node=node)
    cs.store(group="model", name="_model", node=ModelConfig)
    cs.store(group="probe", name="_probe", node=ProbeConfig)
    cs.store(group="tracking", name="_tracking", node=TrackingConfig)


def _groups() -> dict[str, dict[str, type]]:
    """Config group -> name -> config dataclass of every scheme and target an entry point declares."""
    return {"scheme/weights": registry.weight_schemas(), "scheme/kv": registry.kv_schemas(),
            "target": targets.declared()}


def _ours(node: type) -> bool:
    """quantlab's own configs have presets under conf/ (their schema is ``_<name>``)."""
    return node.__module__.split(".")[0] == "quantlab"


def plugin_presets(group: str) -> list[str]:
    """The names a plugin's schemes or targets are composed by in ``group``
    (each its own preset, beside the YAML presets under conf/)."""
    return [name for name, node in _groups().get(group, {}).items() if not _ours(node)]


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain-dict form of the config; polymorphic slots carry their type name.
    :func:`config_from_dict` is its inverse for every registered scheme and target."""
    d = dataclasses.asdict(cfg)
    d["scheme"] = {"weights": cfg.scheme.weights.to_dict(), "kv": cfg.scheme.kv.to_dict()}
    d["target"] = {"type": type(cfg.target).__name__, **dataclasses.asdict(cfg.target)}
    return d


def config_types() -> dict[str, type]:
    """Type name -> config dataclass of every scheme and target."""
    return {t.__name__: t for t in (*registry.weight_schemas().values(), *registry.kv_schemas().values(),
                                    *targets.config_types())}


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Inverse of :func:`config_dict`. An unknown type name (a config logged by
    a quantlab that had a target or scheme this one lacks) is one ValueError
    naming it and the known ones."""
    types = config_types()

    def poly(node: dict):
        node = dict(node)
        name = node.pop("type")
        if name not in types:
            raise ValueError(f"config type {name!r} is unknown to this quantlab; known: {', '.join(sorted(types))}")
        return types[name](**node)

    def typed(cls, node: dict):
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))

    rest = {k: v for k, v in d.items() if k not in _PLAIN + _POLY}
    return RunConfig(model=typed(ModelConfig, d["model"]), reference=typed(ReferenceConfig, d.get("reference", {})),
                     scheme=SchemeConfig(weights=poly(d["scheme"]["weights"]), kv=poly(d["scheme"]["kv"])),
                     target=poly(d["target"]), probe=typed(ProbeConfig, d["probe"]),
                     tracking=typed(TrackingConfig, d["tracking"]),
                     decision=typed(DecisionConfig, d.get("decision", {})), **rest)
