"""A point's identity and the names of the tags that carry it (standard library only).

One sweep point is known by its scheme name (``int4-g64+kv8``), its target
label (``cpu+compile``), the run name made of both (``int4-g64+kv8@cpu+compile``)
and a hash of what it measures. :func:`identify` computes them once per point;
everything else (tracking, sweep, report, export) reads them from the
:class:`Identity` or from the tags named here, never by parsing a run name.

Every tag or role that more than one module writes or reads is defined here
once; this module imports nothing outside the standard library, so the export
command line can read a store's tags without importing MLflow or torch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

# --- bookkeeping tags (tracking, sweep, report, export) ---
PARENT_TAG = "mlflow.parentRunId"
# a sweep's parent run id, set by the sweep callback for the points it launches (local workers
# inherit it; Ray tasks get it in their runtime_env); the CLI hands it to run_point
PARENT_ENV = "QUANTLAB_PARENT_RUN_ID"
# the seed of a sweep's evaluation draws, set by the sweep callback where eval_seed is not pinned; the run
# config reads it (conf/config.yaml)
EVAL_SEED_ENV = "QUANTLAB_EVAL_SEED"


def parent_run() -> str | None:
    """The sweep run this process's points belong to (None outside a sweep)."""
    import os

    return os.environ.get(PARENT_ENV) or None
SWEEP_TAG = "quantlab.sweep"  # the sweep's name, on the parent and on every child
ROLE_TAG, ROLE_SWEEP = "quantlab.role", "sweep"  # a sweep's parent run carries ROLE_TAG = ROLE_SWEEP
OUTCOME_TAG = "quantlab.outcome"  # finished | skipped | failed | reused | killed
REASON_TAG = "quantlab.reason"
REUSED_FROM_TAG = "quantlab.reused_from"  # on a light child run: the run that measured it
HOST_TAG, PID_TAG, PID_START_TAG = "quantlab.host", "quantlab.pid", "quantlab.pid_start"
CREATE_KEY_TAG = "quantlab.create_key"  # one per Tracker.start call: finds the twin a retried create made
BASELINE_TAG = "recovery.baseline"  # on the parent: the run name the sweep compared against
RECOMMENDED_BY_TAG = "recommended.by"  # on the parent: the objective of the budget picks
# on the parent: the seed of the sweep's evaluation draws, and where it came from (drawn | pinned | resumed <run>)
EVAL_SEED_TAG, EVAL_SEED_FROM_TAG = "quantlab.eval_seed", "quantlab.eval_seed_from"
# on the parent, written at launch: the decision declared before any point ran (decision.metric/budgets/alpha)
DECLARED_TAGS = {k: f"declared.{k}" for k in ("metric", "budgets", "alpha", "latency_share", "retime_rounds",
                                               "retime_points", "tie_break", "retime_instance_sd")}
# on a child: its latency or load timing shared the cores with other processes (the value says how much)
CONTENDED_TAG = "load.warning"

# --- a point's identity and provenance (pipeline writes them; report, export read them) ---
SCHEME_TAG = "scheme"  # the point's scheme name (weights[+kv]), also a param
HASH_TAG = "point_hash"
HOST_ID_TAG = "host.id"  # short hash of the host fingerprint
HOST_FINGERPRINT_TAG = "host.fingerprint"
HOST_CPU_TAG = "host.cpu"
PPL_STOP_TAG = "probe.perplexity.stop"  # adaptive perplexity: why the point stopped scoring windows
GGUF_TYPES_TAG = "gguf.types"  # a gguf-* point: llama.cpp's tensor types by share of matrix weights
ACC_STOP_TAG = "probe.accuracy.stop"  # adaptive lm-eval: why each task stopped scoring documents
# how either stop tag begins for a point identical to the reference (it took the reference's items)
IDENTICAL_STOP = "identical to the reference"
EMULATED_TAG = "emulated"  # "true" when the latency is not the scheme's own kernels'


def recommended_tags(budget: float) -> tuple[str, str]:
    """On the parent: the tags naming the point recommended within ``budget``
    (its run name, its run id)."""
    return f"recommended.{budget:g}", f"recommended.{budget:g}.run_id"


def post_hoc_tag(budget: float) -> str:
    """On the parent: why the recommendation within ``budget`` is post hoc
    (chosen after the results, not declared at launch); absent when declared."""
    return f"recommended.{budget:g}.post_hoc"


def recommended_budgets(tags: dict[str, str]) -> list[str]:
    """The budgets a sweep parent's ``tags`` hold a recommendation for (as written)."""
    return sorted(k[len("recommended."):-len(".run_id")] for k in tags
                  if k.startswith("recommended.") and k.endswith(".run_id"))


def recommended_point_tag(budget: float) -> str:
    """On the recommended child run itself."""
    return f"quantlab.recommended.{budget:g}"


