"""The export formats and what a weight scheme exports as (no heavy imports:
the scheme registry and the point's tag names).

``checkpoint``: a directory transformers and vLLM load (compressed-tensors for
quantized schemes, plain safetensors for float ones); ``gguf``: one llama.cpp
file. Each scheme answers through its handler's format mappings
(``schemes/<family>.py``); nothing here reads a scheme's fields.
"""
from __future__ import annotations

from typing import Any

from quantlab.errors import UserError
from quantlab.point import exportable_tag
from quantlab.schemes import registry

FORMATS = ("checkpoint", "gguf")


def format_name(fmt: str, spec: dict[str, Any]) -> str:
    """What a file of format ``fmt`` with mapping ``spec`` is called in tags and
    manifests: ``hf-bfloat16``, ``compressed-tensors/pack-quantized``, ``gguf/Q4_1``."""
    if fmt == "gguf":
        return f"gguf/{spec['type']}"
    return f"hf-{spec['dtype']}" if spec["format"] == "hf" else f"compressed-tensors/{spec['format']}"


def groups(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The config groups of a checkpoint mapping: a mixed mapping's candidates,
    else the mapping itself."""
    return list(spec["candidates"].values()) if "candidates" in spec else [spec]


def exportable_tags(weights: Any) -> dict[str, str]:
    """``exportable.<format>`` tags for a point of weight scheme ``weights``: what
    ``quantlab.export`` will write, or ``no: <why>`` (so the command line can
    refuse before loading anything)."""
    tags = {}
    for fmt in FORMATS:
        m = registry.weights_handler(weights).mapping(fmt, weights)
        tags[exportable_tag(fmt)] = format_name(fmt, m.spec) if m.ok else f"no: {m.reason}"
    return tags


def mapping(fmt: str, weights: Any) -> dict[str, Any]:
    """The scheme's ``fmt`` mapping (``checkpoint``: ``format``, ``dtype``,
    ``args``, optionally ``input_activations`` or mixed ``candidates``;
    ``gguf``: ``type``), or one line saying it has none."""
    m = registry.weights_handler(weights).mapping(fmt, weights)
    if not m.ok and fmt == "gguf":
        raise UserError(f"GGUF export of {weights.short_name()}: {m.reason}")
    if not m.ok:
        raise UserError(f"{fmt} export of {weights.short_name()} is not supported ({m.reason})")
    return m.spec
