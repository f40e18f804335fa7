"""Every target's config: the dataclasses Hydra composes (``conf/target/``).

Like :mod:`quantlab.schemes.configs` this imports nothing heavy, so a bad
``target.*`` value is refused at compose time; each target's implementation
(``targets/<name>.py``, the config's ``MODULE``) registers against its config
type; pyproject.toml's ``quantlab.targets`` entry points name each config, as
a plugin package names its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from quantlab.config import TargetConfig


@dataclass
class CPUTargetConfig(TargetConfig):
    """``compile``: torch.compile (inductor). ``compile_mode``: torch.compile's
    mode. ``static_cache``: > 0 decodes into a preallocated ``StaticCache`` of
    that many tokens (fixed shapes: no recompiles, and what CUDA graphs need)."""

    MODULE: ClassVar[str] = "quantlab.targets.cpu"
    name: str = "cpu"
    threads: Optional[int] = field(default=None, metadata={"min": 1})  # None: leave torch's default (all cores)
    compile: bool = False
    compile_mode: str = field(default="default", metadata={"choices": ("default", "max-autotune-no-cudagraphs")})
    static_cache: int = field(default=0, metadata={"min": 0, "note": "0: dynamic cache"})


@dataclass
class CUDATargetConfig(TargetConfig):
    """As the CPU target; ``compile_mode=reduce-overhead`` captures CUDA graphs
    and needs ``static_cache`` > 0."""

    MODULE: ClassVar[str] = "quantlab.targets.cuda"
    name: str = "cuda"
    device: int = 0
    compile: bool = False
    compile_mode: str = field(default="default", metadata={"choices": (
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")})
    static_cache: int = field(default=0, metadata={"min": 0, "note": "0: dynamic cache"})

    def check(self, path: str) -> None:
        if self.compile and self.compile_mode in ("reduce-overhead", "max-autotune") and not self.static_cache:
            raise ValueError(f"cuda: compile_mode={self.compile_mode} captures CUDA graphs, which replay fixed "
                             f"shapes: set {path}static_cache (e.g. 1024) so the KV cache does not grow")


@dataclass
class LlamaCppTargetConfig(TargetConfig):
    """``threads``: llama.cpp threads (None: all cores). ``n_ctx``: context slots
    of the KV cache. ``gguf_cache``: where exported points are kept by content."""

    MODULE: ClassVar[str] = "quantlab.targets.llamacpp"
    CONTEXT_FIELD: ClassVar[str] = "n_ctx"  # the longest sequence it holds (checked against the probes)

    name: str = "llamacpp"
    threads: Optional[int] = None
    n_ctx: int = field(default=2048, metadata={"min": 16})
    n_batch: int = field(default=512, metadata={"min": 1})
    gguf_cache: str = "~/.cache/quantlab/gguf"


@dataclass
class NeuronTargetConfig(TargetConfig):
    """AWS Inferentia2/Trainium via optimum-neuron in its own interpreter."""

    MODULE: ClassVar[str] = "quantlab.targets.neuron"
    CONTEXT_FIELD: ClassVar[str] = "sequence_length"

    name: str = "neuron"
    python: str = "python3"  # the Neuron virtualenv's interpreter
    batch_size: int = field(default=1, metadata={"min": 1})
    sequence_length: int = field(default=2048, metadata={"min": 1})
    num_cores: int = field(default=2, metadata={"min": 1})  # tensor-parallel degree
    compile_cache: str = "~/.cache/quantlab/neuron"
    compile: bool = True
    timeout_s: float = field(default=3600.0, metadata={"above": 0})


@dataclass
class VllmTargetConfig(TargetConfig):
    """``python``: vLLM's venv interpreter (None: ``$QUANTLAB_VLLM_PYTHON``).
    ``dtype``: the server's ``--dtype`` (``auto``: the checkpoint's).
    ``max_num_seqs``: sequences the scheduler runs at once (the load probe
    restarts the server with ``probe.load.max_batch``). ``kv_cache_gib``: the
    CPU build's KV-cache budget. ``logprobs_topk``: k > 0 (default 20) asks
    the server for the top k log-probabilities per position (fidelity then
    logs a top-k KL, a lower bound named apart from ``fid/kl_mean``;
    perplexity and lm-eval need only the actual token's, which the server
    always returns); 0 asks for whole distributions (exact KL; about 0.9 s per
    position at SmolLM2's 49,152-token vocabulary on 2 cores). ``port``: None
    picks a free one."""

    MODULE: ClassVar[str] = "quantlab.targets.vllm"
    CONTEXT_FIELD: ClassVar[str] = "max_model_len"
    name: str = "vllm"
    device: str = field(default="cpu", metadata={"choices": ("cpu", "cuda")})  # which vLLM build
    python: Optional[str] = None
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})
    max_num_seqs: int = field(default=8, metadata={"min": 1})
    max_model_len: int = field(default=2048, metadata={"min": 16})
    kv_cache_gib: float = field(default=1.0, metadata={"above": 0})
    threads: Optional[int] = field(default=None, metadata={"min": 1})
    logprobs_topk: int = field(default=20, metadata={"min": 0})
    port: Optional[int] = field(default=None, metadata={"min": 1})
    ready_timeout_s: float = field(default=600.0, metadata={"above": 0})
    enforce_eager: bool = True
    prefix_caching: bool = False  # vLLM's default is on: a repeated prompt's TTFT would time a cache hit
    export_cache: str = "~/.cache/quantlab/vllm-exports"

