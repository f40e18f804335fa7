"""Checkpoints quantized elsewhere, read as what they are: a compressed-tensors
directory (llm-compressor, ModelOpt exports) or a GGUF quant (llama.cpp's
``llama-quantize``). :func:`read` says from the files' own metadata (no
weights loaded, no torch) what an artifact's quantization is; a point with
``scheme/weights=as-is`` keeps it and measures the artifact against its float
original (``reference.path``).

What quantlab runs as itself:

* compressed-tensors ``pack-quantized`` int4 groups (symmetric or with zero
  points) and int8 channels: quantlab's int4/int8 kernels on the artifact's
  own integers and scales (``kernel`` ``int4`` / ``int8``); int8 channels
  with dynamic per-token int8 inputs (``int8-dyn``, W8A8);
* compressed-tensors ``float-quantized`` FP8 per channel or tensor, with or
  without dynamic per-token FP8 inputs (``fp8`` / ``fp8-dyn``): the codes
  stored, the GEMM emulated (as quantlab's own FP8);
* any other weight-only compressed-tensors format (NVFP4A16, MXFP4,
  FP8 blocks, int4 channels): the weights compressed-tensors decompresses,
  tagged emulated (``dequantized``);
* GPTQ (``gptq``/``gptq_v2`` layouts, 4 or 8 bits) and AWQ (``gemm``)
  checkpoints, read by :mod:`quantlab.gptq_awq` (no GPTQ/AWQ library): 4-bit
  with groups of 32-256 on quantlab's int4 kernel from the checkpoint's own
  integers, zeros and scales (``int4``; a GPTQ layer in activation order
  whose groups are not contiguous stays dequantized), anything else as the
  weights dequantize (``dequantized``);
* bitsandbytes 4-bit (NF4 / FP4, scales double-quantized or not): loaded
  by transformers as bitsandbytes' own Linear4bit modules and run on its
  kernels (``bnb4``);
* a GGUF whose tensor types gguf-py dequantizes: the file itself on
  llama.cpp, its tensors dequantized per type on the PyTorch targets
  (emulated latency, exact weights).

Everything else (activation formats other than those above, a quantized KV
cache, sparsity, transforms, 2/3-bit GPTQ, AWQ's gemv layouts, bitsandbytes
8-bit) is named in one line by :func:`read`'s ``unsupported``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from quantlab import model_files

FLOAT_GGML = ("F32", "F16", "BF16", "F64")
READS = ("quantlab reads compressed-tensors (llm-compressor, ModelOpt's compressed-tensors export), GPTQ (4/8-bit), "
         "AWQ (gemm), bitsandbytes 4-bit checkpoints and GGUF files as they are")
# on a point whose model is a GGUF quant taken as a float model (its dequantized weights): what the file was
DEQUANTIZED_TAG = "model.dequantized_from"


@dataclasses.dataclass(frozen=True)
class Artifact:
    family: str  # "compressed-tensors" | "gptq" | "awq" | "bitsandbytes" | "gguf"
    label: str  # short, for a point's name: "w4a16-g32", "fp8-dynamic", "Q4_K_M"
    description: str  # in words, for tags and messages
    kernel: str  # int4 | int8 | int8-dyn | fp8 | fp8-dyn | bnb4 | dequantized | llama.cpp
    unsupported: str = ""  # why quantlab cannot measure it as itself ('' when it can)


def read(cfg: Any) -> Artifact | None:
    """The quantization model config ``cfg``'s files carry (``hf``: its
    ``config.json``'s ``quantization_config``; ``gguf``: its tensor types),
    or None for a float model, another source, or files not readable here."""
    if cfg.source == "gguf" and cfg.path and Path(cfg.path).expanduser().is_file():
        return _gguf(Path(cfg.path).expanduser())
    if cfg.source == "hf":
        q = (model_files._hf_config(cfg) or {}).get("quantization_config")
        return _compressed_tensors(q) if isinstance(q, dict) else None
    return None


def _gguf(path: Path) -> Artifact | None:
    import gguf
    from gguf.quants import _type_traits

    file_type, types = model_files.gguf_matrix_types(str(path))
    names = {gguf.GGMLQuantizationType(t).name if t in gguf.GGMLQuantizationType._value2member_map_ else f"type {t}":
             n for t, n in types.items()}
    if all(n in FLOAT_GGML for n in names):
        return None
    unknown = sorted(n for n in names if n.startswith("type "))
    if unknown:
        return Artifact("gguf", "?", f"GGUF with {', '.join(unknown)}", "llama.cpp",
                        f"GGUF tensor {', '.join(unknown)}: unknown to gguf-py {gguf.__name__} here")
    mix = model_files.gguf_type_mix_text(str(path))
    known = {t.value: t.name for t in gguf.LlamaFileType}
    label = known.get(file_type, "").removeprefix("MOSTLY_") or max(names, key=names.get)
    readable = {t.name for t in _type_traits} | set(FLOAT_GGML)
    unreadable = sorted(n for n in names if n not in readable)
    return Artifact("gguf", label, f"GGUF {label}: {mix}", "llama.cpp",
                    f"GGUF tensor types {', '.join(unreadable)}: gguf-py cannot dequantize them" if unreadable else "")


def _compressed_tensors(q: dict) -> Artifact:
    method = str(q.get("quant_method", "unknown")).lower()
    if method in ("gptq", "awq"):
        return _gptq_awq(q, method)
    if method == "bitsandbytes":
        return _bitsandbytes(q)
    if method != "compressed-tensors":
        return Artifact(method, method, f"{method} checkpoint", "", f"a {method} checkpoint: {READS}")
    for key, what in (("kv_cache_scheme", "a quantized KV cache"), ("sparsity_config", "sparsity"),
                      ("transform_config", "transforms (rotations)")):
        if q.get(key):
            return Artifact(method, "?", f"compressed-tensors with {what}", "",
                            f"compressed-tensors {key} ({what}): not read as-is yet")
    fmt = q.get("format") or ""
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        return Artifact(method, "?", "compressed-tensors without config groups", "",
                        "compressed-tensors quantization_config has no config_groups")
    read_groups = [_group(g, g.get("format") or fmt) for g in groups]
    bad = next((why for _, _, why in read_groups if why), "")
    labels = sorted({label for label, _, _ in read_groups})
    kernels = {kernel for _, kernel, _ in read_groups}
    kernel = kernels.pop() if len(kernels) == 1 else "dequantized"
    label = labels[0] if len(labels) == 1 else "mixed-" + "+".join(labels)
    ignore = q.get("ignore") or []
    return Artifact(method, label, f"compressed-tensors {fmt}: {label}"
                    f"{' (not ' + ', '.join(ignore) + ')' if ignore else ''}", kernel, bad)


TINYGEMM_GROUPS = (32, 64, 128, 256)  # int4 groups quantlab's CPU kernel takes (schemes' choices too)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A GPTQ or AWQ checkpoint's ``quantization_config``: what
    :mod:`quantlab.gptq_awq` needs to read its packed tensors."""

    method: str  # gptq | awq
    bits: int
    group_size: int  # -1: one group per output channel (all of K)
    sym: bool
    desc_act: bool  # GPTQ quantized in activation order (g_idx may permute groups)
    zero_offset: int  # added to a stored zero: 1 for GPTQ's v1 layout, else 0

    @property
    def label(self) -> str:
        g = f"-g{self.group_size}" if self.group_size > 0 else "-channel"
        return (f"{self.method}-w{self.bits}{g}" + ("" if self.sym or self.method == "awq" else "-asym")
                + ("-act-order" if self.desc_act else ""))


