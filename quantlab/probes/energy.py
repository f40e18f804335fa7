"""Energy counters: NVML on NVIDIA GPUs, RAPL (powercap) on CPUs.

Where no counter can be read, :func:`open_counter` returns None with the reason
and no energy metric is logged at all: an absent figure, never a zero.
"""
from __future__ import annotations

from pathlib import Path

import torch

RAPL = Path("/sys/class/powercap")


class RaplCounter:
    """Package energy in joules from ``energy_uj`` (wraps at ``max_energy_range_uj``)."""

    def __init__(self, zone: Path):
        self.path = zone / "energy_uj"
        self.wrap = int((zone / "max_energy_range_uj").read_text())

    def read(self) -> float:
        return int(self.path.read_text()) / 1e6

    def delta(self, start: float, end: float) -> float:
        return end - start if end >= start else end + self.wrap / 1e6 - start


class NvmlCounter:
    def __init__(self, index: int):
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.read()  # raises where the GPU has no energy counter

    def read(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3  # mJ -> J

    def delta(self, start: float, end: float) -> float:
        return end - start


def open_counter(device: torch.device):
    """``(counter, "")`` or ``(None, reason)``."""
    if device.type == "cuda":
        try:
            return NvmlCounter(device.index or 0), ""
        except Exception as e:  # noqa: BLE001 - pynvml raises its own error types
            return None, f"NVML energy counter unavailable: {type(e).__name__}: {e}"
    zones = sorted(RAPL.glob("intel-rapl:[0-9]")) if RAPL.is_dir() else []
    for zone in zones:
        try:
            counter = RaplCounter(zone)
            counter.read()
            return counter, ""
        except (OSError, ValueError) as e:
            reason = f"RAPL {zone.name} unreadable: {e.strerror if isinstance(e, OSError) else e}"
            return None, reason
    return None, f"no RAPL powercap zone under {RAPL} (VM or unsupported CPU)"
