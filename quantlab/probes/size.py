"""Bytes the weights really occupy, packed values + scales + zero points.

Quantized tensors are tensor subclasses (torchao) or parameters carrying
side state (bitsandbytes); their ``element_size`` lies, so this walks the
inner tensors that ``__tensor_flatten__`` exposes.
"""
from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of ``t``, recursing into tensor-subclass components."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    state = getattr(t, "quant_state", None)  # bitsandbytes Params4bit: absmax per block
    extra = 0
    if state is not None:
        extra = tensor_bytes(state.absmax)
        if state.nested:
            extra += tensor_bytes(state.state2.absmax) + tensor_bytes(state.offset)
    return t.numel() * t.element_size() + extra


def count_params(model: torch.nn.Module) -> int:
    """Logical number of weights (shared tensors once); call before quantizing,
    since packed storage changes ``numel``."""
    return sum(p.numel() for p in model.parameters())


def weight_stats(model: torch.nn.Module, n_params: int) -> dict[str, float]:
    """Bytes of parameters and persistent buffers (packed weights, scales, zero
    points) as stored, and bits per logical weight. Non-persistent buffers are
    derived tables, not weights (RoPE's ``inv_freq``, kept fp32 under every
    scheme), so the bytes scale with the scheme alone."""
    total_bytes = 0
    total_numel = n_params
    for p in model.parameters():
        total_bytes += tensor_bytes(p)
    seen: set[int] = set()
    for m in model.modules():
        for name, b in m.named_buffers(recurse=False):
            if name not in m._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                total_bytes += tensor_bytes(b)
    return {
        "size/weight_bytes": float(total_bytes),
        "size/weight_mb": total_bytes / 2**20,
        "size/params": float(total_numel),
        "size/bits_per_weight": 8.0 * total_bytes / max(total_numel, 1),
    }


def embedding_unread_bytes(model: torch.nn.Module, batch: int) -> float:
    """Bytes of the input embedding table a decode step does *not* read: all
    but ``batch`` rows when the table is its own tensor, 0 when it is tied to
    the LM head (which reads all of it every step)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is emb:
        return 0.0
    table = tensor_bytes(emb)
    return float(table - table * min(batch, emb.shape[0]) / emb.shape[0])
