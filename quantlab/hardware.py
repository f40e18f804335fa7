"""What the machine a point runs on can do (ISA flags, CUDA capability)."""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Hardware:
    device: str  # "cpu" | "cuda"
    name: str
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    cuda_capability: tuple[int, int] | None = None

    def has_any(self, *flags: str) -> bool:
        return any(f in self.cpu_flags for f in flags)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_vector_isa() -> str:
    """The instruction set of the ATen CPU kernels this process dispatches to
    ("AVX512", "AVX2", "DEFAULT", ...): the CPU's, or lower where
    ``ATEN_CPU_CAPABILITY`` caps it."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def cpu_native_matmul(dtype: torch.dtype) -> bool:
    """Whether a matmul in ``dtype`` runs vectorized on this CPU: fp32 always;
    bf16 and fp16 where oneDNN takes them (its own check, which reads the CPU
    or the ISA ``ONEDNN_MAX_CPU_ISA`` caps it to: bf16 from AVX-512 up, fp16
    with AVX512-FP16 or AMX-FP16). Elsewhere
    PyTorch falls back to a generic loop (bf16 on AVX2: a 32-token prefill
    544 ms against int8's 165 ms, docs/results/2026-12-01-epyc-avx2.md)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def cpu() -> Hardware:
    return Hardware(device="cpu", name=cpu_name(), cpu_flags=cpu_flags())


def cuda(index: int = 0) -> Hardware | None:
    """The CUDA device ``index``, or None when torch sees no CUDA device."""
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return Hardware(
        device="cuda",
        name=torch.cuda.get_device_name(index),
        cpu_flags=cpu_flags(),
        cuda_capability=torch.cuda.get_device_capability(index),
    )
