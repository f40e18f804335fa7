"""A quantized point as a GGUF file that llama.cpp (and ollama, LM Studio) runs,
written from the point's *own integers*: nothing is re-quantized.

Mapping (llama.cpp blocks are 32 weights along K, one fp16 scale each):

==========================  ===========  ==========================================
quantlab scheme             GGUF type    block from the point's integers
==========================  ===========  ==========================================
int8 (per channel, sym.)    ``Q8_0``     ``d = fp16(scale[n])``, ``q`` unchanged
int4 / GPTQ symmetric       ``Q4_0``     ``d = fp16(scale[n, g])``, ``q`` (0..15,
                                         zero point 8) unchanged
int4 / GPTQ asymmetric      ``Q4_1``     ``d = fp16(scale)``, ``m = fp16(-zp*scale)``
mxfp4-a16                   ``MXFP4``    the E8M0 exponent and the 32 E2M1 codes
                                         unchanged (lossless: same format)
fp32 / fp16 / bf16          F32/F16/BF16 the tensors as they are
==========================  ===========  ==========================================

A group of 64 (or 128, 256) spans 2 (4, 8) blocks that share its ``d``/``m``.
The only change is the fp16 rounding of ``d`` and ``m`` (relative 2^-11; GGUF
stores them in fp16). 1-D tensors (norms) are F32, as llama.cpp requires; the
embedding and any unquantized matrix keep the point's compute dtype. Q and K
projections are row-permuted to llama.cpp's rotary layout (the inverse of what
transformers does when it reads a GGUF), scales and zero points with them.

Llama-architecture models only (``LlamaForCausalLM``: Llama, SmolLM, TinyLlama).
The tokenizer is copied from the source GGUF when the model came from one;
otherwise it is written from a byte-level BPE ``tokenizer.json`` (``gpt2``
model, ``default`` pre-tokenizer).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from quantlab import model_files, models
from quantlab.digest import private_tmp
from quantlab.errors import UserError
from quantlab.schemes.fplinear import MXLinear
from quantlab.schemes.qlinear import Int4Linear, Int8Linear

BLOCK = 32
# a point made by llama.cpp's quantizer (scheme gguf-*): its file's name in target.gguf_cache and its sha256,
# as the point's run records them; its GGUF export ships that very file
MADE_FILE_TAG, MADE_SHA_TAG = "gguf.file", "gguf.sha256"
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "MXFP4")
PACKED = (Int4Linear, Int8Linear, MXLinear)  # layers written from their own codes


def _fp16_bytes(x: torch.Tensor) -> np.ndarray:
    """``[N, B]`` float -> ``[N, B, 2]`` uint8 of its fp16 form."""
    return x.to(torch.float16).numpy().view(np.uint8).reshape(*x.shape, 2)


def _per_block(x: torch.Tensor, k: int) -> torch.Tensor:
    """Per-group ``[N, G]`` values repeated onto the ``[N, K/32]`` blocks they cover."""
    return x.repeat_interleave((k // BLOCK) // x.shape[1], dim=1)


def pack_q8_0(q: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """``q [N, K]`` in -127..127, ``scale [N, G]`` -> ``[N, K/32 * 34]`` bytes."""
    n, k = q.shape
    d = _fp16_bytes(_per_block(scale.float(), k))
    qs = q.to(torch.int8).numpy().view(np.uint8).reshape(n, k // BLOCK, BLOCK)
    return np.concatenate([d, qs], axis=-1).reshape(n, -1)


def _nibbles(q: torch.Tensor) -> np.ndarray:
    """ggml's 4-bit layout: byte j of a block = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    b = q.to(torch.uint8).numpy().reshape(n, k // BLOCK, BLOCK)
    return (b[..., :16] | (b[..., 16:] << 4)).astype(np.uint8)


