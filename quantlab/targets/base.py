"""The target contract shared by cpu, cuda (and later neuron)."""
from __future__ import annotations

import abc
from typing import Any

import torch

from quantlab.hardware import Hardware
from quantlab.schemes.registry import Support, kv_handler, weights_handler

_ORDER = {"real": 0, "emulated": 1, "unsupported": 2}


class Target(abc.ABC):
    name: str

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

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move to the device and optionally ``torch.compile`` (inductor, dynamic
        shapes so a growing KV cache does not recompile every step); returns the
        runnable. Compilation is triggered later by ``warm_up``."""
        model = model.to(self.device)
        if self.cfg.compile:
            model.forward = torch.compile(model.forward, dynamic=True)
        return model

    @torch.inference_mode()
    def warm_up(self, model: torch.nn.Module, cache_factory, prompt_tokens: int = 16, steps: int = 3) -> float:
        """Seconds spent in the first prefill + decode steps: for a compiled
        model that is the compile time, logged apart from probe latency."""
        import time

        ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), device=self.device)
        t = time.perf_counter()
        cache = cache_factory(config=model.config)
        nxt = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            nxt = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t
