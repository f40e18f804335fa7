"""Every scheme's config: the dataclasses Hydra composes and MLflow records.

This module imports neither torch nor any kernel library, so a command line
is composed and refused (unknown value, bad range, bad recipe file) before
anything heavy loads. The handlers that apply a config live in the scheme's
own module (``schemes/int4.py`` applies :class:`Int4Scheme`), named by the
config's ``HANDLER``; pyproject.toml's ``quantlab.schemes`` entry points name
each config under its schema (``weights.int4``, ``kv.int8``), as a plugin
package names its own.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from quantlab import resources
from quantlab.artifacts import TINYGEMM_GROUPS
from quantlab.schemes.base import KVScheme, WeightScheme

DEFAULT_SKIP = ["lm_head"]  # Linear layers no scheme quantizes unless told (fnmatch patterns)
GROUP_SIZES = TINYGEMM_GROUPS  # int4 groups the CPU kernel takes
FP8_FORMATS = ("e4m3", "e5m2")
FP8_ACTIVATIONS = ("none", "dynamic")
BNB4_QUANT_TYPES = ("nf4", "fp4")
HQQ_BITS = (4, 8)
AWQ_GRID = 20  # alpha in {0, 1/AWQ_GRID, ..., 1}
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
CALIBRATION_SETS = tuple(sorted(p.stem for p in resources.data_dir("calibration").glob("*.yaml")))


# The fields every quantizing scheme shares, each with its rule in one place (a scheme's own default beside it).
def dtype_field(default: str = "bfloat16") -> Any:
    """The dtype a quantized Linear computes in: activations, dequantized weights."""
    return field(default=default, metadata={"choices": COMPUTE_DTYPES})


def skip_field() -> Any:
    """The Linear layers left unquantized (fnmatch patterns; default: the LM head)."""
    return field(default_factory=lambda: list(DEFAULT_SKIP))


def calibration_field() -> Any:
    """The calibration set (a spec under ``calibration/``), checked at launch."""
    return field(default="wiki", metadata={"choices": CALIBRATION_SETS})


def samples_field(default: int) -> Any:
    """How many calibration windows."""
    return field(default=default, metadata={"min": 1})


def seq_len_field(default: int) -> Any:
    """Tokens per calibration window (at least 2: a window predicts its next token)."""
    return field(default=default, metadata={"min": 2})

# mixed recipes: a candidate per layer
KEEP = "bf16"
_INT4 = re.compile(r"^int4-g(?P<g>32|64|128|256)(?P<sym>-sym)?$")
# block-scaled weight-only formats a layer may take (emulated on CPU: a recipe with any is an emulated point)
FORMAT_CANDIDATES = ("nvfp4-a16", "mxfp4-a16", "mxfp8-a16", "fp8-block-a16")
CANDIDATES = f"bf16, int8, int4-g32/g64/g128/g256[-sym], {', '.join(FORMAT_CANDIDATES)}"
_RECIPE_KEYS = ("name", "default", "layers", "predicted", "source")  # the last two: what the sensitivity tool
# predicted and measured on, kept for the reader, not read


def valid_candidate(name: object) -> bool:
    return isinstance(name, str) and (name in (KEEP, "int8", *FORMAT_CANDIDATES) or bool(_INT4.match(name)))


def read_recipe(recipe: str, default: str) -> tuple[str, str, dict[str, str]]:
    """``(name, default, layers)`` of a recipe file (the keys
    ``python -m quantlab.sensitivity`` writes; ``predicted`` and ``source``
    are for the reader). Raises ``ValueError`` with
    one line naming the file and the problem: missing, not YAML, not a
    mapping, an unknown key, a field of the wrong type, an unknown candidate."""
    path = Path(recipe).expanduser()
    if not path.is_file():
        raise ValueError(f"mixed recipe {recipe} not found (python -m quantlab.sensitivity writes one)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"mixed recipe {path}: not valid YAML{where} ({getattr(e, 'problem', None) or e})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"mixed recipe {path}: a mapping of {', '.join(_RECIPE_KEYS)} expected, "
                         f"got {type(data).__name__}")
    if unknown := sorted(map(str, set(data) - set(_RECIPE_KEYS))):
        raise ValueError(f"mixed recipe {path}: unknown key {unknown[0]!r}; valid: {', '.join(_RECIPE_KEYS)}")
    default = data.get("default", default)
    if not valid_candidate(default):
        raise ValueError(f"mixed recipe {path}: default {default!r}; valid: {CANDIDATES}")
    layers = data.get("layers") or {}
    if not isinstance(layers, dict):
        raise ValueError(f"mixed recipe {path}: layers must map layer names to candidates, "
                         f"got {type(layers).__name__}")
    for name, choice in layers.items():
        if not valid_candidate(choice):
            raise ValueError(f"mixed recipe {path}: layer {name}: {choice!r}; valid: {CANDIDATES}")
    return str(data.get("name", path.stem)), default, {str(k): v for k, v in layers.items()}


@dataclass
class FloatScheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.float"
    LABEL: ClassVar[str] = "float scheme"
    dtype: str = field(default="bfloat16", metadata={"choices": tuple(_SHORT)})

    def short_name(self) -> str:
        return _SHORT[self.dtype]

    def float_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2


@dataclass
class Int8Scheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.int8"
    LABEL: ClassVar[str] = "int8"
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return "int8"


@dataclass
class Int4Scheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.int4"
    LABEL: ClassVar[str] = "int4"
    group_size: int = field(default=64, metadata={"choices": GROUP_SIZES})
    symmetric: bool = False
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return f"int4-g{self.group_size}{'-sym' if self.symmetric else ''}"


@dataclass
class FP8Scheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.fp8"
    LABEL: ClassVar[str] = "fp8"
    format: str = field(default="e4m3", metadata={"choices": FP8_FORMATS})
    # none: weight-only; dynamic: W8A8, per-token scales
    activations: str = field(default="none", metadata={"choices": FP8_ACTIVATIONS})
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        """The preset's name: ``fp8-e4m3``, ``fp8-e5m2``, ``fp8-w8a8`` (E4M3 W8A8)."""
        if self.activations == "dynamic":
            return "fp8-w8a8" if self.format == "e4m3" else f"fp8-{self.format}-w8a8"
        return f"fp8-{self.format}"


