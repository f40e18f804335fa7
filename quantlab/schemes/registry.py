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

Which schemes exist is the ``quantlab.schemes`` entry-point group
(``weights.<schema>`` / ``kv.<schema>`` = the config dataclass), read without
importing a handler; a config's handler module (its ``HANDLER``) is imported the
first time a config of that type is looked up. quantlab's own schemes are
declared in its pyproject.toml the way a plugin package declares its own.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from quantlab import plugins

if TYPE_CHECKING:  # annotations only: this module stays importable without torch (export's command line)
    import torch

    from quantlab.hardware import Hardware

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
    # what an export writes beside the weights: calibrated KV scales as ``{"kv_cache_scheme": {...},
    # "tensors": {name: tensor}}`` (compressed-tensors' names, which vLLM reads); empty: nothing
    checkpoint: dict[str, Any] = field(default_factory=dict)
    # llama.cpp's importance matrix: each Linear's mean squared input per column, by module name
    # (what ``llama-imatrix`` collects; the llama.cpp target hands it to its quantizer); empty: none
    importance: dict[str, Any] = field(default_factory=dict)
    # what the point's size is when counted from an artifact's files (``size/*``, replacing the in-memory
    # count: an artifact measured as-is); empty: counted from the model
    metrics: dict[str, float] = field(default_factory=dict)


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


@functools.cache
def _schemas() -> dict[str, dict[str, type]]:
    """``{"weights": {schema: config type}, "kv": {...}}`` from the entry points."""
    out: dict[str, dict[str, type]] = {"weights": {}, "kv": {}}
    for name, cls in plugins.load(plugins.SCHEMES).items():
        kind, _, schema = name.partition(".")
        if kind not in out or not schema:
            raise plugins.bad_name(plugins.SCHEMES, name, "weights.<schema> or kv.<schema>")
        out[kind][schema] = cls
    return out


def weight_schemas() -> dict[str, type]:
    """Schema name -> config type, without loading a handler (no torch)."""
    return dict(_schemas()["weights"])


def kv_schemas() -> dict[str, type]:
    """Schema name -> config type, without loading a handler (no torch)."""
    return dict(_schemas()["kv"])


def registered() -> tuple[dict[str, type], dict[str, type]]:
    """What the handler modules of every declared scheme register once
    imported: schema name -> config type, weights and KV (equal to
    :func:`weight_schemas` and :func:`kv_schemas`: a test holds them so)."""
    for cls in (*weight_schemas().values(), *kv_schemas().values()):
        importlib.import_module(cls.HANDLER)
    return ({h.schema: h.config_type for h in _WEIGHTS.values()}, {h.schema: h.config_type for h in _KV.values()})


def _lookup(table: dict[type, Handler], cfg: Any, kind: str) -> Handler:
    if type(cfg) not in table and getattr(cfg, "HANDLER", ""):
        importlib.import_module(cfg.HANDLER)
    try:
        return table[type(cfg)]
    except KeyError:
        known = ", ".join(sorted(t.__name__ for t in table))
        raise TypeError(f"no {kind} handler for {type(cfg).__name__} (its HANDLER module "
                        f"{getattr(cfg, 'HANDLER', '') or 'is not set'} registered none); "
                        f"loaded: {known}") from None


def weights_handler(cfg: Any) -> Handler:
    return _lookup(_WEIGHTS, cfg, "weight-scheme")


def kv_handler(cfg: Any) -> Handler:
    return _lookup(_KV, cfg, "kv-scheme")
