"""The load probe's section of the report, "Serving": what the load probe measured, point
by point, in four tables, and one P99-against-rate plot overlaying points.

1. Capacity under the SLOs per point and policy (burst capacity, knee and its bound, goodput).
2. Policies side by side at each offered rate (P50/P99 TTFT and E2E, batch).
3. KV capacity: sequences of the context that the KV budget holds per cache.
4. Achieved memory bandwidth against offered rate per precision, with the knee.
5. Where the sweep spans engines (``target=cpu,llamacpp,vllm``): which serves each precision best.
"""
from __future__ import annotations

import math
from pathlib import Path

from quantlab import plots, point, uncertainty
from quantlab.metric_names import SectionView
from quantlab.probes import knee, load


def _rows(view: SectionView, run) -> list[dict]:
    """The load table a point logged; none read for a point the load probe
    did not measure (its metrics say so), so other sweeps' reports fetch
    nothing for this section."""
    if "load/generator_late_ms_max" not in run.metrics:
        return []
    path = view.download(run, "load.csv")
    return load.read_csv(path.read_text()) if path is not None else []


def _fmt(v, spec: str = "{:.2f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return spec.format(v)


def _md(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
                      *("| " + " | ".join(r) + " |" for r in rows)])


def engine_table(runs) -> str:
    """### 5: per precision (the scheme), each engine's capacity under the
    SLOs and the winner, by the knee's lower bound (as the budget rule ranks
    capacity); '' unless the finished points span two engines or more.
    Emulated points (not the scheme's kernels) never win; a winner whose
    lower bound does not clear the runner-up's knee is "ahead, not
    separated"; a contended figure (``†``) is said to be one."""
    done = [r for r in runs if r.done and "load/knee_rps_lower" in r.metrics]
    engine = lambda r: r.tags.get("target.variant") or r.tags.get("target", "?")  # noqa: E731
    if len({engine(r) for r in done}) < 2:
        return ""
    rows = []
    for scheme in sorted({r.tags.get(point.SCHEME_TAG, "?") for r in done}):
        group = sorted((r for r in done if r.tags.get(point.SCHEME_TAG, "?") == scheme),
                       key=lambda r: -r.metrics["load/knee_rps_lower"])
        cells = [f"{engine(r)} {_fmt(r.metrics.get('load/knee_rps'))} "
                 f"(>= {_fmt(r.metrics['load/knee_rps_lower'])})"
                 + ("†" if point.CONTENDED_TAG in r.tags else "")
                 + (" emulated" if r.tags.get(point.EMULATED_TAG) == "true" else "") for r in group]
        real = [r for r in group if r.tags.get(point.EMULATED_TAG) != "true"]
        if not real or real[0].metrics["load/knee_rps_lower"] <= 0:
            verdict = "none met the SLOs" if real else "no real kernel"
        elif len(real) == 1:
            verdict = f"{engine(real[0])} (the only engine that ran it for real)"
        else:
            top, second = real[0].metrics, real[1].metrics
            verdict = f"**{engine(real[0])}**" + ("" if top["load/knee_rps_lower"] > second.get("load/knee_rps", 0.0)
                                                 else f", ahead of {engine(real[1])} but not separated (its lower "
                                                      f"bound is under {engine(real[1])}'s knee)")
        if any(point.CONTENDED_TAG in r.tags for r in real[:2]):
            verdict += "; a figure was timed beside other work (†): re-time before trusting the order"
        rows.append([scheme, "; ".join(cells), verdict])
    return "\n\n".join(["### 5. Engines at each precision", _md(
        ["precision", "knee req/s (95% lower bound) per engine", "serves it best"], rows),
        "Ranked by the knee's lower bound (the capacity rule of the decision); each engine served the same "
        "scheme under the same load probe. An engine missing from a row skipped or failed that point (the "
        "report's table says why)."])


