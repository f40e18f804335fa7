"""The engine contract: where a point's model runs, as every probe sees it.

In the spirit of lm-eval's three-method ``LM``: an engine gives all-position
logits for a batch of ids, times one greedy request, and resets. What it cannot
do (drive a host-side KV cache, per-module timing, a host energy counter) it
says through ``cannot(probe)``, so the pipeline never asks what kind it is.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

import torch

from quantlab.decode import Clock, Decoded, greedy

# What a probe may ask beyond decode; ``cannot`` answers each. ``logits``: whole
# next-token distributions (an engine that returns only its top k says so, and
# offers ``topk_logprobs``); ``batch``: decode several sequences in one call;
# ``continuous``: serve through the engine's own continuous-batching scheduler.
CAPABILITIES = ("cache", "stages", "roofline", "energy", "batch", "continuous", "logits")


def check_first(ids: torch.Tensor, first: int) -> None:
    """:meth:`Engine.token_logprobs`'s ``first`` is a prediction of ``ids``: in ``[0, T - 1)``."""
    if not 0 <= first < ids.shape[1] - 1:
        raise ValueError(f"first={first} must lie in [0, {ids.shape[1] - 1}) for {ids.shape[1]} tokens")


class Engine(abc.ABC):
    """A loaded, ready-to-time model.

    * ``logits(ids)``: ``ids: [B, T]`` int64 -> float32 ``[B, T, V]`` next-token
      logits of every position, each row scored on its own (no cache kept).
    * ``decode(prompt, n_new, clock)``: one timed request through
      :func:`quantlab.decode.decode_loop` (``choose``/``record`` only where
      ``cannot("cache")`` is empty: they run host-side on every step).
    * ``decode_batch(prompts, n_new, clock)``: greedy, several prompts at once
      (where ``cannot("batch")`` is empty).
    * ``reset()``: forget any state a previous call left (caches, sequences).

    ``ready_s`` is the time it took to become ready (compile, export, load),
    logged apart from latency; ``metrics`` holds engine figures of that step.
    """

    name: str = "engine"
    ready_s: float = 0.0

    def __init__(self, vocab_size: int, max_length: int):
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.metrics: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        """Where input ids go (and which device's energy/bandwidth a probe reads)."""
        return torch.device("cpu")

    def clock(self) -> Clock:
        return Clock()

    def cannot(self, probe: str) -> str:
        """Why ``probe`` (one of ``CAPABILITIES``) cannot run here; '' when it can."""
        if probe not in CAPABILITIES:
            raise ValueError(f"unknown capability {probe!r}; valid: {', '.join(CAPABILITIES)}")
        return "" if probe == "logits" else f"the {self.name} engine does not offer it"

    @abc.abstractmethod
    def logits(self, ids: torch.Tensor) -> torch.Tensor: ...

    def token_logprobs(self, ids: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids: [B, T]`` -> ``(logp, top1)``, both ``[B, T - 1 - first]``:
        the log-probability of each actual next token ``ids[:, 1 + first:]``
        (float64) and whether it was the most likely one. All perplexity and
        log-likelihood scoring goes through here; from :meth:`tail_logits`
        unless an engine scores otherwise (a server that returns the actual
        token's log-probability). ``first`` skips the predictions a caller
        will not read (a batch's contexts, where only continuations are
        scored): their logits need not be computed."""
        check_first(ids, first)
        logp = torch.log_softmax(self.tail_logits(ids[:, :-1], ids.shape[1] - 1 - first).float(), dim=-1).cpu()
        nxt = ids[:, 1 + first:, None].to(logp.device)
        return logp.gather(-1, nxt)[..., 0].double(), logp.argmax(-1) == ids[:, 1 + first:]

    def tail_logits(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """The logits of the last ``n`` positions of ``ids: [B, T]``
        (``[B, n, V]``); engines that can leave the others uncomputed override."""
        return self.logits(ids)[:, ids.shape[1] - n:]

    def topk_logprobs(self, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids: [1, T]`` -> ``(values, token ids)``, both ``[T, k]``, best
        first: the top ``k`` next-token log-probabilities of every position
        (for engines where ``cannot("logits")`` is not empty)."""
        logp = torch.log_softmax(self.logits(ids)[0].float(), dim=-1).cpu()
        return logp.topk(k, dim=-1)

    @abc.abstractmethod
    def decode(self, prompt: torch.Tensor, n_new: int, clock: Clock | None = None,
               choose: Callable[[Any, int], Any] = greedy,
               record: Callable[[Any], None] | None = None) -> Decoded: ...

    def decode_batch(self, prompts: list[torch.Tensor], n_new: int, clock: Clock | None = None) -> Decoded:
        """Greedy decode of several ``[P_i]`` prompts as one batch (engines
        that offer ``batch``). Here: prompts of one length, stacked; an engine
        that pads overrides this."""
        if len({len(p) for p in prompts}) > 1:
            raise ValueError(f"the {self.name} engine batches prompts of one length only; got "
                             f"{sorted({len(p) for p in prompts})}")
        return self.decode(torch.stack(prompts), n_new, clock)

    def scheduler(self, max_batch: int, max_tokens: int):
        """The engine's own continuous-batching scheduler as a load policy
        (:class:`quantlab.probes.load.Policy`) of at most ``max_batch``
        sequences of ``max_tokens`` tokens, where ``cannot("continuous")`` is
        empty."""
        raise ValueError(f"the {self.name} engine has no scheduler: {self.cannot('continuous')}")

    def reset(self) -> None:
        """Engines that keep no state between calls have nothing to do."""

    def close(self) -> None:
        """Release what the engine holds (a worker, a native context); idempotent."""
