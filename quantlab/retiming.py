"""The re-timing at the end of a sweep (the measurement behind
:mod:`quantlab.retime`): the points the loss half qualified, fastest first
by their sweep's estimate and at most ``decision.retime_points``, rebuilt
from their runs' configs and timed side by side in interleaved rounds on
this host, now. The result goes onto the sweep's parent run as
``retime.json``; where nothing is re-timed, the parent's tag
:data:`quantlab.report.verdict.SKIPPED_TAG` says why, and the report says the latency half is the
point estimate only.

Each candidate is rebuilt through the point's own pipeline
(:func:`quantlab.pipeline.built`): a calibrated point from the quantized
model it kept, when the cache still holds it. All engines are held at once,
so the candidates' weights must fit in the memory available (else no
re-timing, said). Targets that hold one engine at a time (vLLM, Neuron)
are not re-timed.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time

import psutil

from quantlab import corpus, metric_names, pipeline, provenance, report, tracking
from quantlab.export import state as quantized_state
from quantlab.export_run import run_config
from quantlab.measurement import Measurement
from quantlab.probes import latency
from quantlab.report.verdict import SKIPPED_TAG
from quantlab.retime import ARTIFACT, Retimed

log = logging.getLogger("quantlab")
ONE_ENGINE = ("vllm", "neuron")  # targets whose engines cannot be held side by side
MEMORY_HEADROOM = 1.5  # held engines x their weights must fit this many times in the available memory


def candidates(recs: dict, cap: int) -> list[str]:
    """The ``cap`` fastest (by estimate) of the points any budget qualified."""
    pts = {p.name: p for rec in recs.values() for p in rec.qualified}
    return sorted(pts, key=lambda n: (pts[n].cost, n))[:cap]


def after_sweep(tracker: tracking.Tracker, parent_id: str) -> Retimed | None:
    """Re-time the sweep's candidates as its declared decision says and log
    the result on the parent run (or why not, as :data:`~quantlab.report.verdict.SKIPPED_TAG`)."""
    runs, _reused, tags, base, items = report.sweep_data(tracker, parent_id)
    decision = report.verdict.declared(tags)
    parent = tracker.run(parent_id)
    if decision is None or not decision.retime_rounds:
        return None
    recs = report.verdict.loss_half(runs, base, items, decision)
    names = candidates(recs, decision.retime_points)
    by_name = {r.name: r for r in runs}
    why = "the pick is by capacity under load (a serving sweep), which is not re-timed" \
        if report.verdict.objective(runs) == "capacity" else _cannot(names, by_name)
    if why:
        parent.set_tags({SKIPPED_TAG: why})
        log.info("re-timing: none (%s)", why)
        return None
    log.info("re-timing %s side by side: %d interleaved rounds", ", ".join(names), decision.retime_rounds)
    began = time.perf_counter()
    try:
        retimed = measure(tracker, [by_name[n] for n in names], decision.retime_rounds)
    except Exception as e:  # noqa: BLE001 - a point that ran once may not build again: say so, never lose the report
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        parent.set_tags({SKIPPED_TAG: why})
        log.warning("re-timing failed (%s): the latency half is the sweep's estimate only", why)
        return None
    parent.log_text(retimed.to_json(), ARTIFACT)
    parent.log_metrics({"retime/seconds": time.perf_counter() - began, "retime/points": float(len(names)),
                        "retime/rounds": float(decision.retime_rounds)})
    return retimed


def _cannot(names: list[str], by_name: dict) -> str:
    """Why these candidates are not re-timed; '' when they can be."""
    if len(names) < 2:
        return f"{len(names)} point{'s' if len(names) != 1 else ''} qualified: nothing to separate"
    held = [n for n in names if by_name[n].tags.get("target", "") in ONE_ENGINE]
    if held:
        return f"{', '.join(held)}: their target holds one engine at a time"
    need = sum(by_name[n].metrics.get(metric_names.WEIGHT_MB, 0.0) for n in names) * 2**20 * MEMORY_HEADROOM
    available = psutil.virtual_memory().available
    if need > available:
        return f"their engines need about {need / 2**30:.1f} GiB at once, {available / 2**30:.1f} GiB is available"
    return ""


def measure(tracker: tracking.Tracker, runs: list, rounds: int) -> Retimed:
    """Build every run's engine (its point's own config, as it logged it),
    then :func:`interleave` them."""
    with contextlib.ExitStack() as stack:
        built = []
        for r in runs:
            source = tracker.run(r.origin)
            cfg = run_config(source)
            state = (tracker.tags(r.origin) or {}).get(quantized_state.TAG)
            engine, _model, tok, _target = stack.enter_context(
                pipeline.built(cfg, r.name, Measurement(), state=state))
            built.append((r.name, engine, tok, cfg.probe.latency))
        return interleave(built, rounds)


def interleave(built: list[tuple], rounds: int) -> Retimed:
    """``built``: ``(name, engine, tokenizer, latency probe config)`` each.
    One warm-up request each, then ``rounds`` rounds of one request per
    engine (its latency config's primary cell), the order reversed every
    other round; per round, each one's median step."""
    timed = []
    for name, engine, tok, lat in built:
        if lat.new_tokens < 2:
            raise ValueError(f"{name}: probe.latency.new_tokens={lat.new_tokens} times no decode step")
        timed.append((name, engine, tok, corpus.prompt_text(tok, lat.prompt_tokens), lat, engine.clock()))
    for _name, engine, tok, prompt, lat, clock in timed:
        for _ in range(max(1, lat.warmup)):
            latency.run_request(engine, tok, prompt, lat, clock)
    table = []
    for i in range(rounds):
        row = {}
        for name, engine, tok, prompt, lat, clock in (timed if i % 2 == 0 else timed[::-1]):
            row[name] = statistics.median(latency.run_request(engine, tok, prompt, lat, clock).step_ms)
        table.append(tuple(row[n] for n, *_ in timed))
    lat = timed[0][4]
    return Retimed(tuple(n for n, *_ in timed), tuple(table),
                   f"batch {lat.batch_size}, prompt {lat.prompt_tokens} tokens, {lat.new_tokens} new tokens, "
                   f"host {provenance.host_id()}")
