"""The in-process PyTorch engine (CPU and CUDA; eager or torch.compile)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import DynamicCache

from quantlab import models
from quantlab.decode import Clock, Decoded, decode_loop, greedy
from quantlab.engines.base import CAPABILITIES, Engine
from quantlab.schemes.kv import cache_bytes


class TorchEngine(Engine):
    """A transformers causal LM in this process. ``cache_factory(config=...)``
    makes the KV cache each request decodes into (a quantized one for a KV
    scheme, a ``StaticCache`` for fixed shapes). ``compiled`` says the forward
    is a torch.compile graph: per-module hooks would split it, so the stage
    table is refused. ``static``: the factory makes a ``StaticCache``, which is
    allocated once per batch size, outside any compiled graph, and reset per
    request (see :meth:`request_cache`)."""

    name = "pytorch"

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu",
                 cache_factory: Callable[..., Any] = DynamicCache, compiled: bool = False, static: bool = False):
        cfg = model.config.get_text_config(decoder=True)
        super().__init__(cfg.vocab_size, getattr(cfg, "max_position_embeddings", 2048))
        self.model = model
        self._device = torch.device(device)
        self.cache_factory = cache_factory
        self.compiled = compiled
        self.static = static
        self._static_caches: dict[int, Any] = {}

    @property
    def device(self) -> torch.device:
        return self._device

    def clock(self) -> Clock:
        return Clock(torch.cuda.synchronize if self._device.type == "cuda" else None)

    def cannot(self, probe: str) -> str:
        if probe not in CAPABILITIES:
            return super().cannot(probe)
        if probe == "stages" and self.compiled:
            return "compiled: per-module timing hooks would split the compiled graph and time another program"
        if probe == "continuous" and (self.compiled or self.static):
            return "transformers' continuous batching runs the eager model with its own paged cache"
        if probe == "continuous" and self.cache_factory is not DynamicCache:
            return ("transformers' paged cache keeps K/V in the compute dtype: the point's quantized KV cache "
                    "would not apply (dynamic and passthrough use it)")
        return ""

    def scheduler(self, max_batch: int, max_tokens: int):
        """transformers' continuous batching over this model (paged KV cache)."""
        from quantlab.serving.transformers_cb import ContinuousPolicy

        return ContinuousPolicy(self.model, max_batch, max_tokens)

    @torch.inference_mode()
    def request_cache(self, batch: int) -> Any:
        """The cache one request of ``batch`` sequences decodes into: a new one,
        or for a static cache the batch size's one, reset. A static cache is
        allocated here, eagerly: transformers marks its tensors as static
        addresses only outside a compiled graph, and CUDA graphs replay over
        static addresses (a cache first allocated inside the compiled prefill
        is a mutated input, and inductor skips graphs for it); one allocation
        per batch size also keeps those addresses fixed across requests."""
        if not self.static:
            return self.cache_factory(config=self.model.config)
        cache = self._static_caches.get(batch)
        if cache is not None:
            cache.reset()
            return cache
        cfg = self.model.config.get_text_config(decoder=True)
        cache = self.cache_factory(config=self.model.config)
        cache.early_initialization(batch_size=batch, num_heads=cfg.num_key_value_heads, head_dim=models.head_dim(cfg),
                                   dtype=self.model.get_input_embeddings().weight.dtype, device=self._device)
        self._static_caches[batch] = cache
        return cache

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids.to(self._device), use_cache=False).logits.float()

    @torch.inference_mode()
    def tail_logits(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """The model's own forward with ``logits_to_keep=n``: the head (and
        any logit scaling the model applies after it) runs on the last ``n``
        positions only."""
        if n < 1:
            raise ValueError(f"n={n}: at least one position")
        return self.model(input_ids=ids.to(self._device), use_cache=False, logits_to_keep=n).logits.float()

    @torch.inference_mode()
    def decode(self, prompt: torch.Tensor, n_new: int, clock: Clock | None = None,
               choose=greedy, record=None) -> Decoded:
        cache = self.request_cache(prompt.shape[0])

        def forward(ids: torch.Tensor, start: int) -> torch.Tensor:
            # The prefill keeps the last position only; steps keep every input position.
            return self.model(input_ids=ids, cache=cache, use_cache=True,
                              logits_to_keep=1 if start == 0 else 0).logits

        out = decode_loop(forward, prompt.to(self._device), n_new, clock or self.clock(), choose, record)
        out.kv_bytes = cache_bytes(cache)
        return out

    @torch.inference_mode()
    def decode_batch(self, prompts: list[torch.Tensor], n_new: int, clock: Clock | None = None) -> Decoded:
        """Prompts of different lengths as one greedy batch: left-padded, with
        an attention mask and each row's positions counted from its own first
        token, so every row decodes the tokens it would alone (tested)."""
        lengths = [len(p) for p in prompts]
        if len(set(lengths)) == 1:
            return super().decode_batch(prompts, n_new, clock)
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
        cache = self.request_cache(len(prompts))
        seen = [mask.to(self._device)]  # the mask over every position so far

        def forward(x: torch.Tensor, start: int) -> torch.Tensor:
            if start:
                seen[0] = torch.cat([seen[0], seen[0].new_ones(x.shape)], dim=1)
            pos = (seen[0].cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1]:]
            return self.model(input_ids=x, attention_mask=seen[0], position_ids=pos, cache=cache, use_cache=True,
                              logits_to_keep=1 if start == 0 else 0).logits

        out = decode_loop(forward, ids.to(self._device), n_new, clock or self.clock())
        out.kv_bytes = cache_bytes(cache)
        return out
