"""A deterministic engine added the way a new runtime is: this one file (its
config, its target, its engine, one ``register`` call). Logits are the wrapped
model's own; every request takes exactly ``PREFILL_MS`` + ``STEP_MS`` per step
on its fake clock, so what the probes log can be checked to the digit."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlab.config import TargetConfig
from quantlab.decode import Decoded, greedy
from quantlab.engines.base import Engine
from quantlab.engines.pytorch import TorchEngine
from quantlab.hardware import Hardware
from quantlab.targets import register
from quantlab.targets.base import Target

PREFILL_MS, STEP_MS = 7.0, 2.5


@dataclass
class FakeTargetConfig(TargetConfig):
    name: str = "fake"


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, model: torch.nn.Module):
        self.inner = TorchEngine(model)
        super().__init__(self.inner.vocab_size, self.inner.max_length)
        self.decoded: list[Decoded] = []

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(ids)

    def decode(self, prompt, n_new, clock=None, choose=greedy, record=None) -> Decoded:
        real = self.inner.decode(prompt, n_new, clock, choose, record)  # the real tokens, fake times
        out = Decoded(PREFILL_MS, [STEP_MS] * (n_new - 1), real.chosen, kv_bytes=1234)
        self.decoded.append(out)
        return out


class FakeTarget(Target):
    name = "fake"

    def hardware(self) -> Hardware:
        return Hardware(device="cpu", name="fake device")

    def engine(self, model, kv, tokenizer) -> FakeEngine:
        eng = FakeEngine(model)
        eng.ready_s = 0.125
        eng.metrics = {"compile/fake_engine": 1.0}
        return eng


register(FakeTargetConfig, FakeTarget)
