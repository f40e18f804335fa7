"""CPU target: eager or torch.compile (inductor), settable thread count,
optional static KV cache."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from quantlab import hardware
from quantlab.targets.configs import CPUTargetConfig
from quantlab.targets import register
from quantlab.targets.base import LocalTarget


class CPUTarget(LocalTarget):
    name = "cpu"
    cfg: CPUTargetConfig

    def hardware(self):
        return hardware.cpu()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """``target.threads`` for this point only: the next point of the same
        process gets the threads its own config says."""
        before = torch.get_num_threads()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        try:
            with super().session():
                yield
        finally:
            torch.set_num_threads(before)


register(CPUTargetConfig, CPUTarget)
