"""CUDA target: eager or torch.compile on one NVIDIA GPU."""
from __future__ import annotations

import torch

from quantlab import hardware
from quantlab.config import CUDATargetConfig
from quantlab.targets.base import Target


class CUDATarget(Target):
    name = "cuda"
    cfg: CUDATargetConfig

    def hardware(self):
        return hardware.cuda(self.cfg.device)

    def missing_reason(self) -> str:
        if not torch.cuda.is_available():
            return f"no CUDA device visible to torch {torch.__version__} (CPU build or no GPU)"
        return f"CUDA device {self.cfg.device} not present ({torch.cuda.device_count()} visible)"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.cfg.device)
