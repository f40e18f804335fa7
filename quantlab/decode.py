"""The one decode loop: every engine, probe, benchmark and worker decodes here.

    decoded = decode_loop(forward, prompt_ids, n_new, Clock())

``forward(ids, start) -> logits`` runs ``ids: [B, n]`` placed at position
``start`` (``start == 0`` begins new sequences) and returns logits ``[B, k, V]``
for the last ``k >= 1`` positions (a torch tensor or a numpy array). The loop
times the prefill (prompt forward + first choice: what TTFT ends with) and each
further step on its own, so no figure is derived by subtraction.

Only the standard library is imported here: the Neuron worker runs this file
under another interpreter that may lack quantlab's dependencies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable


class Clock:
    """Wall clock in ms; ``sync`` (e.g. ``torch.cuda.synchronize``) runs first so
    queued device work is counted."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync

    def now_ms(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter_ns() / 1e6


@dataclass
class Decoded:
    """One request: ``prefill_ms`` (prompt forward + first choice), one
    ``step_ms`` per further token, the inputs chosen at each step, and the
    bytes the KV cache held at the end (0 where the engine cannot tell)."""

    prefill_ms: float
    step_ms: list[float] = field(default_factory=list)
    chosen: list[Any] = field(default_factory=list)
    kv_bytes: int = 0


def greedy(logits, _step: int):
    """Next input ``[B, 1]``: argmax of the last position (torch or numpy)."""
    return logits[:, -1:].argmax(-1)


def decode_loop(forward: Callable[[Any, int], Any], prompt, n_new: int, clock: Clock,
                choose: Callable[[Any, int], Any] = greedy,
                record: Callable[[Any], None] | None = None) -> Decoded:
    """Prefill ``prompt: [B, P]``, then ``n_new - 1`` steps. ``choose(logits, i)``
    gives step ``i``'s input (greedy by default; teacher forcing passes known
    tokens, several at a time if it likes); ``record(logits)`` sees every output."""
    t = clock.now_ms()
    logits = forward(prompt, 0)
    if record is not None:
        record(logits)
    nxt = choose(logits, 0)
    out = Decoded(prefill_ms=clock.now_ms() - t, chosen=[nxt])
    pos = prompt.shape[1]
    for i in range(1, n_new):
        s = clock.now_ms()
        logits = forward(nxt, pos)
        pos += nxt.shape[1]
        if record is not None:
            record(logits)
        nxt = choose(logits, i)
        out.step_ms.append(clock.now_ms() - s)
        out.chosen.append(nxt)
    return out
