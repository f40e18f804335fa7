"""A request under load and what happened to it; when a rate gives up.

Times are ``time.perf_counter()`` seconds from the rate's start.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """One request and what happened to it. ``tokens_s``: when each generated
    token was ready (the first ends the TTFT)."""

    rid: int
    due_s: float  # scheduled arrival
    prompt: torch.Tensor  # [P] token ids
    n_new: int
    sent_s: float = math.nan  # when the generator submitted it
    start_s: float = math.nan  # when the server took it off the queue
    tokens_s: list[float] = field(default_factory=list)
    batch: int = 0  # how many sequences it ran beside (itself included)
    tokens: list[int] = field(default_factory=list)  # what it generated (greedy)

    @property
    def done(self) -> bool:
        return len(self.tokens_s) >= self.n_new


@dataclass
class Limits:
    """When a rate gives up: more than ``max_backlog`` requests waiting, or
    requests still open ``drain_s`` after the last arrival."""

    max_backlog: int
    drain_s: float

    def why_stop(self, now_s: float, waiting: int, open_: int, last_due_s: float) -> str:
        """'' while the rate goes on; else why it ends: ``waiting`` requests
        queued beyond the running batch, ``open_`` not finished yet."""
        if waiting > self.max_backlog:
            return (f"saturated: {waiting} requests waiting at {now_s:.1f} s (more than max_backlog="
                    f"{self.max_backlog}); the server fell behind the offered rate")
        if now_s > last_due_s + self.drain_s:
            return f"did not drain: {open_} requests open {self.drain_s:g} s after the last arrival"
        return ""


def count_overlaps(requests: list[Request]) -> None:
    """For a scheduler that does not report its batches: each finished
    request's ``batch`` = the finished requests in flight when its first
    token came out (itself included)."""
    for r in requests:
        if r.done:
            r.batch = sum(1 for q in requests if q.done and q.start_s <= r.tokens_s[0] <= q.tokens_s[-1])
