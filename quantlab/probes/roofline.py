"""Measured memory bandwidth of this host, and how close a decode step gets to it.

Decode at small batch is bound by reading the weights (and the KV cache) once
per step, so ``bytes per step x steps per second`` against the measured read
bandwidth says how much headroom a kernel leaves (gpt-fast prints the GB/s;
here it is put against the machine's own limit).
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch

from quantlab import contention


def measure_read_bandwidth(device: torch.device, mbytes: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` bytes/s of a full reduction over a ``mbytes`` MiB
    buffer (much larger than any cache), on ``device``."""
    x = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = 0.0
    for _ in range(repeats + 1):  # the first pass faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum().item()
        dt = time.perf_counter() - t
        best = max(best, x.numel() * 4 / dt)
    return best


CONTENDED_CORES = 0.25  # other processes' CPU during a measurement past which it is not kept


def host_bandwidth(cache_dir: str, device: torch.device) -> float:
    """Cached per host and device: measured once, reused by every later point.
    A CPU measurement taken while other processes used more than
    ``CONTENDED_CORES`` cores is returned but not cached (it understates the
    host: 29.6 against 34.2 GB/s idle, measured beside a test run on 2 cores),
    so a later point measures again."""
    name = device.type if device.type == "cpu" else f"{device.type}{device.index or 0}"
    path = Path(cache_dir).expanduser() / "bandwidth" / f"{socket.gethostname()}-{name}.json"
    if path.is_file():
        return json.loads(path.read_text())["bytes_per_s"]
    before = contention.snapshot()
    bw = measure_read_bandwidth(device)
    if device.type == "cpu" and contention.foreign_cores(before, contention.snapshot()) > CONTENDED_CORES:
        return bw
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bytes_per_s": bw, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    return bw


def utilisation(bytes_per_step: float, step_ms: float, peak_bytes_per_s: float) -> dict[str, float]:
    """Achieved bandwidth = bytes moved per decode step x steps per second;
    ``bw/floor_ms``: the step's bytes at the measured peak (the time a step
    cannot beat); ``bw/overhead_ms``: the rest of the step (kernel launches,
    Python, dequantization arithmetic), at least 0."""
    achieved = bytes_per_step / (step_ms / 1000.0)
    floor_ms = bytes_per_step / peak_bytes_per_s * 1e3
    return {"bw/achieved_gb_s": achieved / 1e9, "bw/peak_gb_s": peak_bytes_per_s / 1e9,
            "bw/util": achieved / peak_bytes_per_s, "bw/floor_ms": floor_ms,
            "bw/overhead_ms": max(0.0, step_ms - floor_ms)}
