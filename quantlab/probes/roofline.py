"""Measured memory bandwidth of this host, and how close a decode step gets to it.

Decode at small batch is bound by reading the weights (and the KV cache) once
per step, so ``bytes per step x steps per second`` against the measured read
bandwidth says how much headroom a kernel leaves (gpt-fast prints the GB/s;
here it is put against the machine's own limit).
"""
from __future__ import annotations

import json
import mmap
import socket
import time
from pathlib import Path

import torch

from quantlab import contention


METHOD = "thp-sum-rowmax"  # how the figure was measured; a cached figure measured otherwise is measured again


def _host_buffer(nbytes: int) -> torch.Tensor:
    """Ones over anonymous memory advised into transparent huge pages (Linux),
    so the read is not held back by 4 KiB pages' TLB misses (on a 2-core EPYC:
    28-30 GB/s in plain torch memory, 34-36 GB/s advised); plain torch memory
    where the advice is not available."""
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):
        return torch.ones(nbytes // 4, dtype=torch.float32)
    x = torch.frombuffer(buf, dtype=torch.float32)
    x.fill_(1.0)
    return x


def measure_read_bandwidth(device: torch.device, mbytes: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` bytes/s over a ``mbytes`` MiB buffer (much larger
    than any cache), on ``device``: a full reduction, and on the CPU also a
    reduction per 4,096-float row (the one reaches more than the other
    depending on the host). Still a lower bound of what the host can read:
    llama.cpp's BF16 GEMV reads more on some hosts (docs/results)."""
    nbytes = mbytes * 2**20
    x = _host_buffer(nbytes) if device.type == "cpu" else torch.ones(nbytes // 4, device=device)
    kernels = [lambda: x.sum().item()]
    if device.type == "cpu":
        kernels.append(lambda: x.view(-1, 4096).amax(1)[0].item())
    best = 0.0
    for _ in range(repeats + 1):  # the first pass faults the pages in
        for kernel in kernels:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            kernel()
            best = max(best, nbytes / (time.perf_counter() - t))
    return best


CONTENDED_CORES = 0.25  # other processes' CPU during a measurement past which it is not kept


def host_bandwidth(cache_dir: str, device: torch.device) -> float:
    """Cached per host and device: measured once, reused by every later point
    (a figure cached by another :data:`METHOD` is measured again).
    A CPU measurement taken while other processes used more than
    ``CONTENDED_CORES`` cores is returned but not cached (it understates the
    host: 29.6 against 34.2 GB/s idle, measured beside a test run on 2 cores),
    so a later point measures again."""
    name = device.type if device.type == "cpu" else f"{device.type}{device.index or 0}"
    path = Path(cache_dir).expanduser() / "bandwidth" / f"{socket.gethostname()}-{name}.json"
    if path.is_file() and (cached := json.loads(path.read_text())).get("method") == METHOD:
        return cached["bytes_per_s"]
    before = contention.snapshot()
    bw = measure_read_bandwidth(device)
    if device.type == "cpu" and contention.foreign_cores(before, contention.snapshot()) > CONTENDED_CORES:
        return bw
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bytes_per_s": bw, "method": METHOD,
                                "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}))
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