def gptq_awq_layout(q: dict) -> tuple[Layout | None, str]:
    """``(layout, why unsupported)`` of a GPTQ or AWQ ``quantization_config``."""
    method = str(q.get("quant_method", "")).lower()
    bits, group = int(q.get("bits", q.get("w_bit", 0)) or 0), int(q.get("group_size", q.get("q_group_size", -1)))
    if method == "gptq":
        fmt = str(q.get("checkpoint_format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            return None, f"a GPTQ checkpoint in the {fmt!r} layout: quantlab reads the gptq and gptq_v2 layouts"
        if bits not in (4, 8):
            return None, f"a {bits}-bit GPTQ checkpoint: quantlab reads 4- and 8-bit GPTQ (2/3 bits not yet)"
        return Layout("gptq", bits, group, bool(q.get("sym", True)), bool(q.get("desc_act", False)),
                      1 if fmt == "gptq" else 0), ""
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            return None, f"an AWQ checkpoint packed for {version!r}: quantlab reads AWQ's gemm layout"
        if bits != 4 or not q.get("zero_point", True):
            return None, f"AWQ with bits={bits}, zero_point={q.get('zero_point')}: quantlab reads 4-bit with zeros"
        return Layout("awq", 4, group, False, False, 0), ""
    return None, f"a {method} checkpoint"


def gptq_awq_kernel(lay: Layout) -> str:
    """``int4`` where quantlab's int4 kernel runs the layers as stored
    (4 bits, a tinygemm group size; GPTQ's activation order is checked per
    layer when the model is built), else ``dequantized``."""
    return "int4" if lay.bits == 4 and lay.group_size in TINYGEMM_GROUPS else "dequantized"


def _gptq_awq(q: dict, method: str) -> Artifact:
    lay, why = gptq_awq_layout(q)
    if lay is None:
        return Artifact(method, method, f"{method} checkpoint", "", f"{why}; {READS}")
    group = f"groups of {lay.group_size}" if lay.group_size > 0 else "one scale per output channel"
    return Artifact(method, lay.label, f"{method.upper()} {lay.bits}-bit, {group}"
                    f"{'' if lay.sym else ', zero points'}{', activation order' if lay.desc_act else ''}",
                    gptq_awq_kernel(lay))


def _bitsandbytes(q: dict) -> Artifact:
    """A transformers checkpoint bitsandbytes quantized: 4-bit NF4/FP4 blocks
    (optionally with their scales quantized again), run by bitsandbytes itself."""
    if not (q.get("load_in_4bit") or q.get("_load_in_4bit")):
        return Artifact("bitsandbytes", "bnb-int8", "bitsandbytes 8-bit (LLM.int8)", "",
                        f"a bitsandbytes 8-bit (LLM.int8) checkpoint: not read as-is yet; {READS}")
    kind = str(q.get("bnb_4bit_quant_type", "fp4")).lower()
    double = bool(q.get("bnb_4bit_use_double_quant"))
    return Artifact("bitsandbytes", f"bnb-{kind}" + ("-dq" if double else ""),
                    f"bitsandbytes 4-bit {kind.upper()}{', scales double-quantized' if double else ''}", "bnb4")


def _group(g: dict, fmt: str) -> tuple[str, str, str]:
    """``(label, kernel, why unsupported)`` of one compressed-tensors config group."""
    w, a = g.get("weights") or {}, g.get("input_activations")
    if g.get("output_activations"):
        return "?", "", "compressed-tensors output activations: not read as-is"
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    size, sym = w.get("group_size"), w.get("symmetric", True)
    if kind == "int":
        label = f"w{bits}a{a.get('num_bits', '?') if a else 16}" + (f"-g{size}" if strategy == "group" else "") + \
                ("" if sym else "-asym")
    elif kind == "float" and bits == 8:
        label = ("fp8-dynamic" if a else "fp8-a16") + ("-block" if strategy == "block" else "")
    elif kind == "float" and bits == 4:
        label = ("nvfp4" if size == 16 else "mxfp4" if size == 32 else f"fp4-g{size}") + ("" if a else "-a16")
    else:
        label = f"{kind}{bits}-{strategy}"
    if a:
        dyn_token = a.get("dynamic") is True and a.get("strategy") == "token" and a.get("symmetric", True)
        if kind == "int" and bits == 8 and strategy == "channel" and sym and dyn_token and \
                a.get("type", "int") == "int" and a.get("num_bits") == 8:
            return label, "int8-dyn", ""
        if kind == "float" and bits == 8 and strategy in ("channel", "tensor") and dyn_token and \
                a.get("type") == "float" and a.get("num_bits") == 8:
            return label, "fp8-dyn", ""
        return label, "", (f"compressed-tensors {label} ({a.get('type', 'int')}{a.get('num_bits')} "
                           f"{a.get('strategy')} {'dynamic' if a.get('dynamic') else 'static'} input activations): "
                           "quantlab measures as-is int8/FP8 dynamic per-token inputs and weight-only formats")
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and strategy == "group":
        return label, "int4", ""
    if fmt == "pack-quantized" and kind == "int" and bits == 8 and strategy == "channel" and sym:
        return label, "int8", ""
    if fmt == "float-quantized" and kind == "float" and bits == 8 and strategy in ("channel", "tensor"):
        return label, "fp8", ""
    return label, "dequantized", ""


def dequantized_from(cfg: Any) -> Artifact | None:
    """The quantization a float model's weights were dequantized from: a
    GGUF quant under a scheme other than ``as-is``, and ``model=smollm2-135m``,
    quantlab's offline float model, which is its package's Q4_1 file
    dequantized (to measure that file as itself: ``model=gguf
    model.path=<the file>``)."""
    if cfg.source == "smollm2" and (path := model_files.smollm2_gguf_path()) is not None:
        return _gguf(path)
    art = read(cfg)
    return art if art is not None and art.family == "gguf" else None


def vocab_size(cfg: Any) -> int | None:
    """The vocabulary a model's files declare (``config.json``'s
    ``vocab_size``, a GGUF's token list), None where they do not say."""
    if cfg.source == "smollm2" and (path := model_files.smollm2_gguf_path()) is not None:
        return model_files.gguf_vocab_size(str(path))
    if cfg.source == "gguf" and cfg.path:
        return model_files.gguf_vocab_size(str(Path(cfg.path).expanduser()))
    config = model_files._hf_config(cfg) or {}
    return (config.get("text_config") or config).get("vocab_size")


def tokenizer_vocab(cfg: Any) -> dict[str, int] | None:
    """The token -> id table of a local transformers directory's
    ``tokenizer.json`` (its model's vocabulary and added tokens), None
    where there is none."""
    if cfg.source != "hf" or not cfg.path or not (p := Path(cfg.path).expanduser() / "tokenizer.json").is_file():
        return None
    tok = json.loads(p.read_text())
    vocab = dict((tok.get("model") or {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens") or []})
    return vocab


def check(run_cfg: Any) -> None:
    """Launch rules of a point that measures an artifact as itself
    (``scheme/weights=as-is``): the artifact is quantized in a format
    quantlab reads, a local directory or file; its float original is given
    (``reference``), is not the artifact, and has the same vocabulary and
    tokenizer. ``ValueError`` in one line. (A point whose model and scheme do
    not go together, an artifact with another scheme or ``as-is`` on a float
    model, is a skipped point: see :func:`mismatch`.)"""
    if not run_cfg.scheme.weights.KEEPS_ARTIFACT:
        return
    model, ref_cfg = run_cfg.model, run_cfg.reference
    art = read(model)
    if art is None:
        return
    if art.unsupported:
        raise ValueError(f"model.path={model.path}: {art.unsupported}")
    if model.source == "hf" and not Path(model.path).expanduser().is_dir():
        raise ValueError(f"model.path={model.path}: scheme/weights=as-is reads a local checkpoint directory "
                         f"(its tensors as stored): download it first (huggingface-cli download)")
    if not ref_cfg.given:
        raise ValueError(f"scheme/weights=as-is measures {_named(model)} against its float original: set "
                         f"reference.path=<the unquantized checkpoint> (a directory or .gguf; or "
                         f"reference.source=smollm2)")
    ref = ref_cfg.model(model)
    if ref.path and model.path and Path(ref.path).expanduser().resolve() == Path(model.path).expanduser().resolve():
        raise ValueError(f"reference.path={ref_cfg.path} is the artifact itself: give its float original")
    if ref.source == "hf" and (ref_art := read(ref)) is not None:
        raise ValueError(f"reference.path={ref_cfg.path} is quantized too ({ref_art.description}): give the "
                         f"float original")
    a, b = vocab_size(model), vocab_size(ref)
    if a and b and a != b:
        raise ValueError(f"reference {_named(ref)} has a vocabulary of {b} tokens, the artifact {model.path} "
                         f"{a}: not its original (their log-probabilities cannot be compared)")
    ta, tb = tokenizer_vocab(model), tokenizer_vocab(ref)
    if ta is not None and tb is not None and ta != tb:
        diff = sorted(set(ta.items()) ^ set(tb.items()))
        raise ValueError(f"reference {_named(ref)} tokenizes differently from the artifact {model.path} "
                         f"({len(diff)} token ids differ, e.g. {diff[:3]}): not its original")


def compute_dtype(cfg: Any, asked: str) -> str:
    """``asked``, or for ``auto`` the dtype a checkpoint's config names
    (``dtype``/``torch_dtype``; bfloat16 where it names none quantlab
    computes in; float32 for a GGUF, what gguf-py dequantizes to)."""
    if asked != "auto":
        return asked
    config = model_files._hf_config(cfg) or {}
    dtype = str(config.get("dtype") or config.get("torch_dtype") or ("float32" if cfg.source == "gguf" else ""))
    return dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"


def mismatch(run_cfg: Any) -> str:
    """Why a point's model and weight scheme do not go together ('' when
    they do): ``as-is`` on a model that is not a quantized artifact, or
    another scheme over a transformers checkpoint quantized elsewhere (it
    would load dequantized and be compared with itself). A GGUF quant under
    another scheme stays what it was: a float model its dequantized weights
    make (the offline SmolLM2 file is a Q4_1), tagged so (:data:`DEQUANTIZED_TAG`)."""
    as_is = run_cfg.scheme.weights.KEEPS_ARTIFACT
    art = read(run_cfg.model)
    if as_is and art is None:
        return (f"scheme/weights=as-is keeps the quantization of a checkpoint made elsewhere; {_named(run_cfg.model)} "
                f"is not one (a float model: quantize it with another scheme)")
    if not as_is and art is not None and art.family != "gguf":
        return (f"model.path={run_cfg.model.path} is quantized already ({art.description}): measure it as itself "
                f"with scheme/weights=as-is reference.path=<its float original>")
    return ""


def _named(cfg: Any) -> str:
    return f"{cfg.source}:{cfg.path}" if cfg.path else f"model.source={cfg.source}"
