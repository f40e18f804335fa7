"""What a probe's metrics mean, declared by the probe: which way is better,
how a decision measures a loss against the baseline, what its per-item
values are, whether it can be ``decision.metric``, and whether the report
shows it as a column. The report and the decision read these declarations;
a metric no probe declares is information only (shown, never ranked nor
decided).

Declarations are :class:`ProbeSpec` objects registered under the
``quantlab.probe_specs`` entry points (quantlab's own: :data:`BUILTIN`), in
modules light enough to import at launch (no torch): a launch checks a
declared decision metric and a plugin probe's settings before anything heavy
loads.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable

DIRECTIONS = ("higher", "lower", "info")
LOSSES = ("relative", "value", "complement")
ITEMS = ("", "documents", "tokens")


@dataclass(frozen=True)
class MetricSpec:
    """One metric (or a family of them: ``pattern`` is a regular expression
    the whole name matches).

    ``direction``: ``higher`` / ``lower`` is better, or ``info`` (shown, never
    ranked). ``loss`` against the baseline: ``relative`` (``1 - point/base``
    for higher, ``1 - base/point`` for lower: llm-compressor's recovery),
    ``value`` (the metric itself, a divergence from the reference),
    ``complement`` (``1 - value``, an agreement with the reference).
    ``items``: what its per-item values (``ProbeResult.items[name]``) are,
    ``documents`` (one score per document, paired with the baseline's by
    ``doc_ids/<task>``; 0/1 scores are bounded by Tango's score bound) or
    ``tokens`` (per-token NLL of windows, the window the unit); a metric
    without them is bounded from the standard error logged beside it
    (``<name>_stderr``). ``decision``: it may be ``decision.metric``.
    ``column``: its header in the report's table (``{name}``: the metric's
    own name), empty for none; ``fmt`` its format; ``always``: the column
    stands even where no point logged it (the table's fixed columns, in
    declaration order; the others follow where logged, by declaration and
    name). ``timed``: a timing, marked where other processes shared the
    cores while it was taken. ``auto``: its rank when ``decision.metric=auto``
    picks the metric (1 first; 0: never picked by auto). ``windows``: the
    metric counting its units where it is not ``<name>_windows``;
    ``positions``: for an agreement over positions (0/1 each), the metric
    counting the positions: its bound is Wilson's score bound at the
    effective number of positions (``<name>_stderr_tokens`` beside
    ``<name>_stderr`` gives the design effect of the windows)."""

    pattern: str
    direction: str = "info"
    loss: str = "relative"
    items: str = ""
    decision: bool = False
    column: str = ""
    fmt: str = "{:.4g}"
    always: bool = False
    timed: bool = False
    auto: int = 0
    windows: str = ""
    positions: str = ""

    def __post_init__(self) -> None:
        for name, value, valid in (("direction", self.direction, DIRECTIONS), ("loss", self.loss, LOSSES),
                                   ("items", self.items, ITEMS)):
            if value not in valid:
                raise ValueError(f"metric {self.pattern!r}: {name} {value!r}; valid: {', '.join(valid)}")
        re.compile(self.pattern)

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


PLACES = ("body", "end")


@dataclass(frozen=True)
class Section:
    """A probe's section of the report: ``function``, ``"module:name"``,
    imported when a report is built and called as ``function(view)`` with a
    :class:`SectionView`; it returns ``(markdown, files)``: the section's
    text ('' when no point ran the probe) and the names of the files it
    wrote in ``view.out`` (logged on the sweep's parent run). ``place``:
    ``body`` after the decision, ``end`` after the run ids, each in the
    order the probes are declared."""

    function: str
    place: str = "body"

    def __post_init__(self) -> None:
        if self.place not in PLACES or ":" not in self.function:
            raise ValueError(f"section {self.function!r} (place {self.place!r}): a 'module:function' and a place "
                             f"of {', '.join(PLACES)}")


@dataclass(frozen=True)
class SectionView:
    """What a probe's section reads: the sweep's points
    (:class:`quantlab.records.PointRecord`), the directory its files go in,
    the sweep's title and ``download(record, name)``: the path of an artifact
    the point's measuring run logged, None when there is none."""

    runs: list
    out: Any
    title: str
    download: Callable[[Any, str], Any]


@dataclass(frozen=True)
class ProbeSpec:
    """A probe's declaration: its ``name`` (its section ``probe.plugins.<name>``
    for a plugin), the dataclass of its ``settings`` (each field's
    ``metadata`` rules checked as every config's; None: it takes none), its
    ``metrics`` and its report ``sections``."""

    name: str
    metrics: tuple[MetricSpec, ...] = ()
    settings: Any = None
    sections: tuple[Section, ...] = ()


# logged beside a metric, not metrics
AUXILIARY = ("_windows", "_articles", "_ref_loss_lower", "_documents", "_stderr", "_stderr_tokens", "_blocks",
             "_adaptive_cap", "_adaptive_chunk")
CLUSTERS = "clusters/"  # items: clusters/<task> is each document's cluster (items that share structure)
ARTICLES = "articles/"  # items: articles/<metric> is each window's article (the cluster of a perplexity's bound)
DOC_IDS = "doc_ids/"  # items: doc_ids/<task> names each document a task's per-document scores are in order of
# the report's own: recovery/<metric> (score over the baseline's, 1.0 nothing lost), and each point's loss
RECOVERY = "recovery/"
DECISION_LOSS, DECISION_LOSS_UPPER = "decision/loss", "decision/loss_upper"

# The names modules other than the logging probe read, declared here beside the probes' specs below.
IDENTICAL = "fid/identical"  # 1.0: the point's log-probabilities equal the reference's on every position
ZERO_WHEN_IDENTICAL = ("fid/kl", "fid/top1_agree", "kvfid/kl")  # their loss is exactly 0 where IDENTICAL is 1.0
TOP1 = "fid/top1_agree"  # agreement with the reference: needs no labels, auto's last resort
FID_WINDOWS, FID_TOKENS = "fid/windows", "fid/tokens"
PPL_STEM = "ppl_token_wikitext2_w"  # perplexity's name stem, then its window (and _rand<n> / _first<n>)
FIDELITY = ("fid/kl_mean", TOP1, "fid/kl_topk_lb_mean")
CACHE = ("kvfid/kl_mean",)
PASSKEY = "acc/passkey"
WEIGHT_MB, BITS_PER_WEIGHT = "size/weight_mb", "size/bits_per_weight"  # the size probe's
TPOT_P50 = "lat/tpot_ms_p50"  # the latency probe's decode TPOT median, and its requests' least and greatest
TPOT_RANGE = ("lat/tpot_ms_req_lo", "lat/tpot_ms_req_hi")
BW_FLOOR, BW_OVERHEAD = "bw/floor_ms", "bw/overhead_ms"  # the roofline's: a step's bytes at peak, the rest
CAPACITY_LOWER = "load/knee_rps_lower"  # the load probe's capacity under the SLOs, its lower bound
LM_EVAL_HIGHER = ("acc/", "acc_norm/", "exact_match/")
LM_EVAL_LOWER = ("perplexity/", "word_perplexity/", "byte_perplexity/", "bits_per_byte/")


def _column(name: str, header: str, fmt: str, timed: bool = False) -> MetricSpec:
    """One information-only metric that is a fixed column of the report's table."""
    return MetricSpec(re.escape(name), column=header, fmt=fmt, always=True, timed=timed)


BUILTIN = (
    ProbeSpec("size", (_column(WEIGHT_MB, "MiB", "{:.1f}"), _column(BITS_PER_WEIGHT, "bits/w", "{:.2f}"))),
    ProbeSpec("fidelity", (
        MetricSpec(r"fid/kl_mean", "lower", "value", decision=True, column="KL mean", fmt="{:.2e}", always=True,
                   windows=FID_WINDOWS),
        MetricSpec(r"fid/kl_topk_lb_mean", "lower", "value", decision=True, windows=FID_WINDOWS),
        MetricSpec(re.escape(TOP1), "higher", "complement", decision=True, column="top1", fmt="{:.3f}",
                   always=True, auto=4, windows=FID_WINDOWS, positions=FID_TOKENS),
    )),
    ProbeSpec("cache", (  # decoding through the point's cache vs without one
        MetricSpec(r"kvfid/kl_mean", "lower", "value", decision=True, column="KV KL", fmt="{:.2e}", always=True,
                   windows=FID_WINDOWS),)),
    ProbeSpec("latency", (
        _column("lat/ttft_ms_p50", "TTFT p50 ms", "{:.1f}", timed=True),
        _column(TPOT_P50, "TPOT p50 ms", "{:.2f}", timed=True),
        _column("lat/tpot_ms_p99", "TPOT p99 ms", "{:.2f}", timed=True),
        _column("tput/decode_tok_s", "decode tok/s", "{:.1f}", timed=True),
        _column("mem/peak_rss_mb", "peak RSS MiB", "{:.0f}"),
        MetricSpec(r"(lat|tput)/.+", timed=True),
    )),
    ProbeSpec("accuracy", (  # lm-eval's metric kinds per task (the passkey probe logs acc/passkey)
        MetricSpec(r"acc/.+", "higher", items="documents", decision=True, column="{name}", fmt="{:.3f}", auto=3),
        MetricSpec(r"acc_norm/.+", "higher", items="documents", decision=True, column="{name}", fmt="{:.3f}",
                   auto=2),
        MetricSpec(r"exact_match/.+", "higher", items="documents", decision=True),
        MetricSpec(r"(perplexity|word_perplexity|byte_perplexity|bits_per_byte)/.+", "lower", items="documents",
                   decision=True),
    )),
    ProbeSpec("perplexity", (
        MetricSpec(re.escape(PPL_STEM) + r"\d+(_(rand|first)\d+)?", "lower", items="tokens", decision=True,
                   column="{name}", auto=1),
    )),
    ProbeSpec("kv_position", sections=(Section("quantlab.probes.kv_position_report:section"),)),
    ProbeSpec("passkey", sections=(Section("quantlab.probes.passkey_report:section"),)),
    ProbeSpec("load", (  # the capacity columns appear in a serving sweep; the lower bound at uncertainty.LEVEL
        MetricSpec(r"load/knee_rps", column="capacity under SLOs req/s", fmt="{:.2f}", timed=True),
        MetricSpec(re.escape(CAPACITY_LOWER), column="capacity 95% lower bound", fmt="{:.2f}", timed=True),
        MetricSpec(r"load/.+", timed=True),
    ), sections=(Section("quantlab.probes.load_report:section", "end"),)),
    ProbeSpec("roofline", sections=(  # decode cost by weight bytes and by context (bw/*, lat/*, size/*)
        Section("quantlab.probes.roofline_report:by_size", "end"),
        Section("quantlab.probes.roofline_report:by_context", "end"))),
)


@functools.cache
def declared() -> tuple[ProbeSpec, ...]:
    """Every probe's declaration: quantlab's own, then each package's
    ``quantlab.probe_specs`` entry point (a ProbeSpec or a tuple of them)."""
    from quantlab import plugins

    out: list[ProbeSpec] = []
    for name, value in plugins.load(plugins.PROBE_SPECS).items():
        specs = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(s, ProbeSpec) for s in specs):
            raise plugins.bad_value(plugins.PROBE_SPECS, name, "a quantlab.metric_names.ProbeSpec or a tuple of them")
        out.extend(specs)
    return tuple(out)


@functools.cache
def spec(name: str) -> MetricSpec | None:
    """The declaration ``name`` matches (the first, quantlab's before
    plugins'), None for a name logged beside a metric (its se, count) or one
    no probe declares: information only. Cached: the report asks per cell."""
    if name.endswith(AUXILIARY):
        return None
    return next((m for p in declared() for m in p.metrics if m.matches(name)), None)


def columns(logged: set[str]) -> list[tuple[str, str, str]]:
    """The report's metric columns, ``(header, metric, format)``: every
    declared ``always`` column in declaration order, then each metric in
    ``logged`` that a declaration gives a column, by declaration and name."""
    fixed, found = [], []
    for p in declared():
        for m in p.metrics:
            if m.always:
                fixed.append((m.column, m.pattern.replace("\\", ""), m.fmt))
    order = {m: i for i, m in enumerate(m for p in declared() for m in p.metrics)}
    for name in logged:
        s = spec(name)
        if s is not None and s.column and not s.always:
            found.append((order[s], name, (s.column.format(name=name), name, s.fmt)))
    return fixed + [c for _, _, c in sorted(found)]


def timed(name: str) -> bool:
    """A timing (:attr:`MetricSpec.timed`)."""
    return (s := spec(name)) is not None and s.timed


def higher(name: str) -> bool:
    return (s := spec(name)) is not None and s.direction == "higher"


def lower(name: str) -> bool:
    return (s := spec(name)) is not None and s.direction == "lower"


def ranked(name: str) -> bool:
    """Higher or lower is better, with a loss relative to the baseline's (an
    accuracy, a perplexity): the metrics a report compares point by point."""
    return (s := spec(name)) is not None and s.direction != "info" and s.loss == "relative"


def sections(place: str) -> list[Section]:
    """Every declared section of the report at ``place``, in declaration order."""
    return [x for p in declared() for x in p.sections if x.place == place]


def auto_order(names) -> list[str]:
    """Of ``names``, those ``decision.metric=auto`` weighs, in its order
    (:attr:`MetricSpec.auto`, then name)."""
    ranked_ = [(s.auto, n) for n in names if (s := spec(n)) is not None and s.auto]
    return [n for _, n in sorted(ranked_)]