def pack_q4_0(q: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """``w = (q - 8) * d``: ``q [N, K]`` in 0..15 -> ``[N, K/32 * 18]`` bytes."""
    d = _fp16_bytes(_per_block(scale.float(), q.shape[1]))
    return np.concatenate([d, _nibbles(q)], axis=-1).reshape(q.shape[0], -1)


def pack_q4_1(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> np.ndarray:
    """``w = q * d + m`` with ``d = scale``, ``m = -zero_point * scale``."""
    k = q.shape[1]
    d = _fp16_bytes(_per_block(scale.float(), k))
    m = _fp16_bytes(_per_block(-zero_point.float() * scale.float(), k))
    return np.concatenate([d, m, _nibbles(q)], axis=-1).reshape(q.shape[0], -1)


def pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> np.ndarray:
    """E2M1 codes ``[N, K]`` (``sign << 3 | index``, ggml's ``kvalues_mxfp4``
    order) and biased E8M0 exponents ``[N, K/32]`` -> ``[N, K/32 * 17]`` bytes.
    ggml reads ``kvalue * 2**(e - 128)`` with doubled values: the same numbers."""
    e = exponents.to(torch.uint8).numpy()[..., None]
    return np.concatenate([e, _nibbles(codes)], axis=-1).reshape(codes.shape[0], -1)


def dequantize(data: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> torch.Tensor:
    """The float weights llama.cpp reads back from packed blocks (for tests and checks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(np.ascontiguousarray(
        gguf_dequantize(data, GGMLQuantizationType[ggml_type]))).reshape(shape).float()


def _rotary_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order llama.cpp expects for a Q/K projection of ``n_head`` heads."""
    idx = torch.arange(n_rows)
    return idx.reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(n_rows)


def _matrix(mod: torch.nn.Module, float_type: str, rows: torch.Tensor | None):
    """``(ggml type, data)`` of one linear layer or embedding."""
    if isinstance(mod, Int8Linear):
        q, scale, _ = mod.int_weights()
        q, scale = (q, scale) if rows is None else (q[rows], scale[rows])
        return "Q8_0", pack_q8_0(q, scale)
    if isinstance(mod, Int4Linear):
        if mod.group_size % BLOCK:
            raise UserError(f"GGUF: int4 group size {mod.group_size} is not a multiple of 32 (llama.cpp blocks)")
        q, scale, zp = mod.int_weights()
        if rows is not None:
            q, scale, zp = q[rows], scale[rows], zp[rows]
        if bool((zp == 8).all()):
            return "Q4_0", pack_q4_0(q, scale)
        return "Q4_1", pack_q4_1(q, scale, zp)
    if isinstance(mod, MXLinear):
        if mod.elem != "fp4":
            raise UserError("GGUF: MXFP8 has no llama.cpp type (MXFP4 only)")
        codes, e = mod.elements(), mod.weight_scale
        return "MXFP4", pack_mxfp4(codes if rows is None else codes[rows], e if rows is None else e[rows])
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise UserError(f"GGUF: no llama.cpp type for {type(mod).__name__} (only int8, int4/GPTQ, MXFP4 and float)")
    w = w.detach()
    w = w if rows is None else w[rows]
    return float_type, _float_array(w, float_type)


def _float_array(w: torch.Tensor, ggml_type: str) -> np.ndarray:
    if ggml_type == "BF16":
        return w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(*w.shape[:-1], -1)
    return w.to(torch.float16 if ggml_type == "F16" else torch.float32).numpy()


def _float_type(model: torch.nn.Module) -> str:
    dtype = model.get_input_embeddings().weight.dtype
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]


def tensors(model: torch.nn.Module) -> list[tuple[str, str, np.ndarray, tuple[int, ...]]]:
    """``(gguf name, ggml type, data, logical shape [N, K])`` for every tensor of a
    (quantized) Llama, in llama.cpp's names and Q/K row order."""
    cfg = model.config
    gguf_name = _namer(cfg)
    ftype = _float_type(model)
    # llama.cpp's llama graph applies RoPE to interleaved pairs: Q/K rows are permuted from HF's halves;
    # its qwen2 graph rotates halves (NeoX style), as HF does: no permutation
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} if cfg.model_type == "llama" else {}
    out = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if name == "lm_head" and cfg.tie_word_embeddings and not isinstance(mod, PACKED):
            continue  # tied: llama.cpp reads token_embd as the output matrix
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding, *PACKED)):
            gname = gguf_name(name)
            rows = _rotary_rows(mod.out_features, heads[leaf]) if leaf in heads else None
            gtype, data = _matrix(mod, ftype, rows)
            shape = tuple(mod.weight.shape) if hasattr(mod, "weight") else (mod.out_features, mod.in_features)
            out.append((gname, gtype, data, shape))
            bias = getattr(mod, "bias", None)
            if isinstance(bias, torch.Tensor):  # qwen2's q/k/v biases: F32, as llama.cpp's converter writes them
                b = bias.detach().float().numpy()
                out.append((gguf_name(name, "bias"), "F32", b, tuple(b.shape)))
        elif leaf.endswith("norm") and hasattr(mod, "weight"):
            w = mod.weight.detach().float().numpy()
            out.append((gguf_name(name), "F32", w, tuple(w.shape)))
    return out


