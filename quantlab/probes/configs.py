"""Each built-in probe's typed config (the ``probe.<name>`` nodes), the probe
node that holds them and a plugin probe's settings, and what the enabled
probes ask of a run (context, decision metrics). No torch: the run config
(:mod:`quantlab.config`) and the launch checks import it."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from quantlab import metric_names
from quantlab.config_check import validate


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


def check_decision_metric(metric: str, p: ProbeConfig) -> None:
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
