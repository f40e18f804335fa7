"""Peak resident memory during a block, sampled by a background thread.

``ru_maxrss`` is a lifetime peak of the process and so useless when several
points run in one process; sampling RSS gives the peak of *this* block.
"""
from __future__ import annotations

import threading

import psutil


class PeakRSS:
    """Context manager; ``peak_bytes`` holds the highest RSS seen inside it."""

    def __init__(self, hz: float = 200.0):
        self.interval = 1.0 / hz
        self.peak_bytes = 0
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakRSS":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
