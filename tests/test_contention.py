"""What ``quantlab.contention`` counts as other processes' work."""
from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from quantlab import contention

# A wall-clock loop gets less than its seconds of CPU when another process
# (CI's other test worker) shares the cores: CI read 0.72 s for 1 s. The child
# burns CPU seconds; the orphan spins on the wall clock (it only has to be
# running through the window).
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def test_arithmetic_takes_system_busy_time_minus_the_process_tree(monkeypatch):
    a = contention.Snapshot(wall_s=10.0, busy_s=100.0, own_s=40.0)
    b = contention.Snapshot(wall_s=12.0, busy_s=104.0, own_s=42.0)  # 4 s busy in 2 s, 2 s of them ours
    assert contention.foreign_cores(a, b) == pytest.approx(1.0)
    assert contention.foreign_cores(a, a) == 0.0
    assert contention.foreign_cores(a, contention.Snapshot(11.0, 100.5, 41.0)) == 0.0  # never below 0
    times = SimpleNamespace(user=50.0, nice=1.0, system=20.0, idle=500.0, iowait=3.0, irq=0.5, softirq=0.5,
                            steal=2.0)
    monkeypatch.setattr(contention.psutil, "cpu_times", lambda: times)
    assert contention.snapshot().busy_s == pytest.approx(74.0)  # idle and iowait are not busy; steal is


def test_a_child_is_the_points_own_work_and_an_orphan_is_not():
    """A server the point started (llama-server, vLLM) is a child: its CPU is
    the point's. A process outside the tree is other work, whatever else
    (another test worker) shares the machine: that only adds to it."""
    before = contention.snapshot()
    subprocess.run([sys.executable, "-c", BURN.format(s=1.0)], check=True)
    after = contention.snapshot()
    assert after.own_s - before.own_s >= 0.95
    # an orphan: its parent shell exits at once, so it is nobody's child here
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{SPIN.format(s=2.0)}' >/dev/null 2>&1 &"], check=True)
    before = contention.snapshot()
    time.sleep(1.2)
    after = contention.snapshot()
    assert after.own_s - before.own_s < 0.3
    assert contention.foreign_cores(before, after) >= 0.5
