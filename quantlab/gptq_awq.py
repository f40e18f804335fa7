"""GPTQ and AWQ checkpoints read without their libraries: what each quantized
Linear's integers, zero points and scales are, and a float model whose
Linears hold what they dequantize to (``scheme/weights=as-is`` then rebuilds
them on quantlab's int4 kernel from the integers themselves).

GPTQ (``quant_method: gptq``; AutoGPTQ's and GPTQModel's ``gptq`` layout, or
``gptq_v2``): ``qweight`` int32 ``[K * bits / 32, N]``, ``32 / bits`` input
channels per word, lowest bits first; ``qzeros`` int32 ``[G, N * bits / 32]``,
output channels packed the same way, holding ``zero - 1`` in the ``gptq``
layout (the zero itself in ``gptq_v2``); ``scales`` ``[G, N]``; ``g_idx``
``[K]``, each input channel's group (``k // group_size`` unless quantized in
activation order). ``w[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`` with
``g = g_idx[k]``.

AWQ (``quant_method: awq``, ``version: gemm``): ``qweight`` int32 ``[K, N/8]``
and ``qzeros`` ``[G, N/8]``: 8 output channels per word in AWQ's interleaved
order (bits ``4i .. 4i+3`` hold channel ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``);
``scales`` ``[G, N]``; zeros as stored; groups contiguous.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from quantlab import model_files
from quantlab.artifacts import Layout, gptq_awq_layout

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output channel (within 8) held by nibble i
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclasses.dataclass
class Packed:
    """One Linear's integers: ``q`` ``[N, K]`` (``0 .. 2**bits - 1``), ``zero``
    and ``scale`` ``[N, G]``, ``group`` ``[K]`` (each input's group)."""

    q: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    group: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` the integers stand for."""
        return (self.q.float() - self.zero.float()[:, self.group]) * self.scale.float()[:, self.group]

    def contiguous_groups(self) -> int:
        """The group size where input ``k`` is in group ``k // size`` for a
        size dividing K, else 0."""
        k, g = self.group.numel(), self.scale.shape[1]
        size = k // g if k % g == 0 else 0
        return size if size and torch.equal(self.group, torch.arange(k) // size) else 0


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding ``32 / bits`` values each, lowest bits first, along
    ``dim`` (0 or 1); unsigned values as int32."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.to(torch.int32)
    vals = (w.unsqueeze(-1) >> shifts) & (2 ** bits - 1)  # [..., per]
    if dim == 1:
        return vals.reshape(w.shape[0], w.shape[1] * per)
    return vals.permute(0, 2, 1).reshape(w.shape[0] * per, w.shape[1])


def read(lay: Layout, tensors, name: str, n: int, k: int) -> Packed:
    """Linear ``name`` (``n`` outputs, ``k`` inputs) of a checkpoint whose
    tensors ``tensors.get(key)`` gives; ``ValueError`` on shapes that do not fit."""
    scale = tensors.get(f"{name}.scales").float().t().contiguous()  # [N, G]
    qzeros = tensors.get(f"{name}.qzeros")
    if lay.method == "awq":
        order = torch.tensor(AWQ_ORDER)
        q = _unpack(tensors.get(f"{name}.qweight"), 4, 1)  # [K, N] in packed order
        z = _unpack(qzeros, 4, 1)
        inverse = torch.argsort(order)
        q = q.reshape(k, -1, 8)[..., inverse].reshape(k, -1)
        z = z.reshape(z.shape[0], -1, 8)[..., inverse].reshape(z.shape[0], -1)
        g = scale.shape[1]
        group = torch.arange(k) // (k // g)
    else:
        q = _unpack(tensors.get(f"{name}.qweight"), lay.bits, 0)  # [K, N]
        z = _unpack(qzeros, lay.bits, 1)
        group = tensors.get(f"{name}.g_idx").long() if tensors.has(f"{name}.g_idx") else \
            torch.arange(k) // (k // scale.shape[1])
    if q.shape != (k, n) or z.shape[1] < n or scale.shape[0] != n:
        raise ValueError(f"{lay.method} {name}: qweight unpacks to {tuple(q.shape)}, the model's Linear is "
                         f"[{k}, {n}] (in, out): not this model's checkpoint")
    zero = (z[:, :n] + lay.zero_offset) & (2 ** lay.bits - 1) if lay.zero_offset else z[:, :n]
    return Packed(q.t().contiguous(), zero.t().contiguous(), scale, group)


def quantized_names(tensors: model_files.Tensors) -> list[str]:
    """The Linears a checkpoint stores packed (those with a ``qweight``)."""
    return sorted(k.removesuffix(".qweight") for k in tensors.keys() if k.endswith(".qweight"))


def load(folder: Path, dtype: torch.dtype):
    """The model of a GPTQ/AWQ checkpoint directory with every packed Linear
    dequantized into its ``weight`` (``dtype``); the other tensors as stored
    (an all-zero bias of a Linear the architecture builds without one is
    dropped: some GPTQ writers save one). ``ValueError`` naming the keys
    where the checkpoint and the architecture its config names do not match."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    q = getattr(config, "quantization_config", None)
    lay, why = gptq_awq_layout(q if isinstance(q, dict) else q.to_dict())
    if lay is None:
        raise ValueError(f"{folder}: {why}")
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = model_files.Tensors(folder)
    modules = dict(model.named_modules())
    state = {}
    for name in quantized_names(tensors):
        lin = modules.get(name)
        if not isinstance(lin, torch.nn.Linear):
            raise ValueError(f"{folder}: {name}.qweight has no Linear {name} in {type(model).__name__}")
        state[f"{name}.weight"] = read(lay, tensors, name, lin.out_features, lin.in_features).dequantize().to(dtype)
    for key in tensors.keys():
        owner, suffix = key.rsplit(".", 1) if "." in key else ("", key)
        if suffix in SUFFIXES:
            continue
        t = tensors.get(key)
        if suffix == "bias" and getattr(modules.get(owner), "bias", 0) is None and not t.any():
            continue  # AutoGPTQ saved a zero bias for a Linear that has none
        state[key] = t
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k == "lm_head.weight" and config.get_text_config().tie_word_embeddings}
    if unexpected or set(missing) - tied:
        raise ValueError(f"{folder}: the checkpoint does not fit {type(model).__name__}: missing "
                         f"{sorted(set(missing) - tied)[:4]}, unexpected {sorted(unexpected)[:4]}")
    model.tie_weights()
    return model.eval()
