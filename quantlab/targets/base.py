"""The target contract shared by cpu, cuda, neuron and llamacpp; ``LocalTarget``
is the in-process torch path of cpu and cuda (eager, torch.compile, static cache).

A target answers two questions and does one thing:

* ``supports(weights, kv)``: real / emulated / unsupported (reason), asked
  before anything is loaded;
* ``session()``: a context for the point that sets process-wide settings
  (threads) and restores them, and releases workers, when the point ends;
* ``engine(model, kv, tokenizer)``: turn the quantized model into the :class:`Engine`
  every probe talks to (compile, export, load; the time it took is
  ``engine.ready_s``).

``apply_weights`` quantizes with the scheme's handler; a target whose runtime
quantizes at export (Neuron) overrides it.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import time
from typing import Any, Iterator

import torch
from transformers import StaticCache

from quantlab.config_check import validate
from quantlab.engines.base import Engine
from quantlab.engines.pytorch import TorchEngine
from quantlab.errors import UserError
from quantlab.hardware import Hardware
from quantlab.schemes.registry import Applied, Support, kv_handler, weights_handler

_ORDER = {"real": 0, "emulated": 1, "unsupported": 2}


def worst(verdicts: list[Support]) -> Support:
    """The least runnable verdict, with the reasons of those that share it."""
    w = max(verdicts, key=lambda s: _ORDER[s.status])
    return Support(w.status, "; ".join(v.reason for v in verdicts if v.status == w.status and v.reason))


class Target(abc.ABC):
    name: str
    serves_export = False  # the engine runs a file written from the point (fidelity adds parity/*)

    def __init__(self, cfg: Any):
        """``cfg`` checked as at compose time (a config built in Python too):
        ``UserError`` in one line."""
        try:
            validate(cfg, "target.")
        except ValueError as e:
            raise UserError(str(e)) from None
        self.cfg = cfg

    @abc.abstractmethod
    def hardware(self) -> Hardware | None:
        """The device this target runs on, or None when it is not present
        (``missing_reason`` says why)."""

    def missing_reason(self) -> str:
        return f"no {self.name} device"

    def supports(self, weights: Any, kv: Any) -> Support:
        """Worst of the weight and KV verdicts on this target's hardware."""
        hw = self.hardware()
        if hw is None:
            return Support("unsupported", self.missing_reason())
        return worst([weights_handler(weights).support(weights, hw), kv_handler(kv).support(kv, hw)])

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Process-wide settings for one point, undone when it ends."""
        yield

    def apply_weights(self, model: torch.nn.Module, weights: Any, ctx) -> Applied:
        """Quantize ``model`` in place with the scheme's handler. A target
        that serves the export runs the written file with its runtime's own
        kernels (it refuses, in ``supports``, a scheme it has none for), so
        a scheme the torch engine can only emulate is not emulated there."""
        applied = weights_handler(weights).apply(model, weights, ctx)
        if self.serves_export and applied.emulated:
            return dataclasses.replace(applied, emulated=False, backend=f"{self.name} (from {applied.backend})")
        return applied

    @abc.abstractmethod
    def engine(self, model: torch.nn.Module, kv: Applied, tokenizer) -> Engine:
        """The ready engine for the quantized ``model`` and the applied KV scheme
        (``tokenizer``: for runtimes that write their own model files)."""


class LocalTarget(Target):
    """cpu and cuda: eager or ``torch.compile``, optionally a ``StaticCache``."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """On exit, drop this process's compiled graphs: they keep the point's
        model alive, and every model instance counts against dynamo's recompile
        limit, past which a later "compiled" point would silently run eager."""
        try:
            yield
        finally:
            if self.cfg.compile:
                torch._dynamo.reset()

    def supports(self, weights: Any, kv: Any) -> Support:
        verdict = super().supports(weights, kv)
        if verdict.runnable and self.cfg.static_cache and kv.short_name():  # '' is the unquantized cache
            return Support("unsupported", "static_cache holds bf16/fp16 tensors: no quantized KV scheme")
        blocker = weights_handler(weights).cannot_compile(weights, self.device.type) if self.cfg.compile else ""
        if verdict.runnable and blocker:
            return Support("unsupported", blocker)
        return verdict

    def decode_cache(self, factory):
        """The KV-cache factory requests decode into: the scheme's, or a StaticCache."""
        if not self.cfg.static_cache:
            return factory
        return functools.partial(StaticCache, max_cache_len=self.cfg.static_cache)

    def engine(self, model: torch.nn.Module, kv: Applied, tokenizer=None) -> TorchEngine:
        """Move to the device and optionally ``torch.compile`` (inductor). With a
        dynamic cache, shapes are marked dynamic so a growing cache does not
        recompile every step; with a static cache they stay static (what CUDA
        graphs replay). The first prefill + 3 steps compile; their time is
        ``ready_s``."""
        model = model.to(self.device)
        if self.cfg.compile:
            model.forward = torch.compile(model.forward, mode=self.cfg.compile_mode,
                                          dynamic=None if self.cfg.static_cache else True)
        eng = TorchEngine(model, self.device, self.decode_cache(kv.cache_factory), compiled=self.cfg.compile,
                          static=bool(self.cfg.static_cache))
        ids = torch.randint(0, eng.vocab_size, (1, 16))
        t = time.perf_counter()
        eng.decode(ids, 4)
        eng.ready_s = time.perf_counter() - t
        return eng