def exportable_tag(fmt: str) -> str:
    """The tag a point carries for export format ``fmt``: the format it exports
    as (``compressed-tensors/pack-quantized``, ``gguf/Q4_1``...) or ``no: <why>``."""
    return f"exportable.{fmt}"


def target_label(target: Any) -> str:
    """The target part of a run name: ``cpu``, ``cpu+compile``, ``cuda+graphs+static``.
    A pure function of the config (no validation), so a bad option still names its run."""
    parts = [target.name]
    mode = getattr(target, "compile_mode", None)
    if mode is not None and target.compile:
        parts.append("graphs" if mode == "reduce-overhead" else "compile" if mode == "default"
                     else f"compile-{mode}")
    if getattr(target, "static_cache", 0):
        parts.append("static")
    return "+".join(parts)


@dataclass(frozen=True)
class Identity:
    """What names a point: ``scheme`` (``int4-g64+kv8``), ``weights``
    (``int4-g64``), ``kv`` (``kv8``, or '' for the unquantized cache),
    ``target`` (``cpu+compile``), ``hash`` (16 hex digits of the semantic
    config, quantlab's code version ``code`` and the data files' sha256
    ``data``) and ``model``: '' for a real model, the model's name for a
    named shape with random weights (a scaling sweep's points differ by it)."""

    scheme: str
    weights: str
    kv: str
    target: str
    hash: str
    code: str
    data: str
    model: str = ""

    @property
    def name(self) -> str:
        """The run name: ``<scheme>@<target>``, after ``<model>:`` for a shape
        (``llama-3.2-1b-random:int8@cpu``)."""
        return f"{self.model + ':' if self.model else ''}{self.scheme}@{self.target}"


def identify(cfg: Any, as_dict: dict[str, Any], code: str, data: str) -> Identity:
    """The identity of point ``cfg`` (a ``RunConfig``) whose plain-dict form is
    ``as_dict`` (``compose.config_dict``), for code version ``code`` and data
    fingerprint ``data``. The hash covers model (not its display name), scheme,
    target, probe, seed and the evaluation draws' seed (``cfg.draws_seed``):
    not where the point is logged or cached."""
    semantic = {k: as_dict[k] for k in ("model", "scheme", "target", "probe", "seed")}
    semantic["eval_seed"] = cfg.draws_seed
    semantic["model"] = {k: v for k, v in semantic["model"].items() if k != "name"}
    semantic["code"], semantic["data"] = code, data
    digest = hashlib.sha256(json.dumps(semantic, sort_keys=True).encode()).hexdigest()[:16]
    weights, kv = cfg.scheme.weights.short_name(), cfg.scheme.kv.short_name()
    return Identity(f"{weights}{'+' + kv if kv else ''}", weights, kv, target_label(cfg.target), digest, code, data,
                    cfg.model.name if cfg.model.source == "shape" else "")


def find_sweep(sweeps: list[tuple[str, dict[str, str]]], sweep: str) -> tuple[str, dict[str, str]]:
    """The parent run of ``sweep`` (a sweep name, a parent run id, or ``latest``)
    among ``sweeps`` (``(run id, tags)`` of every sweep parent, newest first).
    Raises ``LookupError`` with one line listing the sweeps there are."""
    for run_id, tags in sweeps:
        if sweep in ("latest", run_id, tags.get(SWEEP_TAG)):
            return run_id, tags
    raise LookupError(_no_sweep(sweep, sweeps))


def _no_sweep(sweep: str, sweeps: list[tuple[str, dict[str, str]]]) -> str:
    names = sorted({t.get(SWEEP_TAG, "?") for _, t in sweeps})
    return f"no sweep {sweep!r} in this store; sweeps: {', '.join(names) or 'none'} (or a parent run id)"


def find_report(top_level: list[tuple[str, dict[str, str]]], sweep: str) -> tuple[bool, str]:
    """What a report of ``sweep`` reads, among the runs under no parent
    (``(run id, tags)``, newest first: sweep parents and points run alone):
    ``(True, parent id)`` for a sweep (its name, its parent's id, or
    ``latest`` when the newest is one), ``(False, run id)`` for a point run
    alone (its id, or ``latest``). Raises ``LookupError`` in one line listing
    the sweeps and how many points run alone there are."""
    for run_id, tags in top_level:
        is_sweep = tags.get(ROLE_TAG) == ROLE_SWEEP
        if sweep in ("latest", run_id) or (is_sweep and sweep == tags.get(SWEEP_TAG)):
            return is_sweep, run_id
    sweeps = [(i, t) for i, t in top_level if t.get(ROLE_TAG) == ROLE_SWEEP]
    alone = len(top_level) - len(sweeps)
    raise LookupError(_no_sweep(sweep, sweeps) + (f"; {alone} point run{'s' * (alone > 1)} alone (--sweep latest or "
                                                  "its run id reports one)" if alone else ""))
