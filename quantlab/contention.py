"""Whether a timing shared the cores with other work.

The 1-minute load average counts this point's own threads (a compute-bound
point at N threads sits near N), lags a minute behind, and cannot tell a
competing process from the point itself. What a timing needs to know is how
much CPU *other* processes used while it ran: system-wide busy CPU time
(``psutil.cpu_times``: user, nice, system, irq, softirq and steal, which is
another VM's use of the host) minus this process tree's (this process, its
reaped children, and its live children recursively: llama-server and vLLM
servers are children, so their work is the point's own). Divided by the
wall time, it is the cores' worth of foreign work during the timing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Snapshot:
    wall_s: float
    busy_s: float  # system-wide busy CPU seconds
    own_s: float  # CPU seconds of this process tree


def snapshot() -> Snapshot:
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + sum(getattr(t, k, 0.0) for k in ("irq", "softirq", "steal"))
    me = psutil.Process()
    c = me.cpu_times()
    own = c.user + c.system + c.children_user + c.children_system
    for child in me.children(recursive=True):
        try:
            ct = child.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        own += ct.user + ct.system
    return Snapshot(time.monotonic(), busy, own)


def foreign_cores(before: Snapshot, after: Snapshot) -> float:
    """Cores' worth of CPU that other processes (and other VMs: steal) used
    between two snapshots; 0 for an empty interval."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    return max(0.0, ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall)
