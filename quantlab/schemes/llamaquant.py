"""llama.cpp's own quant menu (``Q4_K_M``, ``Q6_K``, ``IQ4_XS``, ...): the
point's weights stay float here (cast to ``source_dtype``, what a GGUF
conversion writes before ``llama-quantize``), and the llama.cpp target hands
that file to llama.cpp's quantizer with the type and, when asked, an
importance matrix computed here. No other target runs these types.

The importance matrix is what ``llama-imatrix`` collects: for every Linear
(the LM head included), the mean over calibration tokens of each input
column's square, ``sum_t x[t, j]^2 / T``; llama.cpp's quantizer weighs each
column's rounding error by it.
"""
from __future__ import annotations

import logging

import torch

from quantlab import calibration
from quantlab.hardware import Hardware
from quantlab.schemes import layers
from quantlab.schemes.configs import LlamaQuantScheme
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

log = logging.getLogger("quantlab")


def support(cfg: LlamaQuantScheme, hw: Hardware) -> Support:
    return Support("unsupported", f"{cfg.short_name()}: a llama.cpp quant type, made and run by llama.cpp "
                                  "(target=llamacpp)")


@torch.no_grad()
def importance(model: torch.nn.Module, ids: torch.Tensor, batch: int = 4) -> dict[str, torch.Tensor]:
    """``{module name: [in_features] float32}``: each ``nn.Linear``'s mean
    squared input per column over every token of ``ids`` (``[n, seq]``)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def add(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return add

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        for i in range(0, ids.shape[0], batch):
            model(input_ids=ids[i:i + batch], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: (sums[n] / counts[n]).contiguous() for n in sums}


def apply(model: torch.nn.Module, cfg: LlamaQuantScheme, ctx: ApplyContext) -> Applied:
    tags = {"gguf.quant": cfg.quant}
    imatrix: dict[str, torch.Tensor] = {}
    if cfg.imatrix:
        ids, cal_tags = calibration.batch_or_builtin(cfg.calibration, cfg.short_name(), ctx, cfg.n_samples,
                                                     cfg.seq_len)
        log.info("importance matrix: %d x %d tokens", *ids.shape)
        imatrix = importance(model, ids)
        tags.update(cal_tags)
    layers.cast_parameters(model, getattr(torch, cfg.source_dtype))
    return Applied(backend="llama.cpp quantizer", emulated=False, tags=tags, importance=imatrix)


def gguf(cfg: LlamaQuantScheme) -> Mapping:
    """``quantize``: the type llama.cpp's quantizer makes from the float file."""
    return Mapping({"type": cfg.quant, "quantize": cfg.quant})


register_weights("gguf", LlamaQuantScheme, support, apply, gguf=gguf)