@dataclass
class BnB4Scheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.bnb4"
    LABEL: ClassVar[str] = "bnb"
    quant_type: str = field(default="nf4", metadata={"choices": BNB4_QUANT_TYPES})
    block_size: int = 64
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return self.quant_type if self.block_size == 64 else f"{self.quant_type}-b{self.block_size}"


@dataclass
class GPTQScheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.gptq"
    LABEL: ClassVar[str] = "gptq"
    bits: int = field(default=4, metadata={"choices": (3, 4, 8)})
    group_size: int = 64
    symmetric: bool = False
    act_order: bool = False
    damp: float = 0.01
    calibration: str = calibration_field()
    n_samples: int = samples_field(64)
    seq_len: int = seq_len_field(512)
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        """The preset's name (``gptq-g64``); other bit widths carry theirs (``gptq3-g64``)."""
        bits = "" if self.bits == 4 else str(self.bits)
        return f"gptq{bits}-g{self.group_size}{'-sym' if self.symmetric else ''}{'-ao' if self.act_order else ''}"


@dataclass
class AWQScheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.awq"
    LABEL: ClassVar[str] = "awq"
    group_size: int = field(default=32, metadata={"choices": GROUP_SIZES})
    symmetric: bool = False
    # alpha in {0, 1/grid, ..., 1}; alpha = 0 is plain RTN
    grid: int = field(default=AWQ_GRID, metadata={"min": 0, "note": "0: plain round-to-nearest"})
    calibration: str = calibration_field()
    n_samples: int = samples_field(16)
    seq_len: int = seq_len_field(512)
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return f"awq-g{self.group_size}{'-sym' if self.symmetric else ''}"


@dataclass
class HQQScheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.hqq"
    LABEL: ClassVar[str] = "hqq"
    nbits: int = field(default=4, metadata={"choices": HQQ_BITS})
    group_size: int = field(default=64, metadata={"choices": GROUP_SIZES})
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return f"hqq{self.nbits}-g{self.group_size}"


@dataclass
class W8A8Scheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.smoothquant"
    LABEL: ClassVar[str] = "w8a8"
    smooth: bool = True  # false: naive W8A8, the reference SmoothQuant is measured against
    # migration strength (0: none, 1: all onto the weights)
    alpha: float = field(default=0.5, metadata={"min": 0, "max": 1})
    # > 0: alpha per layer group, searched in {0, 1/grid, ..., 1}; alpha is then unused
    grid: int = field(default=0, metadata={"min": 0, "note": "0: the one alpha"})
    # > 0: online block-Hadamard of this size (a power of two) on down_proj's input
    rotate_down: int = field(default=0, metadata={"rule": (lambda n: n >= 0 and not n & (n - 1),
                                                           "0 (none) or a power of two")})
    calibration: str = calibration_field()
    n_samples: int = samples_field(16)
    seq_len: int = seq_len_field(512)
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        """``w8a8``, ``w8a8-sq`` (the preset's alpha 0.5), ``w8a8-sq-a0.75`` (any
        other alpha), ``w8a8-sq-auto`` (alpha searched per group); a rotated
        ``down_proj`` adds ``-had<block>``."""
        if not self.smooth:
            name = "w8a8"
        elif self.grid:
            name = "w8a8-sq-auto"
        else:
            name = "w8a8-sq" if self.alpha == 0.5 else f"w8a8-sq-a{self.alpha:g}"
        return f"{name}-had{self.rotate_down}" if self.rotate_down else name