def section(view: SectionView) -> tuple[str, list[str]]:
    """Markdown of the section ('' when no run has a load table) and the plot
    files written into ``view.out``."""
    runs, out, title = view.runs, Path(view.out), view.title + ": load"
    tables = {r.name: _rows(view, r) for r in runs if r.done}
    tables = {k: v for k, v in tables.items() if v}
    by_name = {r.name: r for r in runs}
    kv_runs = [r for r in runs if "load/kv_capacity_seqs" in r.metrics]
    if not tables and not kv_runs:
        return "", []
    parts = ["## Serving (load probe)"]
    skipped = [f"- {r.name}: {k.split('.')[1]} skipped: {v}" for r in runs
               for k, v in sorted(r.tags.items()) if k.startswith("load.") and k.endswith(".skipped")]
    if tables:
        head = ["point", "policy", "capacity req/s (burst)", "knee req/s (achieved)",
                f"knee {uncertainty.LEVEL:.0%} lower bound", "SLO percentile", "first rate that failed",
                "max achieved req/s", "max goodput req/s", "arrivals late P99 ms: idle / under load"]
        rows = []
        for name, tab in tables.items():
            m, tags = by_name[name].metrics, by_name[name].tags
            for policy in dict.fromkeys(r["policy"] for r in tab):
                q = m.get(f"load/{policy}/knee_percentile")
                rows.append([name, policy, _fmt(m.get(f"load/{policy}/capacity_rps")),
                             _fmt(m.get(f"load/{policy}/knee_rps")), _fmt(m.get(f"load/{policy}/knee_rps_lower")),
                             f"P{q:.0f}" if q else "-", tags.get(f"load.{policy}.knee_stop", "none"),
                             _fmt(m.get(f"load/{policy}/achieved_rps_max")),
                             _fmt(m.get(f"load/{policy}/goodput_rps_max")),
                             _fmt(m.get("load/generator_late_ms_p99"), "{:.2f}") + " / "
                             + _fmt(m.get(f"load/{policy}/late_ms_p99_max"), "{:.2f}")])
        parts += ["### 1. Capacity under the SLOs", _md(head, rows),
                  "knee: the rates are walked from the lowest; one passes when it ended normally, kept up "
                  f"(achieved >= {knee.KEEP_UP} x arrivals), completed >= {knee.P90_MIN} requests and met both SLOs "
                  f"(TTFT and per-request TPOT) at the tail percentile: P99 when every rate completed >= "
                  f"{knee.P99_MIN} requests, else P90. The knee is the highest achieved rate of the rates that "
                  "passed in a row (the first failure ends the walk); its lower bound resamples each rate's "
                  f"requests (bootstrap, one-sided {uncertainty.LEVEL:.0%}) and is what the budget rule ranks "
                  "capacity by. Arrivals late: submitted minus scheduled, with no model running (idle) "
                  "and the worst rate's P99 while serving. continuous = the engine's own scheduler (transformers' "
                  "continuous batching; llama-server's slots on llamacpp); dynamic = quantlab's reference "
                  "batcher (max batch, max wait); passthrough = one request at a time."]
        head = ["point", "policy", "offered", "achieved", "TTFT p50", "TTFT p99", "TPOT p99", "server TPOT mean",
                "ITL p99", "E2E p50", "E2E p99", "mean batch", "ended"]
        rows = [[name, r["policy"], _fmt(r["offered_rps"]), _fmt(r["achieved_rps"]), _fmt(r["ttft_ms_p50"], "{:.0f}"),
                 _fmt(r["ttft_ms_p99"], "{:.0f}"), _fmt(r.get("tpot_ms_p99"), "{:.1f}"),
                 _fmt(r.get("server_tpot_ms_mean"), "{:.1f}"), _fmt(r["itl_ms_p99"], "{:.0f}"), _fmt(r["e2e_ms_p50"], "{:.0f}"),
                 _fmt(r["e2e_ms_p99"], "{:.0f}"), _fmt(r["batch_mean"], "{:.1f}"), r["stopped"] or "normally"]
                for name, tab in tables.items() for r in tab]
        parts += ["### 2. Policies at each offered rate (requests/s; latencies in ms)", _md(head, rows)]
    if kv_runs:
        head = ["point", "KV cache", "MiB per sequence", "sequences in budget", "timed batch", "decode tok/s",
                "step p50 ms", "step p99 ms"]
        rows = [[r.name, r.tags.get("backend.kv", "-"), _fmt(r.metrics["load/kv_seq_mb"]),
                 _fmt(r.metrics["load/kv_capacity_seqs"], "{:.0f}"),
                 _fmt(r.metrics["load/kv_batch"], "{:.0f}"), _fmt(r.metrics["load/kv_decode_tok_s"], "{:.1f}"),
                 _fmt(r.metrics["load/kv_step_ms_p50"], "{:.1f}"),
                 _fmt(r.metrics["load/kv_step_ms_p99"], "{:.1f}")] for r in kv_runs]
        m0 = kv_runs[0].metrics
        parts += [f"### 3. KV capacity in {m0['load/kv_budget_mb']:g} MiB at {m0['load/kv_context']:.0f} tokens",
                  _md(head, rows), "Sequences found by filling the point's own cache class and reading its bytes "
                  "back (residual full-precision windows included); the timed batch decodes after a prompt of "
                  "that context."]
    if tables:
        head = ["point", "policy", "offered", "achieved", "GB/s", "% of peak", "within knee"]
        rows = []
        for name, tab in tables.items():
            m, tags = by_name[name].metrics, by_name[name].tags
            policy = tags.get("load.knee_policy") or tab[0]["policy"]
            k = m.get(f"load/{policy}/knee_rps", 0.0)
            rows += [[name, policy, _fmt(r["offered_rps"]), _fmt(r["achieved_rps"]), _fmt(r["bw_gb_s"]),
                      _fmt(100 * r["bw_util"], "{:.1f}"), "yes" if 0 < r["achieved_rps"] <= k * (1 + 1e-3) else "no"]
                     for r in tab if r["policy"] == policy]
        parts += ["### 4. Achieved weight bandwidth against offered rate (each point's knee policy)", _md(head, rows),
                  "GB/s = model forwards x weight bytes read per forward / makespan (KV reads not counted)."]
    if engines := engine_table(runs):
        parts.append(engines)
    if skipped:
        parts += ["Policies a point could not serve:", *skipped]
    files = []
    if tables:
        series = {}
        for name, tab in tables.items():
            policy = by_name[name].tags.get("load.knee_policy") or tab[0]["policy"]
            series[f"{name} / {policy}"] = [r for r in tab if r["policy"] == policy]
        any_run = next(iter(by_name.values()))
        slo = {"ttft_ms": any_run.metrics.get("load/slo_ttft_ms"),
               "tpot_ms": any_run.metrics.get("load/slo_tpot_ms")}
        plots.load_png(series, out / "load.png", title, slo)
        plots.load_html(series, out / "load.html", title)
        files = ["load.png", "load.html"]
        parts.append("Plot: load.png / load.html (P99 TTFT, P99 ITL and achieved rate against offered rate).")
    return "\n\n".join(parts), files
