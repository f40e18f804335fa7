"""lm-eval documents scored until the decision is made (``probe.accuracy.adaptive``).

Each task's ``limit`` documents (the cap, the fixed design's sample) are
scored in the order they were drawn (:func:`quantlab.probes.accuracy.sample_order`),
``adaptive_chunk`` documents a look, so the documents of any prefix are a
uniform random sample of the task. After each look, every 0/1 metric of the
task (``acc``, ``acc_norm``) is compared with the reference model's scores on
the same documents: the relative loss ``1 - acc(point) / acc(reference)``
(the reference's accuracy over the cap taken as known, as the report takes
the baseline's) is bounded from both sides by Tango's score bound on the
discordant documents, at the look's share of ``adaptive_alpha``
(:mod:`quantlab.sequential`: Lan-DeMets Pocock-type spending, looks joined by
the union bound, so the running bounds are anytime-valid). A task stops once
each of ``adaptive_budgets`` is decided for each of its metrics, or at the cap.

Only tasks whose per-document metrics are 0/1 scores are supported (the
multiple-choice ``*_local`` tasks); LAMBADA's and WikiText's corpus-level
perplexities are not means of per-document values.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from quantlab import sequential, uncertainty
from quantlab.probes.configs import AccuracyProbeConfig
from quantlab.digest import computed_once, sha256_file
from quantlab.point import IDENTICAL_STOP
from quantlab.probes import accuracy


@dataclass
class TaskStop:
    """One task of an adaptive evaluation: documents scored (in look order) and why it stopped."""

    docs: list[int] = field(default_factory=list)
    scores: dict[str, list[float]] = field(default_factory=dict)  # metric -> 0/1 per document of ``docs``
    reason: str = ""


def loss_bounds(point: Sequence[float], ref: Sequence[float], ref_acc: float, level: float) -> tuple[float, float]:
    """One-sided ``1 - level`` lower and upper bounds of the relative loss
    ``(acc(ref) - acc(point)) / ref_acc`` from paired 0/1 scores (Tango's
    score bound on the discordant documents, each side at ``level``)."""
    pair = uncertainty.paired(point, ref, binary=True)
    upper = uncertainty.tango_upper(pair.lost, pair.gained, pair.n, level)
    lower = -uncertainty.tango_upper(pair.gained, pair.lost, pair.n, level)
    return lower / ref_acc, upper / ref_acc


def evaluate(run_docs: Callable[[dict[str, list[int]]], dict[str, dict[str, dict[int, float]]]],
             orders: dict[str, list[int]], reference: dict[str, dict[str, dict[int, float]]], chunk: int,
             budgets: Sequence[float], alpha: float, score_all: bool = False,
             progress: Callable[[str], None] = lambda _: None) -> dict[str, TaskStop]:
    """Score each task's ``orders[task]`` (the cap, in draw order) ``chunk``
    documents a look until every budget is decided for every 0/1 metric
    against ``reference[task][metric][doc]`` (the reference model's scores on
    the cap), or the cap. ``run_docs({task: docs})`` scores documents:
    ``{task: {metric: {doc: score}}}``. ``score_all``: score the cap whatever
    the bounds say (the sweep's baseline candidates)."""
    out = {t: TaskStop() for t in orders}
    looks = {t: sequential.schedule(len(o), chunk) for t, o in orders.items()}
    levels = {t: sequential.levels(alpha, looks[t], len(o)) for t, o in orders.items()}
    ref_acc = {(t, m): sum(ref[d] for d in orders[t]) / len(orders[t])  # over the cap: taken as known
               for t in orders for m, ref in reference[t].items()}
    run_lo: dict[tuple[str, str], float] = {}
    run_hi: dict[tuple[str, str], float] = {}
    look = {t: 0 for t in orders}  # each running task's next look
    while look:
        want = {t: orders[t][len(out[t].docs):looks[t][k]] for t, k in look.items()}
        got = run_docs(want)
        for t in list(look):
            stop, cap, n, level = out[t], len(orders[t]), looks[t][look[t]], levels[t][look[t]]
            stop.docs += want[t]
            for metric, per_doc in got[t].items():
                stop.scores.setdefault(metric, []).extend(per_doc[d] for d in want[t])
            decided = True
            for metric, scores in stop.scores.items():
                acc = ref_acc[t, metric]
                if acc <= 0:
                    decided = False
                    continue
                paired_ref = [reference[t][metric][d] for d in stop.docs]
                lo, hi = loss_bounds(scores, paired_ref, acc, level)
                run_lo[t, metric] = max(run_lo.get((t, metric), -float("inf")), lo)
                run_hi[t, metric] = min(run_hi.get((t, metric), float("inf")), hi)
                est = (sum(paired_ref) - sum(scores)) / len(scores) / acc
                lo_e, hi_e = sequential.effective(run_lo[t, metric], run_hi[t, metric], est)
                decided &= sequential.decided(lo_e, hi_e, budgets)
                progress(f"{t} {metric} {n}/{cap} documents: loss against the reference in "
                         f"[{lo_e:.4f}, {hi_e:.4f}] (level {level:.2g})")
            look[t] += 1
            if n >= cap:
                stop.reason = "baseline candidate: scored the cap" if score_all else f"cap of {cap} documents reached"
            elif decided and not score_all:
                stop.reason = f"decided at {n} of {cap} documents"
            else:
                continue
            del look[t]
    return out


def per_doc(samples: dict[str, list[dict]]) -> dict[str, dict[str, dict[int, float]]]:
    """lm-eval's logged samples as ``{task: {metric: {doc_id: 0/1}}}`` for the
    0/1 metrics (``acc``, ``acc_norm``, ``exact_match``)."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for task, rows in samples.items():
        for metric in rows[0].get("metrics", []) if rows else []:
            if metric in ("acc", "acc_norm", "exact_match"):
                out.setdefault(task, {})[metric] = {int(r["doc_id"]): float(r[metric]) for r in rows}
    return out


def reference_scores(key: dict, orders: dict[str, list[int]], cache_dir: str,
                     compute: Callable[[], dict[str, dict[str, dict[int, float]]]]) -> dict:
    """The reference model's per-document scores on the cap, computed once
    (``compute``) and cached under ``<cache_dir>/reference_docs/`` by ``key``
    and the documents (:func:`quantlab.digest.computed_once`)."""
    digest = hashlib.sha256(json.dumps([key, orders], sort_keys=True).encode()).hexdigest()[:24]
    path = Path(cache_dir).expanduser() / "reference_docs" / f"{digest}.json"

    def load(p: Path) -> dict:
        raw = json.loads(p.read_text())
        return {t: {m: {int(d): v for d, v in s.items()} for m, s in ms.items()} for t, ms in raw.items()}

    return computed_once(path, load, compute, lambda value, tmp: tmp.write_text(json.dumps(value)))


def orders_for(cfg: AccuracyProbeConfig, counts: dict[str, int], seed: int) -> dict[str, list[int]]:
    """Each task's cap (``limit`` documents, all when None) in draw order."""
    return {t: accuracy.sample_order(counts[t], cfg.limit, seed, t) for t in cfg.tasks}


def as_items(stops: dict[str, TaskStop]) -> dict[str, list[float]]:
    """Per-document values in look order (``acc/<task>``, ``doc_ids/<task>``), as the report pairs them."""
    items: dict[str, list[float]] = {}
    for t, st in stops.items():
        for metric, scores in st.scores.items():
            items[f"{metric}/{t}"] = scores
        items[f"doc_ids/{t}"] = [float(d) for d in st.docs]
    return items


def run(engine, tok, cfg: AccuracyProbeConfig, data_dir: str | None, cache_dir: str, seed: int, ref_key: dict,
        reference_engine: Callable[[], object], score_all: bool, identical: bool = False,
        progress: Callable[[str], None] = lambda _: None) -> tuple[dict[str, float], dict, dict, dict[str, str]]:
    """The adaptive accuracy probe on ``engine``: metrics (``acc/<task>`` over
    the documents scored, their standard errors, ``acc/<task>_documents`` and,
    unless ``score_all`` or ``identical``, the design: ``_adaptive_cap`` /
    ``_adaptive_chunk``), lm-eval's results per look, per-document items in
    look order, and why each task stopped. ``reference_engine()`` gives what
    scores the reference on a cache miss only. ``identical``: the point's
    outputs equal the reference's (shown by the fidelity probe), so its
    documents are the reference's over the cap."""
    from quantlab.probes import lm_adapter

    include, counts = accuracy.prepare_tasks(list(cfg.tasks), data_dir, cache_dir)
    orders = orders_for(cfg, counts, seed)

    def scorer(eng, looks: list):
        lm = lm_adapter.EngineLM(eng, tok, batch_size=cfg.batch_size, max_length=cfg.max_length)

        def run_docs(want: dict[str, list[int]]) -> dict:
            res = accuracy.run_lm_eval(lm, list(want), include, seed, {t: sorted(d) for t, d in want.items()})
            looks.append(res["results"])
            return per_doc(res.get("samples", {}))
        return run_docs

    data = {t: sha256_file(include / f"{accuracy.CONVERTERS[t][0]}.jsonl") for t in cfg.tasks}
    key = {**ref_key, "data": data, "seed": seed, "lm_eval": version("lm-eval"), "max_length": cfg.max_length,
           "scorer": sha256_file(Path(lm_adapter.__file__))}  # how documents are batched and scored
    reference = reference_scores(key, orders, cache_dir, lambda: scorer(reference_engine(), [])(orders))
    looks: list = []
    if identical:
        stops = {t: TaskStop(list(o), {m: [s[d] for d in o] for m, s in reference[t].items()},
                             f"{IDENTICAL_STOP}: its {len(o)} documents are the reference's")
                 for t, o in orders.items()}
    else:
        stops = evaluate(scorer(engine, looks), orders, reference, cfg.adaptive_chunk, cfg.adaptive_budgets,
                         cfg.adaptive_alpha, score_all, progress)
    items = as_items(stops)
    metrics = accuracy.item_stderrs(items)
    for t, st in stops.items():
        for metric, scores in st.scores.items():
            metrics[f"{metric}/{t}"] = sum(scores) / len(scores)
            metrics[f"{metric}/{t}_documents"] = float(len(scores))
            if not (score_all or identical):  # the cap scored: the report bounds it as a fixed design
                metrics[f"{metric}/{t}_adaptive_cap"] = float(len(orders[t]))
                metrics[f"{metric}/{t}_adaptive_chunk"] = float(cfg.adaptive_chunk)
    return metrics, {"looks": looks}, items, {t: st.reason for t, st in stops.items()}
