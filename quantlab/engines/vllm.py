"""vLLM as an engine: a checkpoint directory served by a vLLM server
(:mod:`quantlab.serving.vllm_server`), spoken to over its completions API.

* ``logits(ids)``: the server's prompt log-probabilities of every position,
  the whole vocabulary per position (the server runs with
  ``--max-logprobs -1``); returned as float32 log-probabilities, which every
  probe treats as logits (``log_softmax`` leaves them as they are).
  ``logprobs_topk > 0`` asks for the top k only: then ``cannot("logits")``
  says so and the probes that need whole distributions are skipped.
* ``decode(prompt, n_new)``: one streamed greedy completion timed at the
  client: TTFT is the first streamed token's arrival after the request was
  sent, every later chunk one step.
* ``scheduler(max_batch, ...)``: vLLM's own continuous batching, the server
  restarted with ``--max-num-seqs max_batch`` when it runs with another.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch

from quantlab.decode import Clock, Decoded, greedy
from quantlab.engines.base import CAPABILITIES, Engine, check_first
from quantlab.errors import UserError
from quantlab.serving.vllm_server import ServerArgs, VllmPolicy, VllmServer

_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


class VllmEngine(Engine):
    """A vLLM server on ``args.model_dir`` started from interpreter ``python``."""

    name = "vllm"

    def __init__(self, python: str, args: ServerArgs, vocab_size: int, port: int | None = None,
                 ready_timeout_s: float = 600.0, logprobs_topk: int = 0):
        super().__init__(vocab_size, args.max_model_len)
        self.python, self.args, self.port, self.timeout_s = python, args, port, ready_timeout_s
        self.topk = logprobs_topk
        self.server = self._start(args)

    def _start(self, args: ServerArgs) -> VllmServer:
        server = VllmServer(self.python, args, self.port, self.timeout_s)
        self.metrics["vllm/ready_s"] = server.ready_s
        log = Path(server.log.name).read_text(errors="replace")
        if m := _KV_TOKENS.search(log):
            self.metrics["vllm/kv_cache_tokens"] = float(m.group(1).replace(",", ""))
        return server

    def cannot(self, probe: str) -> str:
        if probe == "logits":
            return "" if not self.topk else (f"the vLLM target asks for the top {self.topk} log-probabilities "
                                             "per position (target.logprobs_topk), not whole distributions")
        if probe == "stages":
            return "vLLM runs a whole step in its server: no per-module timing"
        if probe == "cache":
            return ("vLLM attends through its own KV cache in every forward: no cache-free reference on the "
                    "same engine; compare fid/* and perplexity against the float-cache point")
        if probe == "batch":
            return "one request at a time through decode; vLLM batches through its own scheduler (continuous)"
        if probe == "energy":
            return "the model runs in the vLLM server's processes, which quantlab's energy counter does not see"
        return "" if probe in CAPABILITIES else super().cannot(probe)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        if why := self.cannot("logits"):
            raise UserError(f"vllm: {why}")
        out = torch.full((*ids.shape, self.vocab_size), float("-inf"))
        for b, row in enumerate(ids.tolist()):
            for t, dist in enumerate(self.server.prompt_logprobs(row, -1)):
                idx = torch.tensor(list(dist), dtype=torch.long)
                out[b, t, idx] = torch.tensor([v for v, _ in dist.values()], dtype=torch.float32)
        return out

    def token_logprobs(self, ids: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """From the server's prompt log-probabilities (``k = 1``: the actual
        token always comes back with its rank); the server scores every
        position, ``first`` only trims what is returned."""
        check_first(ids, first)
        logp = torch.empty(ids.shape[0], ids.shape[1] - 1, dtype=torch.float64)
        top1 = torch.empty(logp.shape, dtype=torch.bool)
        for b, row in enumerate(ids.tolist()):
            for t, dist in enumerate(self.server.prompt_logprobs(row, 1, last=False)):
                logp[b, t], rank = dist[row[t + 1]]
                top1[b, t] = rank == 1
        return logp[:, first:], top1[:, first:]

    def topk_logprobs(self, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.topk and k > self.topk:
            raise UserError(f"vllm: probe.fidelity.topk={k} > target.logprobs_topk={self.topk} (what the server "
                            "was started to return)")
        vals, idx = torch.empty(ids.shape[1], k), torch.empty(ids.shape[1], k, dtype=torch.long)
        for t, dist in enumerate(self.server.prompt_logprobs(ids[0].tolist(), k)):
            best = sorted(dist.items(), key=lambda kv: kv[1][1])[:k]  # by rank (the actual token may be extra)
            idx[t] = torch.tensor([tok for tok, _ in best])
            vals[t] = torch.tensor([v for _, (v, _) in best])
        return vals, idx

    def decode(self, prompt: torch.Tensor, n_new: int, clock: Clock | None = None,
               choose: Callable[[Any, int], Any] = greedy,
               record: Callable[[Any], None] | None = None) -> Decoded:
        if prompt.shape[0] != 1:
            raise UserError(f"vllm: decode sends one sequence; probe.latency.batch_size={prompt.shape[0]} (and "
                            "grid_batch_sizes) must be 1 on this target (load: policy continuous batches)")
        if choose is not greedy or record is not None:
            raise UserError("vllm: the server decodes greedily itself; no host-side choice per step")
        clock = clock or self.clock()
        sent = clock.now_ms()
        times, chosen = [], []
        for _, ids in self.server.stream(prompt[0].tolist(), n_new):
            now = clock.now_ms()
            for tok in ids:  # tokens of one chunk arrived together: the gap is the first's
                times.append(now)
                chosen.append(torch.tensor([[tok]]))
        if len(times) != n_new:
            raise RuntimeError(f"vllm streamed {len(times)} tokens of {n_new}")
        steps = [b - a for a, b in zip(times, times[1:])]
        return Decoded(prefill_ms=times[0] - sent, step_ms=steps, chosen=chosen)

    def scheduler(self, max_batch: int, max_tokens: int):
        if max_batch != self.args.max_num_seqs:
            self.server.close()
            self.args.max_num_seqs = max_batch
            self.server = self._start(self.args)
        return VllmPolicy(self.server)

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()
            self.server = None
