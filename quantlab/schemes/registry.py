"""Scheme handlers keyed by config type (torchao's ``quantize_(model, config)`` shape).

A handler is two functions:

* ``support(cfg, hw) -> Support``: can hardware ``hw`` run ``cfg`` for real,
  only emulated (numerics right, latency not that of the scheme), or not at all
  (with the reason). Called before anything is loaded.
* ``apply(model, cfg, ctx) -> Applied``: quantize ``model`` in place and say
  which backend served it.

Plus, optionally, how other formats and runtimes represent the scheme
(``formats``: ``"checkpoint"`` for export, ``"neuron"``, ``"gguf"``, ``"vllm"``), each a
function ``cfg -> Mapping``; export and targets ask ``handler.mapping(name, cfg)``
(and ``handler.cannot_compile(cfg, device)``) instead of testing scheme types
or reading scheme fields: no code outside ``schemes/`` does either.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from quantlab.schemes import configs

if TYPE_CHECKING:  # annotations only: this module stays importable without torch (export's command line)
    import torch

    from quantlab.hardware import Hardware

_MODULES = (
    "quantlab.schemes.float",
    "quantlab.schemes.int8",
    "quantlab.schemes.int4",
    "quantlab.schemes.fp8",
    "quantlab.schemes.bnb4",
    "quantlab.schemes.gptq",
    "quantlab.schemes.awq",
    "quantlab.schemes.hqq",
    "quantlab.schemes.smoothquant",
    "quantlab.schemes.mixed",
    "quantlab.schemes.kv",
)


@dataclass(frozen=True)
class Support:
    status: Literal["real", "emulated", "unsupported"]
    reason: str = ""

    @property
    def runnable(self) -> bool:
        return self.status != "unsupported"


@dataclass
class ApplyContext:
    """What a handler may need beyond the model: hardware, calibration, caches."""

    hw: Hardware
    tokenizer: Any = None
    cache_dir: str = "~/.cache/quantlab"
    data_dir: str | None = None
    seed: int = 0


@dataclass
class Applied:
    backend: str
    emulated: bool
    cache_factory: Callable[..., Any] | None = None  # KV schemes: factory(config=...) -> Cache
    config: Any = None  # the scheme config that was applied
    tags: dict[str, str] = field(default_factory=dict)  # what the point's run should say about how (e.g. a fallback)


@dataclass(frozen=True)
class Mapping:
    """How format/runtime X represents a scheme: ``spec`` (X-specific fields), or
    ``reason`` (one line) why it cannot."""

    spec: dict[str, Any] | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.spec is not None


@dataclass(frozen=True)
class Handler:
    schema: str
    config_type: type
    support: Callable[[Any, Hardware], Support]
    apply: Callable[[torch.nn.Module, Any, ApplyContext], Applied]
    formats: dict[str, Callable[[Any], Mapping]] = field(default_factory=dict)
    # (cfg, device) -> '' or why torch.compile cannot run the scheme's kernels on that device
    compile_blocker: Callable[[Any, str], str] | None = None

    def cannot_compile(self, cfg: Any, device: str) -> str:
        """'' when torch.compile runs this scheme on ``device`` (``cpu``, ``cuda``), else why not."""
        return self.compile_blocker(cfg, device) if self.compile_blocker else ""

    def mapping(self, fmt: str, cfg: Any) -> Mapping:
        """``cfg`` in format ``fmt``; a scheme that registered no such mapping says so."""
        if fmt not in self.formats:
            return Mapping(reason=f"{cfg.short_name()} has no {fmt} representation")
        return self.formats[fmt](cfg)


_WEIGHTS: dict[type, Handler] = {}
_KV: dict[type, Handler] = {}


def register_weights(schema: str, config_type: type, support, apply, compile_blocker=None, **formats) -> None:
    """``formats``: keyword per format name (``checkpoint=``, ``neuron=``, ``gguf=``);
    ``compile_blocker(cfg, device)``: why torch.compile cannot run it there ('' when it can)."""
    _WEIGHTS[config_type] = Handler(schema, config_type, support, apply, formats, compile_blocker)


def register_kv(schema: str, config_type: type, support, apply, **formats) -> None:
    """``formats``: keyword per format name (``gguf=``: llama.cpp's cache type)."""
    _KV[config_type] = Handler(schema, config_type, support, apply, formats)


def _load() -> None:
    for mod in _MODULES:
        importlib.import_module(mod)


def weight_schemas() -> dict[str, type]:
    """Schema name -> config type, without loading a handler (no torch)."""
    return dict(configs.WEIGHT_SCHEMAS)


def kv_schemas() -> dict[str, type]:
    """Schema name -> config type, without loading a handler (no torch)."""
    return dict(configs.KV_SCHEMAS)


def registered() -> tuple[dict[str, type], dict[str, type]]:
    """What the handler modules registered (loading them): schema name ->
    config type, weights and KV; equal to :data:`configs.WEIGHT_SCHEMAS` and
    :data:`configs.KV_SCHEMAS` (a test holds them so)."""
    _load()
    return ({h.schema: h.config_type for h in _WEIGHTS.values()}, {h.schema: h.config_type for h in _KV.values()})


def _lookup(table: dict[type, Handler], cfg: Any, kind: str) -> Handler:
    _load()
    try:
        return table[type(cfg)]
    except KeyError:
        known = ", ".join(sorted(t.__name__ for t in table))
        raise TypeError(f"no {kind} handler for {type(cfg).__name__}; known: {known}") from None


def weights_handler(cfg: Any) -> Handler:
    return _lookup(_WEIGHTS, cfg, "weight-scheme")


def kv_handler(cfg: Any) -> Handler:
    return _lookup(_KV, cfg, "kv-scheme")
