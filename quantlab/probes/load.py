"""Under load: TTFT / ITL / E2E percentiles against offered request rate.

One rate = an open-loop arrival schedule (Poisson or constant gaps) that a
generator thread submits on time whatever the server does, for
``duration_s``; the server (a :class:`Policy`) works through what arrives.
The generator's lateness (submitted minus scheduled) is recorded per request,
so a probe that could not keep its own schedule says so.

A rate ends when every request finished, or early with its reason: the
backlog passed ``max_backlog`` (the server fell behind for good), or the
drain took longer than ``drain_s``. Requests still open then count as not
completed, so achieved < offered shows the saturation.

Times are ``time.perf_counter()`` seconds from the rate's start. What a
server does with the requests (requests, policies, schedulers) is
:mod:`quantlab.serving`; this module makes the arrivals, runs the rates,
summarises them and finds each policy's knee (:mod:`quantlab.probes.knee`).
"""
from __future__ import annotations

import contextlib
import math
import queue
import random
import sys
import threading
import time
from typing import Callable

import numpy as np
import torch

from quantlab import uncertainty
from quantlab.config_check import check_choice, choices
from quantlab.probes.configs import LoadProbeConfig
from quantlab.probes import knee
from quantlab.serving.policies import Policy, cannot, make_policy
from quantlab.serving.requests import Limits, Request


def schedule(rate: float, duration_s: float, arrival: str, rng: random.Random) -> list[float]:
    """Arrival times in ``[0, duration_s)``: exponential gaps (``poisson``) or
    ``1/rate`` apart (``constant``); always at least one request."""
    if rate <= 0:
        raise ValueError(f"rate {rate}: must be > 0 requests/s")
    if arrival == "constant":
        return [i / rate for i in range(max(1, math.ceil(rate * duration_s - 1e-9)))]
    check_choice("arrival", arrival, choices(LoadProbeConfig, "arrival"))
    out, t = [], 0.0
    while t < duration_s or not out:
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Generator(threading.Thread):
    """Submits each request at ``t0 + due_s`` (sleeps, then spins the last
    2 ms, so lateness is the OS's wake-up plus GIL hand-over, not a sleep's
    granularity); ``stop()`` ends it before its schedule does."""

    SPIN_S = 0.002

    def __init__(self, requests: list[Request], submit: Callable[[Request], None], t0: float):
        super().__init__(daemon=True, name="quantlab-load-generator")
        self.requests, self.submit, self.t0 = requests, submit, t0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        for r in self.requests:
            while (wait := self.t0 + r.due_s - time.perf_counter()) > 0:
                if self._stop_event.is_set():
                    return
                time.sleep(wait - self.SPIN_S if wait > self.SPIN_S else 0)
            if self._stop_event.is_set():
                return
            r.sent_s = time.perf_counter() - self.t0
            self.submit(r)


# Python hands the GIL to a waiting thread only every switch interval (5 ms by
# default): the generator would wait that long behind a serving thread's
# Python code. 0.2 ms keeps arrivals on time; restored after the probe.
SWITCH_INTERVAL_S = 0.0002


@contextlib.contextmanager
def prompt_thread_switches(interval_s: float = SWITCH_INTERVAL_S):
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def generator_lateness_ms(rate: float, n: int = 100) -> np.ndarray:
    """Lateness (ms) of ``n`` constant-rate arrivals into a queue nobody serves:
    the generator's own overhead, before any model competes for the GIL."""
    reqs = [Request(i, i / rate, torch.zeros(1, dtype=torch.long), 1) for i in range(n)]
    inbox: queue.Queue = queue.Queue()
    g = Generator(reqs, inbox.put, time.perf_counter() + 0.01)
    g.start()
    g.join()
    return np.array([(r.sent_s - r.due_s) * 1e3 for r in reqs])

def percentiles(prefix: str, values, qs: tuple[int, ...] = (50, 99)) -> dict[str, float]:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {}
    return {f"{prefix}_p{q}": float(np.percentile(a, q)) for q in qs}


