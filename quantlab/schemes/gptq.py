"""GPTQ INT4, calibrated, run sequentially decoder layer by decoder layer.

Each decoder layer sees the outputs of the already-quantized layers before it
(as in the GPTQ paper); inside a layer, every Linear's Hessian comes from the
float layer's own inputs. The result is packed into the same ``Int4Linear``
(tinygemm kernel) that RTN uses, so GPTQ and RTN points differ only in which
integers they chose.

Why not GPTQModel: 7.6.0 is a source build with C++ extensions that pins
numpy==2.2.6 and pulls datasets/pyarrow/maturin; torchao's prototype GPTQ
asserts CUDA. The solver is ~60 lines (``gptq_solver.py``) and tested against RTN.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from quantlab import calibration
from quantlab.hardware import Hardware
from quantlab.schemes import layers
from quantlab.schemes.configs import GPTQScheme
from quantlab.schemes.gptq_solver import HessianAccumulator, gptq_int4
from quantlab.schemes.int4 import checkpoint as int4_checkpoint
from quantlab.schemes.int4 import gguf as int4_gguf
from quantlab.schemes.qlinear import Int4Linear, prefill_tags
from quantlab.schemes.registry import Applied, ApplyContext, Support, register_weights

log = logging.getLogger("quantlab")


def support(cfg: GPTQScheme, hw: Hardware) -> Support:
    if cfg.bits != 4:
        return Support("unsupported", f"no {cfg.bits}-bit groupwise kernel wired in quantlab yet (4-bit only)")
    if hw.device == "cpu":
        return Support("real")
    return Support("unsupported", f"GPTQ int4 packing is CPU-only (tinygemm CPU layout); not {hw.device}")


class _Stop(Exception):
    """Raised by the hook that captures the first decoder layer's inputs."""


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers_ = getattr(inner, "layers", None)
    if not isinstance(layers_, nn.ModuleList):
        raise ValueError(f"GPTQ: {type(model).__name__} has no model.layers ModuleList")
    return layers_


def _first_layer_inputs(model, decoder, ids: torch.Tensor):
    """Hidden states and kwargs (rotary embeddings, masks) entering layer 0, per sample."""
    captured = []

    def hook(_mod, args, kwargs):
        captured.append((args[0] if args else kwargs.pop("hidden_states"), kwargs))
        raise _Stop

    handle = decoder[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for row in ids:
            try:
                model(input_ids=row[None], use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return captured


class SharedInputs:
    """The Hessians of one decoder layer's Linears, one per distinct input:
    q/k/v read the same normalized hidden states and gate/up the same MLP
    input, so their ``2 X^T X / n`` is one matrix, accumulated once (the same
    sums as one accumulator per Linear: 3 of 7 accumulations saved).

    ``hook(name)`` is a forward hook for the Linear ``name``; call
    :meth:`next_sample` between forwards. Inputs are recognised by identity
    within a forward (held alive until then, so an id is never reused)."""

    def __init__(self):
        self.of: dict[str, HessianAccumulator] = {}
        self._live: dict[int, tuple[torch.Tensor, HessianAccumulator]] = {}

    def hook(self, name: str):
        def add(_mod, args, _out):
            x = args[0]
            seen = self._live.get(id(x))
            acc = self.of.get(name)
            if acc is None:
                acc = self.of[name] = seen[1] if seen else HessianAccumulator(x.shape[-1])
            if seen is None or seen[1] is not acc:
                acc.add(x)
                self._live[id(x)] = (x, acc)
        return add

    def next_sample(self) -> None:
        self._live.clear()

    def hessians(self) -> dict[str, torch.Tensor]:
        """Each Linear's ``2 X^T X / n`` (fp64), computed once per distinct input."""
        value: dict[int, torch.Tensor] = {}
        for acc in self.of.values():
            if id(acc) not in value:
                value[id(acc)] = acc.value()
        return {n: value[id(acc)] for n, acc in self.of.items()}


def _run_layer(layer, hidden, kwargs):
    out = layer(hidden, **{k: v for k, v in kwargs.items() if k != "hidden_states"})
    return out[0] if isinstance(out, tuple) else out


@torch.inference_mode()
def sequential(model: nn.Module, selected: set[str], ids: torch.Tensor, solve) -> None:
    """Replace each selected Linear, decoder layer by decoder layer, by
    ``solve(linear, hessian)``: the Hessian of the inputs the layer sees once
    the layers before it are quantized (GPTQ's sequential order)."""
    decoder = _decoder_layers(model)
    states = _first_layer_inputs(model, decoder, ids)
    prefix = {id(m): n for n, m in model.named_modules()}
    for li, layer in enumerate(decoder):
        linears = {n: m for n, m in layer.named_modules()
                   if isinstance(m, nn.Linear) and f"{prefix[id(layer)]}.{n}" in selected}
        accs = SharedInputs()
        hooks = [m.register_forward_hook(accs.hook(n)) for n, m in linears.items()]
        for hidden, kw in states:
            _run_layer(layer, hidden, kw)
            accs.next_sample()
        for h in hooks:
            h.remove()
        hessians = accs.hessians()
        for n, m in linears.items():
            layers.replace(layer, n, solve(f"{prefix[id(layer)]}.{n}", m, hessians[n]))
        if li + 1 < len(decoder):  # the quantized layer's outputs feed the next one (the last one's: nothing)
            states = [(_run_layer(layer, hidden, kw), kw) for hidden, kw in states]
        log.info("gptq: layer %d/%d quantized (%d linears)", li + 1, len(decoder), len(linears))


def apply(model: nn.Module, cfg: GPTQScheme, ctx: ApplyContext) -> Applied:
    dtype = getattr(torch, cfg.compute_dtype)
    selected = dict(layers.select(model, cfg.skip))
    layers.check_group_size(list(selected.items()), cfg.group_size, cfg.short_name())
    ids, tags = calibration.batch_or_builtin(cfg.calibration, "gptq", ctx, cfg.n_samples, cfg.seq_len)

    def solve(_name, m, h):
        q, scale, zero = gptq_int4(m.weight.float(), h, cfg.group_size, cfg.symmetric, cfg.damp, cfg.act_order)
        return Int4Linear(q, scale, zero, cfg.group_size, m.bias, dtype)

    sequential(model, set(selected), ids, solve)
    layers.cast_parameters(model, dtype)
    return Applied(backend="quantlab.gptq+aten._weight_int4pack_mm_for_cpu", emulated=False, tags={**tags, **prefill_tags(dtype)})


register_weights("gptq", GPTQScheme, support, apply, checkpoint=int4_checkpoint, gguf=int4_gguf)
