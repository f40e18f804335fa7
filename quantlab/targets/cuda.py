"""CUDA target on one NVIDIA GPU: eager, torch.compile, or CUDA graphs
(``compile_mode=reduce-overhead`` over a static KV cache)."""
from __future__ import annotations


import torch

from quantlab import hardware
from quantlab.targets.configs import CUDATargetConfig
from quantlab.targets import register
from quantlab.targets.base import LocalTarget


class CUDATarget(LocalTarget):
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


register(CUDATargetConfig, CUDATarget)
