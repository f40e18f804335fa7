"""Named architectures of models people ship, for latency at their real size
without their weights (optimum-benchmark's ``no_weights``): ``model=shape
model.shape.name=<name>`` builds the architecture from the published
``config.json`` fields below with seeded random weights.

Imports no torch: the shape is checked, and its size estimated, at compose time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Shape:
    """The ``config.json`` fields that set a decoder's cost. ``arch``:
    ``llama`` (LlamaForCausalLM) or ``qwen2`` (biases on q/k/v)."""

    arch: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    head_dim: Optional[int] = None  # None: hidden_size / num_attention_heads
    params: int = 0  # the published parameter count (count_params agrees exactly: tested)


# From each model's config.json on the Hugging Face hub; params: its safetensors' parameter count. Left
# out, as they change no cost: Llama 3.2's rope scaling (llama3 type), sliding windows that are off.
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape("llama", 576, 1536, 30, 9, 3, 49152, True, 100000.0, 8192, params=134_515_008),
    "smollm2-360m": Shape("llama", 960, 2560, 32, 15, 5, 49152, True, 100000.0, 8192, params=361_821_120),
    "smollm2-1.7b": Shape("llama", 2048, 8192, 24, 32, 32, 49152, True, 130000.0, 8192, params=1_711_376_384),
    "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151936, True, 1000000.0, 32768, params=494_032_768),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, True, 500000.0, 131072, 64, params=1_235_814_400),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, True, 500000.0, 131072, 128, params=3_212_749_824),
    "llama-3-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, False, 500000.0, 8192, params=8_030_261_248),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, False, 1000000.0, 32768, params=7_615_616_512),
}
FIELDS = tuple(f.name for f in dataclasses.fields(Shape) if f.name not in ("arch", "params"))


def resolve(name: str, overrides: dict[str, Any]) -> Shape:
    """The named shape with ``overrides`` (field -> value, None: the table's)
    applied; an override changes what is built, so ``params`` is recomputed."""
    base = SHAPES[name]
    changed = {k: v for k, v in overrides.items() if v is not None and v != getattr(base, k)}
    if not changed:
        return base
    shape = dataclasses.replace(base, **changed)
    return dataclasses.replace(shape, params=count_params(shape))


def head_dim(s: Shape) -> int:
    return s.head_dim or s.hidden_size // s.num_attention_heads


def count_params(s: Shape) -> int:
    """Parameters of the architecture (embeddings once when tied, RMSNorm weights,
    q/k/v biases for qwen2), without building it."""
    d, hd = s.hidden_size, head_dim(s)
    q, kv = s.num_attention_heads * hd, s.num_key_value_heads * hd
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if s.arch == "qwen2" else 0)
    mlp = 3 * d * s.intermediate_size
    layer = attn + mlp + 2 * d
    emb = s.vocab_size * d
    return s.num_hidden_layers * layer + d + emb * (1 if s.tie_word_embeddings else 2)


def hf_config_fields(s: Shape) -> dict[str, Any]:
    """Keyword arguments of transformers' LlamaConfig / Qwen2Config."""
    out = {k: getattr(s, k) for k in FIELDS if k != "head_dim"}
    out["head_dim"] = head_dim(s)
    return out
