"""The target contract shared by cpu, cuda and neuron; ``LocalTarget`` is the
in-process torch path of cpu and cuda (eager, torch.compile, static cache)."""
from __future__ import annotations

import abc
import functools
import time
from typing import Any

import torch
from transformers import StaticCache

from quantlab.errors import UserError
from quantlab.hardware import Hardware
from quantlab.schemes.registry import Support, kv_handler, weights_handler

_ORDER = {"real": 0, "emulated": 1, "unsupported": 2}


class Target(abc.ABC):
    name: str
    # The model runs in this process, so probes that drive it step by step with
    # a host-side KV cache (cache probe, stage table) can run.
    in_process: bool = True

    def no_stage_table(self) -> str:
        """Why the per-stage table cannot be measured here ('' when it can)."""
        return "" if self.in_process else f"the model runs in the {self.name} worker"

    def __init__(self, cfg: Any):
        self.cfg = cfg

    @abc.abstractmethod
    def hardware(self) -> Hardware | None:
        """The device this target runs on, or None when it is not present."""

    @abc.abstractmethod
    def missing_reason(self) -> str:
        """Why ``hardware()`` is None (one line)."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    def supports(self, weights: Any, kv: Any) -> Support:
        """Worst of the weight and KV verdicts on this target's hardware."""
        hw = self.hardware()
        if hw is None:
            return Support("unsupported", self.missing_reason())
        verdicts = [weights_handler(weights).support(weights, hw), kv_handler(kv).support(kv, hw)]
        worst = max(verdicts, key=lambda s: _ORDER[s.status])
        reasons = "; ".join(v.reason for v in verdicts if v.status == worst.status and v.reason)
        return Support(worst.status, reasons)

    def prepare(self) -> None:
        """Process-wide settings (threads) applied before the model is loaded."""

    def apply_weights(self, model: torch.nn.Module, weights: Any, ctx) -> Any:
        """Quantize ``model`` in place with the scheme's handler; ``Applied``."""
        return weights_handler(weights).apply(model, weights, ctx)

    def decode_cache(self, factory):
        """The KV-cache factory the latency probe and warm-up decode into."""
        return factory

    def compile_metrics(self) -> dict[str, float]:
        """Target-specific figures of the last ``compile`` (export time, artifact size)."""
        return {}

    def close(self) -> None:
        """Release what the target holds (a worker process); idempotent."""

    @abc.abstractmethod
    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """Turn the (quantized) model into the runnable the probes use."""

    @abc.abstractmethod
    def warm_up(self, model: torch.nn.Module, cache_factory) -> float:
        """Seconds until the runnable is ready to be timed (compile time for a
        compiled model), logged apart from probe latency."""

    def measure_latency(self, model, tokenizer, prompt: str, cfg, cache_factory):
        """The latency probe; ``(metrics, raw)`` as ``probes.latency.measure``."""
        from quantlab.probes import latency

        return latency.measure(model, tokenizer, prompt, cfg, cache_factory)


class LocalTarget(Target):
    """cpu and cuda: eager or ``torch.compile``, optionally a ``StaticCache``."""

    COMPILE_MODES: tuple[str, ...] = ("default",)
    # scheme config type -> why torch.compile cannot run its kernels on this target
    NOT_COMPILABLE: dict[type, str] = {}

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        if cfg.compile_mode not in self.COMPILE_MODES:
            raise UserError(f"{self.name}: unknown compile_mode {cfg.compile_mode!r}; "
                            f"valid: {', '.join(self.COMPILE_MODES)}")
        if cfg.static_cache < 0:
            raise UserError(f"{self.name}: static_cache must be >= 0 (0: dynamic cache), got {cfg.static_cache}")

    def close(self) -> None:
        """Drop this process's compiled graphs: they keep the point's model alive,
        and every model instance counts against dynamo's recompile limit, past
        which a later "compiled" point would silently run eager."""
        if self.cfg.compile:
            torch._dynamo.reset()

    def no_stage_table(self) -> str:
        return ("compiled: per-module timing hooks would split the compiled graph and time another program"
                if self.cfg.compile else "")

    def supports(self, weights: Any, kv: Any) -> Support:
        verdict = super().supports(weights, kv)
        from quantlab.schemes.kv import NoKV

        if verdict.runnable and self.cfg.static_cache and not isinstance(kv, NoKV):
            return Support("unsupported", "static_cache holds bf16/fp16 tensors: no quantized KV scheme")
        if verdict.runnable and self.cfg.compile and type(weights) in self.NOT_COMPILABLE:
            return Support("unsupported", self.NOT_COMPILABLE[type(weights)])
        return verdict

    def decode_cache(self, factory):
        if not self.cfg.static_cache:
            return factory
        return functools.partial(StaticCache, max_cache_len=self.cfg.static_cache)

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move to the device and optionally ``torch.compile`` (inductor). With a
        dynamic cache, shapes are marked dynamic so a growing cache does not
        recompile every step; with a static cache they stay static (what CUDA
        graphs replay). Compilation happens in ``warm_up``; ``close`` drops the
        graphs."""
        model = model.to(self.device)
        if self.cfg.compile:
            model.forward = torch.compile(model.forward, mode=self.cfg.compile_mode,
                                          dynamic=None if self.cfg.static_cache else True)
        return model

    @torch.inference_mode()
    def warm_up(self, model: torch.nn.Module, cache_factory, prompt_tokens: int = 16, steps: int = 3) -> float:
        """Seconds spent in the first prefill + decode steps."""
        ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), device=self.device)
        t = time.perf_counter()
        cache = cache_factory(config=model.config)
        nxt = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            nxt = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t