def _namer(cfg):
    """``(module, kind="weight") -> llama.cpp tensor name`` for an HF config."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture(cfg).upper()], cfg.num_hidden_layers)

    def gguf_name(module: str, kind: str = "weight") -> str:
        found = names.get_name(f"{module}.{kind}", try_suffixes=(f".{kind}",))
        if found is None:
            raise UserError(f"GGUF: {module}.{kind} has no llama.cpp tensor name")
        return found

    return gguf_name


def matrix_names(model: torch.nn.Module) -> dict[str, str]:
    """``{module name: llama.cpp weight name}`` of every Linear; a tied LM
    head is ``token_embd.weight``, the matrix llama.cpp's output reads."""
    cfg = model.config
    gguf_name = _namer(cfg)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, *PACKED)):
            tied = name == "lm_head" and cfg.tie_word_embeddings
            out[name] = "token_embd.weight" if tied else gguf_name(name)
    return out


ARCHITECTURES = ("llama", "qwen2")


def architecture(cfg) -> str:
    """The GGUF architecture of an HF config (``llama``, ``qwen2``); one line
    naming the ones written otherwise."""
    if cfg.model_type not in ARCHITECTURES:
        raise UserError(f"GGUF export writes {', '.join(ARCHITECTURES)} architectures; this one is "
                        f"{cfg.model_type!r}")
    return cfg.model_type


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def _write_tokenizer(w, tokenizer, source_gguf: Path | None) -> None:
    import gguf

    if source_gguf is not None:
        reader = gguf.GGUFReader(str(source_gguf))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                w.add_key_value(key, field.contents(), field.types[0], sub)
        return
    import json

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE":
        raise UserError(f"GGUF: tokenizer model {spec['model']['type']} is not written (byte-level BPE only); "
                        "export from a GGUF-sourced model instead")
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_ids)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    if not merges:  # a pure byte-level vocabulary: llama.cpp needs the key and gguf
        # refuses empty arrays; a merge whose result is not in the vocabulary falls
        # back to the byte tokens, so this one changes no tokenization
        merges = [f"{tokens[0]} {tokens[0]}"]
    w.add_token_merges(merges)
    for attr, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                      ("pad_token_id", w.add_pad_token_id)):
        if getattr(tokenizer, attr, None) is not None:
            add(getattr(tokenizer, attr))
    w.add_add_bos_token(False)


def write(model: torch.nn.Module, tokenizer, dest: Path, source_gguf: Path | None = None,
          name: str = "quantlab") -> dict[str, int]:
    """Write ``dest`` (via a temp file, renamed when complete); returns the count
    of tensors per GGML type."""
    import gguf

    cfg = model.config
    items = tensors(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    w = gguf.GGUFWriter(str(tmp), architecture(cfg))
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(models.head_dim(cfg))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_vocab_size(cfg.vocab_size)
    _write_tokenizer(w, tokenizer, source_gguf)
    counts: dict[str, int] = {}
    for gname, gtype, data, shape in items:
        if gtype in ("F32", "F16"):
            w.add_tensor(gname, data)
        else:  # bytes; the writer derives the logical shape from the type's block size
            w.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType[gtype])
        counts[gtype] = counts.get(gtype, 0) + 1
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    tmp.replace(dest)
    return counts


def tensor_bytes(path: Path) -> float:
    """Bytes of all tensors in a GGUF file: what a decode step reads from it."""
    return float(sum(b for _, _, b in model_files.gguf_tensors(str(path))))


def quantize(src: Path, dest: Path, quant: str, importance: dict[str, np.ndarray] | None = None,
             threads: int = 0) -> None:
    """llama.cpp's quantizer (``llama_model_quantize``, the call behind
    ``llama-quantize``) from float GGUF ``src`` to ``quant`` (a name of its
    menu, e.g. ``Q4_K_M``) at ``dest`` (via a temp file, renamed when
    complete). ``importance``: ``{llama.cpp weight name: [K] float32}``, an
    importance matrix as ``llama-imatrix`` would give it; ``threads`` 0: all."""
    import ctypes

    import llama_cpp.llama_cpp as low

    params = low.llama_model_quantize_default_params()
    params.ftype = getattr(low, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = threads
    keep = []  # the arrays the C side reads until the call returns
    if importance:
        entries = (low.llama_model_imatrix_data * (len(importance) + 1))()  # the last: name NULL, the end
        for i, (name, values) in enumerate(sorted(importance.items())):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(arr)
            entries[i].name = name.encode()
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(low.llama_model_imatrix_data))
    tmp = private_tmp(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    rc = low.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) making {quant} from {src.name}")
    tmp.replace(dest)
