"""Per-input-channel scales folded into the previous operation (AWQ, SmoothQuant).

Multiplying a Linear layer's weight columns by ``s`` and dividing its input by
``s`` leaves the float function unchanged; the division folds into what
produces the input. Per Llama decoder layer:

* ``input_layernorm``'s weight for ``q/k/v_proj``;
* ``post_attention_layernorm``'s weight for ``gate/up_proj``;
* ``up_proj``'s output rows for ``down_proj`` (its input is ``act(gate) * up``).

``o_proj`` is left alone: its input comes through attention, and with
grouped-query attention one v channel feeds several of its columns.
"""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import torch
from torch import nn

GROUPS = (("input_layernorm", "norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("post_attention_layernorm", "norm", ("mlp.gate_proj", "mlp.up_proj")),
          ("mlp.up_proj", "rows", ("mlp.down_proj",)))


def plan(model: nn.Module, selected: set[str], who: str) -> list[tuple[nn.Module, str, str, tuple[str, ...], str]]:
    """``(decoder layer, fold module, how, member layers, name of the first
    member)`` for every group whose members are all ``selected``."""
    decoder = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(decoder, nn.ModuleList):
        raise ValueError(f"{who}: {type(model).__name__} has no model.layers ModuleList")
    prefix = {id(m): n for n, m in model.named_modules()}
    out = []
    for layer in decoder:
        base = prefix[id(layer)]
        for fold_name, how, members in GROUPS:
            if all(f"{base}.{m}" in selected for m in members):
                out.append((layer, fold_name, how, members, f"{base}.{members[0]}"))
    return out


T = TypeVar("T")


@torch.inference_mode()
def capture(model: nn.Module, names: list[str], ids: torch.Tensor,
            reduce: Callable[[torch.Tensor, T | None], T]) -> dict[str, T]:
    """Run the calibration batch ``ids`` (one row at a time) and fold each named
    layer's input rows (``[tokens, K]``, fp32) into ``reduce(rows, so_far)``."""
    acc: dict[str, T | None] = {n: None for n in names}

    def hook(_m, args, _o, name):
        acc[name] = reduce(args[0].detach().reshape(-1, args[0].shape[-1]).float(), acc[name])

    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: hook(m, a, o, n)) for n in names]
    try:
        for row in ids:
            model(input_ids=row[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return acc


def fold(layer: nn.Module, fold_name: str, how: str, members: tuple[str, ...], s: torch.Tensor) -> None:
    """Divide the input of ``members`` by ``s`` (in ``fold_name``) and multiply their weight columns by it."""
    target = layer.get_submodule(fold_name)
    divisor = s if how == "norm" else s[:, None]
    target.weight.data = (target.weight.float() / divisor).to(target.weight.dtype)
    for m in members:
        lin = layer.get_submodule(m)
        lin.weight.data = (lin.weight.float() * s).to(lin.weight.dtype)


def row_sampler(rows: int, calls: int):
    """A ``capture`` reducer keeping ``rows / calls`` seeded random rows of each
    calibration window: ~``rows`` rows, every window alike."""
    per_call, gen = -(-rows // calls), torch.Generator().manual_seed(0)

    def reduce(x: torch.Tensor, so_far: torch.Tensor | None) -> torch.Tensor:
        picked = x[torch.randperm(len(x), generator=gen)[:per_call]]
        return picked if so_far is None else torch.cat([so_far, picked])

    return reduce


def search(alphas: Iterable[float], scale: Callable[[float], torch.Tensor],
           error: Callable[[torch.Tensor], float]) -> tuple[torch.Tensor, float, float]:
    """``(s, alpha, error ratio vs s = 1)``: of the scales ``scale(alpha)``, the
    one with the least ``error(s)`` (the quantized layers' output error on
    calibration rows with their input divided by ``s``); ties keep the first."""
    tried = [(error(s), a, s) for a in alphas for s in (scale(a),)]
    err, alpha, s = min(tried, key=lambda t: t[0])
    return s, alpha, err / max(error(torch.ones_like(s)), 1e-30)