def summarize(requests: list[Request], rate: float, stopped: str, steps: int, bytes_per_step: float,
              peak_bytes_per_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None
              ) -> dict[str, float | str]:
    """One row of the load table; latencies over completed requests (the
    policy's warm-up ran before, as requests of their own). ``sent_rps``: the realized arrival rate (a Poisson
    schedule's count differs from the nominal ``offered_rps``);
    ``achieved_rps``: completions per second between the first and the last
    completion (steady state: the same as ``sent_rps`` when the server keeps
    up, its service rate when it does not); ``makespan_rps`` and ``tok_s``:
    per second from the first submission to the last completion (what a burst
    measures). TPOT per request, (last - first token) / (tokens - 1); P90s
    beside the P99s for the knee (:mod:`~quantlab.probes.knee`) of rates with
    fewer than 100 completed requests. Goodput: completed requests whose TTFT and mean TPOT both meet
    the SLO, per second of the makespan (absent without an SLO)."""
    done = [r for r in requests if r.done]
    sent = sorted(r.sent_s for r in requests if not math.isnan(r.sent_s))
    ends = sorted(r.tokens_s[-1] for r in requests if r.done)
    span = ends[-1] - sent[0] if sent and ends else math.nan
    ok = span > 0  # False for NaN
    row: dict[str, float | str] = {"offered_rps": rate, "requests": len(requests), "completed": len(ends)}
    row["sent_rps"] = (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else rate
    row["achieved_rps"] = ((len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0]
                           else len(ends) / span if ok else 0.0)
    row["makespan_rps"] = len(ends) / span if ok else 0.0
    row["tok_s"] = sum(len(r.tokens_s) for r in requests) / span if ok else 0.0
    ttft, tpot = knee.latencies(requests)
    row.update(percentiles("ttft_ms", ttft, (50, 90, 99)))
    row.update(percentiles("tpot_ms", tpot, (50, 90, 99)))
    row.update(percentiles("itl_ms", (d * 1e3 for r in done for d in np.diff(r.tokens_s))))
    row.update(percentiles("e2e_ms", ((r.tokens_s[-1] - r.sent_s) * 1e3 for r in done)))
    row.update(percentiles("queue_ms", ((r.start_s - r.sent_s) * 1e3 for r in done)))
    row.update(percentiles("late_ms", ((r.sent_s - r.due_s) * 1e3 for r in requests if not math.isnan(r.sent_s))))
    row["prompt_tokens_mean"] = float(np.mean([len(r.prompt) for r in requests]))
    row["new_tokens_mean"] = float(np.mean([r.n_new for r in requests]))
    batches = [r.batch for r in done]
    row["batch_mean"] = float(np.mean(batches)) if batches else 0.0
    row["batch_max"] = float(max(batches, default=0))
    if slo_ttft_ms is not None and slo_tpot_ms is not None and ok:
        good = sum(1 for r in done if (r.tokens_s[0] - r.sent_s) * 1e3 <= slo_ttft_ms
                   and (len(r.tokens_s) < 2 or (r.tokens_s[-1] - r.tokens_s[0]) * 1e3 / (len(r.tokens_s) - 1)
                        <= slo_tpot_ms))
        row["goodput_rps"] = good / span
        row["goodput_frac"] = good / len(requests)
    achieved_bw = steps * bytes_per_step / span if ok else 0.0
    row["bw_gb_s"] = achieved_bw / 1e9
    row["bw_util"] = achieved_bw / peak_bytes_per_s if peak_bytes_per_s else math.nan
    row["stopped"] = stopped
    return row


def run_rate(policy: Policy, prompts: list[torch.Tensor], n_new: int, rate: float, duration_s: float,
             arrival: str, limits: Limits, seed: int, n_new_min: int | None = None) -> tuple[list[Request], str]:
    """One offered rate through ``policy``: the requests (prompts drawn in
    turn; ``n_new`` tokens each, or with ``n_new_min`` a seeded uniform draw
    from ``[n_new_min, n_new]``) and '' or why the rate ended early. The
    generator is stopped and joined before returning, whatever happened."""
    rng = random.Random(seed)
    dues = schedule(rate, duration_s, arrival, rng)
    requests = [Request(i, t, prompts[i % len(prompts)], n_new if n_new_min is None else rng.randint(n_new_min, n_new))
                for i, t in enumerate(dues)]
    t0 = time.perf_counter()
    gen: list[Generator] = []

    def start(submit: Callable[[Request], None]) -> None:
        gen.append(Generator(requests, submit, t0))
        gen[0].start()

    try:
        stopped = policy.serve(requests, t0, dues[-1], limits, start)
    finally:
        for g in gen:
            g.stop()
            g.join()
    return requests, stopped

def measure(engine, prompts: list[torch.Tensor], cfg, bytes_per_step: float, peak_bytes_per_s: float,
            seed: int, progress: Callable[[str], None] = lambda _: None
            ) -> tuple[dict[str, float], list[dict], dict[str, str]]:
    """Every policy the engine can serve, at every rate: ``(metrics, rows, tags)``.
    Each policy first serves ``warmup_requests`` (discarded). ``rates: auto``
    then offers a burst (``2 x max_batch`` requests, 4 for pass-through) all
    at t=0 and takes its makespan rate as the policy's capacity;
    the rates are then ``auto_fractions`` of it. A policy the engine cannot
    serve is tagged ``load.<policy>.skipped`` with the reason."""
    with prompt_thread_switches():
        return _measure(engine, prompts, cfg, bytes_per_step, peak_bytes_per_s, seed, progress)


def _measure(engine, prompts, cfg, bytes_per_step, peak_bytes_per_s, seed, progress):
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    late = generator_lateness_ms(cfg.lateness_check_rps)
    metrics["load/generator_late_ms_p99"] = float(np.percentile(late, 99))
    metrics["load/generator_late_ms_max"] = float(late.max())
    for k in ("ttft_ms", "tpot_ms"):
        if getattr(cfg.slo, k) is not None:
            metrics[f"load/slo_{k}"] = float(getattr(cfg.slo, k))
    lengths = [len(p) for p in prompts]
    metrics["load/prompt_tokens_mean"] = float(np.mean(lengths))
    metrics["load/prompt_tokens_max"] = float(max(lengths))
    limits = Limits(cfg.max_backlog, cfg.drain_s)
    rows: list[dict] = []
    # the best policy is picked by its lower bound: each is bounded at alpha / policies (Bonferroni)
    alpha = (1 - uncertainty.LEVEL) / max(1, sum(not cannot(n, engine) for n in cfg.policies))
    metrics["load/knee_alpha"] = alpha
    for name in cfg.policies:
        if why := cannot(name, engine):
            tags[f"load.{name}.skipped"] = why
            progress(f"{name}: skipped ({why})")
            continue
        policy = make_policy(name, engine, cfg)
        try:
            burst = 2 * cfg.max_batch if name != "passthrough" else 4
            run_rate(policy, prompts, cfg.new_tokens, 1e4, cfg.warmup_requests / 1e4, "constant", limits, seed,
                     cfg.new_tokens_min)
            reqs, _ = run_rate(policy, prompts, cfg.new_tokens, 1e4, burst / 1e4, "constant",
                               Limits(10**6, cfg.drain_s), seed, cfg.new_tokens_min)
            capacity = summarize(reqs, 1e4, "", 0, 0.0, 0.0, None, None)["makespan_rps"]
            metrics[f"load/{name}/capacity_rps"] = capacity
            rates = [f * capacity for f in cfg.auto_fractions] if cfg.rates == "auto" else list(cfg.rates)
            progress(f"{name}: capacity {capacity:.2f} req/s (burst of {burst}); rates "
                     + ", ".join(f"{r:.2f}" for r in rates))
            mine, samples = [], []
            for i, rate in enumerate(rates):
                policy.steps = 0
                duration = max(cfg.duration_s, cfg.min_requests / rate)
                reqs, stopped = run_rate(policy, prompts, cfg.new_tokens, rate, duration, cfg.arrival,
                                         limits, seed + i, cfg.new_tokens_min)
                row = {"policy": name, **summarize(reqs, rate, stopped, policy.steps, bytes_per_step,
                                                   peak_bytes_per_s, cfg.slo.ttft_ms, cfg.slo.tpot_ms),
                       **policy.reported}
                mine.append(row)
                samples.append(knee.latencies(reqs))
                progress(f"{name} @ {rate:.2f} req/s: achieved {row['achieved_rps']:.2f}, TTFT p99 "
                         f"{row.get('ttft_ms_p99', math.nan):.0f} ms, TPOT p99 {row.get('tpot_ms_p99', math.nan):.1f} ms"
                         + (f" [{stopped}]" if stopped else ""))
            rows += mine
            k = knee.find(mine, samples, cfg.slo.ttft_ms, cfg.slo.tpot_ms, seed, alpha=alpha)
            metrics.update({f"load/{name}/knee_rps": k.rps, f"load/{name}/knee_rps_lower": k.lower,
                            f"load/{name}/knee_percentile": float(k.percentile),
                            f"load/{name}/knee_rates_passed": float(k.passed)})
            if k.why:
                tags[f"load.{name}.knee_stop"] = k.why
            metrics[f"load/{name}/achieved_rps_max"] = max(r["achieved_rps"] for r in mine)
            metrics[f"load/{name}/late_ms_p99_max"] = max(r.get("late_ms_p99", 0.0) for r in mine)
            if cfg.slo.ttft_ms is not None and cfg.slo.tpot_ms is not None:
                metrics[f"load/{name}/goodput_rps_max"] = max(r["goodput_rps"] for r in mine)
        finally:
            policy.close()
    lowers = {k.split("/")[1]: v for k, v in metrics.items() if k.endswith("/knee_rps_lower")}
    if lowers:  # the policy that promises most at the decision's level (ties: the higher knee)
        best = max(lowers, key=lambda p: (lowers[p], metrics[f"load/{p}/knee_rps"]))
        metrics["load/knee_rps"] = metrics[f"load/{best}/knee_rps"]
        metrics["load/knee_rps_lower"] = lowers[best]
        tags["load.knee_policy"] = best
    return metrics, rows, tags


COLUMNS = ("policy", "offered_rps", "sent_rps", "achieved_rps", "makespan_rps", "tok_s", "ttft_ms_p50", "ttft_ms_p90",
           "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50",
           "e2e_ms_p99", "queue_ms_p50", "queue_ms_p99", "server_ttft_ms_mean", "server_tpot_ms_mean",
           "server_itl_ms_mean", "batch_mean", "batch_max",
           "goodput_rps", "goodput_frac", "bw_gb_s", "bw_util", "late_ms_p99", "prompt_tokens_mean", "new_tokens_mean",
           "requests", "completed", "stopped")


def csv_text(rows: list[dict]) -> str:
    """The load table as CSV (one row per policy x rate; empty cells where a
    figure does not apply)."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    return buf.getvalue()


def read_csv(text: str) -> list[dict]:
    import csv
    import io

    out = []
    for r in csv.DictReader(io.StringIO(text)):
        out.append({k: (v if k in ("policy", "stopped") else float(v) if v not in ("", None) else math.nan)
                    for k, v in r.items()})
    return out

