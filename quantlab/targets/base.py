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
        """Move to the device and optionally ``torch.compile``; returns the runnable."""
        model = model.to(self.device)
        if self.cfg.compile:
            model.forward = torch.compile(model.forward)
        return model
