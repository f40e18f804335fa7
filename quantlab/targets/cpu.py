"""CPU target: eager or torch.compile (inductor), settable thread count,
optional static KV cache."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from quantlab import hardware
from quantlab.config import TargetConfig
from quantlab.targets import register
from quantlab.targets.base import LocalTarget


@dataclass
class CPUTargetConfig(TargetConfig):
    """``compile``: torch.compile (inductor). ``compile_mode``: torch.compile's
    mode. ``static_cache``: > 0 decodes into a preallocated ``StaticCache`` of
    that many tokens (fixed shapes: no recompiles, and what CUDA graphs need)."""

    name: str = "cpu"
    threads: Optional[int] = field(default=None, metadata={"min": 1})  # None: leave torch's default (all cores)
    compile: bool = False
    compile_mode: str = field(default="default", metadata={"choices": ("default", "max-autotune-no-cudagraphs")})
    static_cache: int = 0


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
