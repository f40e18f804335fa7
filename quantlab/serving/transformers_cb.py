"""transformers' continuous batching as a load policy."""
from __future__ import annotations

import math
import time

import torch

from quantlab.serving.policies import Policy
from quantlab.serving.requests import Request, count_overlaps


class ContinuousPolicy(Policy):
    """transformers' continuous batching (``ContinuousBatchingManager``, paged
    KV cache, FIFO scheduler) over the point's own model and quantized layers:
    requests join and leave the running batch at every step. The manager's
    per-token timestamps (``perf_counter``) are the token times; ``batch`` is
    how many requests were in flight when a request's first token came out."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_tokens: int, page_size: int = 32):
        super().__init__()
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        blocks = max_batch * math.ceil(max_tokens / page_size) + max_batch
        cb = ContinuousBatchingConfig(max_requests_per_batch=max_batch, num_blocks=blocks, page_size=page_size,
                                      max_batch_tokens=max(512, max_tokens))
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max_tokens)
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        self._hook = model.register_forward_pre_hook(self._count)
        self._round = 0

    def _count(self, *_):
        self.steps += 1

    def serve(self, requests, t0, last_due_s, limits, start) -> str:
        self._round += 1
        key = {f"{self._round}-{r.rid}": r for r in requests}

        def submit(r: Request) -> None:
            self.manager.add_request(r.prompt.tolist(), request_id=f"{self._round}-{r.rid}",
                                     max_new_tokens=r.n_new, record_timestamps=True)

        start(submit)
        left, stopped = len(requests), ""
        while left:
            in_system = sum(1 for r in requests if not math.isnan(r.sent_s)) - (len(requests) - left)
            waiting = in_system - self.manager.continuous_batching_config.max_requests_per_batch
            if stopped := limits.why_stop(time.perf_counter() - t0, waiting, left, last_due_s):
                break
            out = self.manager.get_result(timeout=0.05)
            if out is None or out.request_id not in key:
                continue
            if out.error:
                raise RuntimeError(f"continuous batching failed request {out.request_id}: {out.error}")
            r = key[out.request_id]
            r.start_s = out.lifespan[0] - t0
            r.tokens_s = [t - t0 for t in out.timestamps or []]
            r.tokens = list(out.generated_tokens)
            left -= 1
        if stopped:
            for rid, r in key.items():
                if not r.done and not math.isnan(r.sent_s):
                    self.manager.cancel_request(rid)
        count_overlaps(requests)
        return stopped

    def close(self) -> None:
        """Stop the manager's thread (it restores the model's attention)."""
        self._hook.remove()
        self.manager.stop(block=True, hard_stop=True)
        self.manager.destroy()
