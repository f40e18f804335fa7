"""KV-cache schemes. ``none`` keeps transformers' default dynamic cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlab.config import KVScheme
from quantlab.hardware import Hardware
from quantlab.schemes.registry import Applied, ApplyContext, Support, register_kv


@dataclass
class NoKV(KVScheme):
    """Unquantized KV cache in the model's compute dtype."""

    def short_name(self) -> str:
        return ""


def support(cfg: NoKV, hw: Hardware) -> Support:
    return Support("real")


def apply(model: torch.nn.Module, cfg: NoKV, ctx: ApplyContext) -> Applied:
    return Applied(backend="transformers-dynamic-cache", emulated=False)


register_kv("none", NoKV, support, apply)
