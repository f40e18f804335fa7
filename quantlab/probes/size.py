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
    return t.numel() * t.element_size()


def weight_stats(model: torch.nn.Module) -> dict[str, float]:
    """Total parameter bytes and bits per weight (shared tensors counted once)."""
    total_bytes = 0
    total_numel = 0
    for p in model.parameters():
        total_bytes += tensor_bytes(p)
        total_numel += p.numel()
    for b in model.buffers():
        if b.is_floating_point() or b.dtype in (torch.int8, torch.uint8, torch.int32):
            total_bytes += tensor_bytes(b)
    return {
        "size/weight_bytes": float(total_bytes),
        "size/weight_mb": total_bytes / 2**20,
        "size/params": float(total_numel),
        "size/bits_per_weight": 8.0 * total_bytes / max(total_numel, 1),
    }