@dataclass
class MixedScheme(WeightScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.mixed"
    LABEL: ClassVar[str] = "mixed"
    recipe: str = ""  # a recipe YAML; its name/default/layers replace the fields below
    name: str = "custom"
    default: str = "int4-g64"
    layers: dict[str, str] = field(default_factory=dict)
    awq: bool = False  # search and fold AWQ scales for the recipe's candidates first
    calibration: str = calibration_field()  # for awq
    n_samples: int = samples_field(16)
    seq_len: int = seq_len_field(512)
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def __post_init__(self) -> None:
        if self.recipe:
            self.name, self.default, self.layers = read_recipe(self.recipe, self.default)
            self.recipe = ""  # the assignment is now in the config itself
        super().__post_init__()

    def check(self, path: str) -> None:
        if bad := sorted({c for c in (self.default, *self.layers.values()) if not valid_candidate(c)}):
            raise ValueError(f"mixed recipe candidates {bad}; valid: {CANDIDATES}")

    def short_name(self) -> str:
        return f"mixed-{self.name}{'-awq' if self.awq else ''}"


@dataclass
class NVFP4Scheme(WeightScheme):
    """NVFP4: E2M1 weights, an E4M3 scale per 16 and an fp32 scale per tensor
    (compressed-tensors ``NVFP4`` / ``NVFP4A16``). ``activations=nvfp4`` (W4A4)
    quantizes each Linear's input the same way, its per-tensor scale calibrated
    on ``n_samples`` windows (llm-compressor's static global, dynamic local
    scales). ``gptq``: the weights' codes chosen by GPTQ (each group's scale
    from its error-updated weights, as llm-compressor's GPTQ does for NVFP4)
    on the same calibration windows, instead of round to nearest."""
    HANDLER: ClassVar[str] = "quantlab.schemes.nvfp4"
    LABEL: ClassVar[str] = "nvfp4"
    activations: str = field(default="nvfp4", metadata={"choices": ("nvfp4", "none")})
    gptq: bool = False
    damp: float = field(default=0.01, metadata={"above": 0})
    calibration: str = calibration_field()  # for the activations' global scales and for GPTQ's Hessians
    n_samples: int = samples_field(16)
    seq_len: int = seq_len_field(512)
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return f"nvfp4{'' if self.activations == 'nvfp4' else '-a16'}{'-gptq' if self.gptq else ''}"

    def calibration_set(self) -> str | None:
        return self.calibration if self.activations == "nvfp4" or self.gptq else None


@dataclass
class MXScheme(WeightScheme):
    """OCP microscaling: E2M1 (``fp4``) or E4M3 (``fp8``) elements with an E8M0
    power-of-two scale per 32 (compressed-tensors ``MXFP4`` / ``MXFP8`` and their
    ``A16`` forms); ``activations=mx`` quantizes each Linear's input to the same
    format, dynamically per 32. ``gptq``: codes chosen by GPTQ on
    ``n_samples`` calibration windows instead of round to nearest."""
    HANDLER: ClassVar[str] = "quantlab.schemes.mx"
    LABEL: ClassVar[str] = "mx"
    elem: str = field(default="fp4", metadata={"choices": ("fp4", "fp8")})
    activations: str = field(default="mx", metadata={"choices": ("mx", "none")})
    gptq: bool = False
    damp: float = field(default=0.01, metadata={"above": 0})
    calibration: str = calibration_field()  # for GPTQ
    n_samples: int = samples_field(64)
    seq_len: int = seq_len_field(512)
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return f"mx{self.elem}{'' if self.activations == 'mx' else '-a16'}{'-gptq' if self.gptq else ''}"

    def calibration_set(self) -> str | None:
        return self.calibration if self.gptq else None


@dataclass
class FP8BlockScheme(WeightScheme):
    """FP8 E4M3 weights with one fp32 scale per ``block`` x ``block`` tile
    (DeepSeek-V3's and Qwen3's FP8 checkpoints, compressed-tensors ``FP8_BLOCK``);
    ``activations=dynamic`` quantizes each token's input in groups of ``block``."""
    HANDLER: ClassVar[str] = "quantlab.schemes.fp8block"
    LABEL: ClassVar[str] = "fp8-block"
    block: int = field(default=128, metadata={"choices": (64, 128)})
    activations: str = field(default="dynamic", metadata={"choices": FP8_ACTIVATIONS})
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        size = "" if self.block == 128 else str(self.block)
        return f"fp8-block{size}{'' if self.activations == 'dynamic' else '-a16'}"


@dataclass
class W4A8Scheme(WeightScheme):
    """Symmetric INT4 weight groups with dynamic per-token FP8 E4M3 activations
    (compressed-tensors ``W4AFP8``, TensorRT-LLM's W4A8)."""
    HANDLER: ClassVar[str] = "quantlab.schemes.w4a8"
    LABEL: ClassVar[str] = "w4a8"
    group_size: int = field(default=128, metadata={"choices": GROUP_SIZES})
    compute_dtype: str = dtype_field()
    skip: list[str] = skip_field()

    def short_name(self) -> str:
        return f"w4a8-g{self.group_size}"


# llama.cpp's quantizer menu (llama-quantize's names); the types it refuses to make without an
# importance matrix ("Please do not use ... without an importance matrix")
LLAMA_QUANTS = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0",
                "IQ4_XS", "IQ4_NL", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS",
                "Q2_K", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
LLAMA_QUANTS_NEED_IMATRIX = ("Q2_K_S", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
SOURCE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class LlamaQuantScheme(WeightScheme):
    """``quant``: a type of llama.cpp's own menu (``Q4_K_M``, ``IQ4_XS``, ...), made
    by llama.cpp's quantizer (``llama_model_quantize``, the library call behind
    ``llama-quantize``) from the point's weights written as a ``source_dtype``
    GGUF, with the type mixes llama.cpp chooses per tensor. ``imatrix``: an
    importance matrix (each Linear's mean squared input per column, what
    ``llama-imatrix`` collects) from ``n_samples`` x ``seq_len`` tokens of
    the ``calibration`` set. Runs on ``target=llamacpp`` only."""
    HANDLER: ClassVar[str] = "quantlab.schemes.llamaquant"
    LABEL: ClassVar[str] = "gguf"
    quant: str = field(default="Q4_K_M", metadata={"choices": LLAMA_QUANTS})
    imatrix: bool = False
    calibration: str = calibration_field()
    n_samples: int = samples_field(32)
    seq_len: int = seq_len_field(512)
    source_dtype: str = field(default="float16", metadata={"choices": SOURCE_DTYPES})

    def check(self, path: str) -> None:
        """A type llama.cpp makes only with an importance matrix needs one."""
        if self.quant in LLAMA_QUANTS_NEED_IMATRIX and not self.imatrix:
            raise ValueError(f"gguf quant {self.quant} needs an importance matrix (llama.cpp refuses it without "
                             f"one): set imatrix=true; the types that do: {', '.join(LLAMA_QUANTS_NEED_IMATRIX)}")

    def short_name(self) -> str:
        return f"gguf-{self.quant.lower()}{'-imat' if self.imatrix else ''}"

    def calibration_set(self) -> str | None:
        return self.calibration if self.imatrix else None

    def float_bytes(self) -> int:
        return 4 if self.source_dtype == "float32" else 2


@dataclass
class AsIsScheme(WeightScheme):
    """The quantization of the artifact in ``model.path``, kept as it was made
    elsewhere (a compressed-tensors, GPTQ, AWQ or bitsandbytes checkpoint, a GGUF quant) and measured
    against ``reference`` (its float original); see :mod:`quantlab.artifacts`.
    ``family``, ``label`` and ``kernel`` are read from the artifact's own
    metadata when the point is composed (left empty, as a preset does);
    a value given that differs from the artifact's is refused.
    ``compute_dtype``: the activations' dtype on quantlab's int4/int8/FP8
    modules (scales are kept in it, as for quantlab's own schemes); ``auto``:
    the checkpoint's own (its config's ``dtype``), resolved with the rest."""
    HANDLER: ClassVar[str] = "quantlab.schemes.asis"
    LABEL: ClassVar[str] = "as-is"
    KEEPS_ARTIFACT: ClassVar[bool] = True
    compute_dtype: str = field(default="auto", metadata={"choices": ("auto", "bfloat16", "float16", "float32")})
    family: str = field(default="", metadata={"choices": ("", "compressed-tensors", "gptq", "awq", "bitsandbytes",
                                                          "gguf")})
    label: str = ""
    kernel: str = field(default="", metadata={"choices": ("", "int4", "int8", "int8-dyn", "fp8", "fp8-dyn", "bnb4",
                                                          "dequantized", "llama.cpp")})

    def short_name(self) -> str:
        return f"as-is-{self.label.lower()}" if self.label else "as-is"

    def for_model(self, model: Any) -> "AsIsScheme":
        """``family``, ``label`` and ``kernel`` read from the artifact in
        ``model.path``, an ``auto`` compute dtype made the checkpoint's own
        (a GGUF's: float32, what gguf-py dequantizes to); a value given that
        differs from the artifact's is a ``ValueError``. A model that is no
        artifact (or one quantlab cannot read, refused with its reason by
        :func:`quantlab.artifacts.check`) leaves the scheme as it is."""
        from quantlab import artifacts

        art = artifacts.read(model)
        if art is None or art.unsupported:
            return self
        for key in ("family", "label", "kernel"):
            if getattr(self, key) and getattr(self, key) != getattr(art, key):
                raise ValueError(f"scheme.weights.{key}={getattr(self, key)}: the artifact {model.path} is "
                                 f"{getattr(art, key)} ({art.description})")
        return dataclasses.replace(self, family=art.family, label=art.label, kernel=art.kernel,
                                   compute_dtype=artifacts.compute_dtype(model, self.compute_dtype))

    def float_bytes(self) -> int:
        return 4  # the artifact loads dequantized to float32 before its own modules replace the layers


@dataclass
class NoKV(KVScheme):
    """Unquantized KV cache in the model's compute dtype."""
    HANDLER: ClassVar[str] = "quantlab.schemes.kv"

    def short_name(self) -> str:
        return ""


@dataclass
class Int8KV(KVScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.kv"
    LABEL: ClassVar[str] = "int8 kv"
    # static: per head from the prefill; dynamic: per head and token; calibrated: per head from
    # ``n_samples`` windows of ``seq_len`` tokens of the calibration set, fixed before any request
    scales: str = field(default="static", metadata={"choices": ("static", "dynamic", "calibrated")})
    calibration: str = calibration_field()
    n_samples: int = samples_field(16)
    seq_len: int = seq_len_field(512)

    def short_name(self) -> str:
        return {"static": "kv8", "dynamic": "kv8-dyn", "calibrated": "kv8-cal"}[self.scales]

    def calibration_set(self) -> str | None:
        return self.calibration if self.scales == "calibrated" else None


@dataclass
class Int4KV(KVScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.kv"
    LABEL: ClassVar[str] = "int4 kv"
    group_size: int = field(default=32, metadata={"rule": (lambda g: g >= 2 and g % 2 == 0, "even, >= 2")})
    residual_length: int = field(default=128, metadata={"min": 0})

    def short_name(self) -> str:
        return f"kv4-g{self.group_size}"


@dataclass
class FP8KV(KVScheme):
    HANDLER: ClassVar[str] = "quantlab.schemes.kv"
    LABEL: ClassVar[str] = "fp8 kv"
    # prefill: one scale per tensor from the prefill (transformers' Fp8QuantizedLayer); calibrated: one
    # per tensor from the calibration set (llm-compressor's and vLLM's k_scale / v_scale), fixed;
    # calibrated-head: one per KV head from the calibration set (compressed-tensors' attn_head strategy)
    scales: str = field(default="prefill", metadata={"choices": ("prefill", "calibrated", "calibrated-head")})
    calibration: str = calibration_field()
    n_samples: int = samples_field(16)
    seq_len: int = seq_len_field(512)

    def short_name(self) -> str:
        return {"prefill": "kvfp8", "calibrated": "kvfp8-cal", "calibrated-head": "kvfp8-head"}[self.scales]

    def calibration_set(self) -> str | None:
        return self.calibration if self.scales.startswith("calibrated") else None


@dataclass
class NVFP4KV(KVScheme):
    """NVFP4 K/V: E2M1 codes with an E4M3 scale per 16 along the head
    dimension, set as each token is written, and one fp32 scale per tensor
    from the prefill (keys and values apart; later values past it saturate)."""
    HANDLER: ClassVar[str] = "quantlab.schemes.kv"
    LABEL: ClassVar[str] = "nvfp4 kv"

    def short_name(self) -> str:
        return "kvnvfp4"
