"""The server contract under load (:class:`Policy`), quantlab's reference
batcher, and the policy names a load probe asks for.

A policy takes the requests a generator submits and fills in their
``start_s``, ``tokens_s`` and ``batch``; ``continuous`` is the engine's own
scheduler (``engine.scheduler(max_batch, max_tokens)``: transformers'
continuous batching, llama-server's slots), ``dynamic`` and ``passthrough``
are :class:`BatchPolicy` over the engine's batched decode.
"""
from __future__ import annotations

import abc
import queue
import time
from typing import Callable

import numpy as np
import torch

from quantlab.config_check import check_choice
from quantlab.probes.configs import POLICIES
from quantlab.decode import Clock
from quantlab.serving.requests import Limits, Request


class Policy(abc.ABC):
    """A server: takes the requests a :class:`Generator` submits and fills in
    their ``start_s``, ``tokens_s`` and ``batch``. ``steps`` counts the model
    forwards it ran (for achieved bandwidth); ``reported``: what the server
    itself measured over the last rate (``server_*`` figures, added to that
    rate's row; empty where the server keeps none)."""

    def __init__(self):
        self.steps = 0
        self.reported: dict[str, float] = {}

    @abc.abstractmethod
    def serve(self, requests: list[Request], t0: float, last_due_s: float, limits: Limits,
              start: Callable[[Callable[[Request], None]], None]) -> str:
        """Serve until every request is done; ``start(submit)`` starts the
        generator with this policy's submit function. Returns '' or the reason
        the rate ended early."""

    def close(self) -> None:
        """Release what the policy holds (a scheduler thread)."""


class BatchPolicy(Policy):
    """quantlab's reference dynamic batcher (not an engine's scheduler): when a
    request waits, collect up to ``max_batch`` of them, waiting at most
    ``max_wait_ms`` after the first, and decode them as one static batch to the
    longest request's length (nobody joins a running batch; prompts of
    different lengths are left-padded by the engine). ``max_batch=1``
    is pass-through: one request at a time, in arrival order."""

    def __init__(self, engine, max_batch: int, max_wait_ms: float):
        super().__init__()
        self.engine, self.max_batch, self.max_wait_s = engine, max_batch, max_wait_ms / 1e3

    def serve(self, requests, t0, last_due_s, limits, start) -> str:
        inbox: queue.Queue = queue.Queue()
        start(inbox.put)
        clock = self.engine.clock()
        left = len(requests)
        while left:
            if stopped := limits.why_stop(time.perf_counter() - t0, inbox.qsize(), left, last_due_s):
                return stopped
            try:
                first = inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self.max_batch:
                wait = first.sent_s + self.max_wait_s - (time.perf_counter() - t0)
                try:
                    batch.append(inbox.get(timeout=wait) if wait > 0 else inbox.get_nowait())
                except queue.Empty:
                    break
            self._run(batch, t0, clock)
            left -= len(batch)
        return ""

    def _run(self, batch: list[Request], t0: float, clock: Clock) -> None:
        began = time.perf_counter() - t0
        n_new = max(r.n_new for r in batch)
        out = self.engine.decode_batch([r.prompt for r in batch], n_new, clock)
        self.steps += n_new
        times = began + np.cumsum([out.prefill_ms, *out.step_ms]) / 1e3
        chosen = (torch.cat([torch.as_tensor(c).reshape(len(batch), -1)[:, :1] for c in out.chosen], dim=1)
                  if out.chosen else None)
        for i, r in enumerate(batch):
            r.start_s, r.batch = began, len(batch)
            r.tokens_s = [float(t) for t in times[:r.n_new]]
            r.tokens = [] if chosen is None else chosen[i, :r.n_new].tolist()


# The engine capability each policy of ``quantlab.probes.configs.POLICIES`` needs ('' none).
NEEDS = {"continuous": "continuous", "dynamic": "batch", "passthrough": ""}


def make_policy(name: str, engine, cfg) -> Policy:
    """The policy ``name`` (one of ``quantlab.probes.configs.POLICIES``; the config checks it)
    over ``engine`` (``cfg``: :class:`~quantlab.probes.configs.LoadProbeConfig`)."""
    check_choice("probe.load.policies", name, POLICIES, element=True)
    if name == "continuous":
        return engine.scheduler(cfg.max_batch, cfg.prompt_tokens + cfg.new_tokens)
    return BatchPolicy(engine, cfg.max_batch if name == "dynamic" else 1, cfg.max_wait_ms if name == "dynamic" else 0.0)


def cannot(name: str, engine) -> str:
    """Why ``engine`` cannot serve policy ``name`` ('' when it can)."""
    return engine.cannot(NEEDS[name]) if NEEDS.get(name) else ""
