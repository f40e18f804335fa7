"""CUDA target on one NVIDIA GPU: eager, torch.compile, or CUDA graphs
(``compile_mode=reduce-overhead`` over a static KV cache)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantlab import hardware
from quantlab.config import TargetConfig
from quantlab.errors import UserError
from quantlab.targets import register
from quantlab.targets.base import LocalTarget


@dataclass
class CUDATargetConfig(TargetConfig):
    """As the CPU target; ``compile_mode=reduce-overhead`` captures CUDA graphs
    and needs ``static_cache`` > 0."""

    name: str = "cuda"
    device: int = 0
    compile: bool = False
    compile_mode: str = field(default="default", metadata={"choices": (
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")})
    static_cache: int = 0


class CUDATarget(LocalTarget):
    name = "cuda"
    cfg: CUDATargetConfig

    def __init__(self, cfg: CUDATargetConfig):
        super().__init__(cfg)
        if cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune") and not cfg.static_cache:
            raise UserError(f"cuda: compile_mode={cfg.compile_mode} captures CUDA graphs, which replay fixed "
                            "shapes: set target.static_cache (e.g. 1024) so the KV cache does not grow")

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
