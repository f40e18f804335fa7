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

Times are ``time.perf_counter()`` seconds from the rate's start.
"""
from __future__ import annotations

import abc
import contextlib
import math
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from quantlab.decode import Clock


@dataclass
class Request:
    """One request and what happened to it. ``tokens_s``: when each generated
    token was ready (the first ends the TTFT)."""

    rid: int
    due_s: float  # scheduled arrival
    prompt: torch.Tensor  # [P] token ids
    n_new: int
    sent_s: float = math.nan  # when the generator submitted it
    start_s: float = math.nan  # when the server took it off the queue
    tokens_s: list[float] = field(default_factory=list)
    batch: int = 0  # how many sequences it ran beside (itself included)
    tokens: list[int] = field(default_factory=list)  # what it generated (greedy)

    @property
    def done(self) -> bool:
        return len(self.tokens_s) >= self.n_new


def schedule(rate: float, duration_s: float, arrival: str, rng: random.Random) -> list[float]:
    """Arrival times in ``[0, duration_s)``: exponential gaps (``poisson``) or
    ``1/rate`` apart (``constant``); always at least one request."""
    if rate <= 0:
        raise ValueError(f"rate {rate}: must be > 0 requests/s")
    if arrival == "constant":
        return [i / rate for i in range(max(1, math.ceil(rate * duration_s - 1e-9)))]
    if arrival != "poisson":
        raise ValueError(f"arrival={arrival!r}; valid: poisson, constant")
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


@dataclass
class Limits:
    """When a rate gives up: more than ``max_backlog`` requests waiting, or
    requests still open ``drain_s`` after the last arrival."""

    max_backlog: int
    drain_s: float

    def why_stop(self, now_s: float, waiting: int, open_: int, last_due_s: float) -> str:
        """'' while the rate goes on; else why it ends: ``waiting`` requests
        queued beyond the running batch, ``open_`` not finished yet."""
        if waiting > self.max_backlog:
            return (f"saturated: {waiting} requests waiting at {now_s:.1f} s (more than max_backlog="
                    f"{self.max_backlog}); the server fell behind the offered rate")
        if now_s > last_due_s + self.drain_s:
            return f"did not drain: {open_} requests open {self.drain_s:g} s after the last arrival"
        return ""


class Policy(abc.ABC):
    """A server: takes the requests a :class:`Generator` submits and fills in
    their ``start_s``, ``tokens_s`` and ``batch``. ``steps`` counts the model
    forwards it ran (for achieved bandwidth)."""

    def __init__(self):
        self.steps = 0

    @abc.abstractmethod
    def serve(self, requests: list[Request], t0: float, last_due_s: float, limits: Limits,
              start: Callable[[Callable[[Request], None]], None]) -> str:
        """Serve until every request is done; ``start(submit)`` starts the
        generator with this policy's submit function. Returns '' or the reason
        the rate ended early."""

    def close(self) -> None:
        """Release what the policy holds (a scheduler thread)."""


class BatchPolicy(Policy):
    """quantlab's reference dynamic batcher (not an engine's scheduler): when a
    request waits, collect up to ``max_batch`` of them, waiting at most
    ``max_wait_ms`` after the first, and decode them as one static batch to the
    longest request's length (nobody joins a running batch; prompts of
    different lengths are left-padded by the engine). ``max_batch=1``
    is pass-through: one request at a time, in arrival order."""

    def __init__(self, engine, max_batch: int, max_wait_ms: float):
        super().__init__()
        self.engine, self.max_batch, self.max_wait_s = engine, max_batch, max_wait_ms / 1e3

    def serve(self, requests, t0, last_due_s, limits, start) -> str:
        inbox: queue.Queue = queue.Queue()
        start(inbox.put)
        clock = self.engine.clock()
        left = len(requests)
        while left:
            if stopped := limits.why_stop(time.perf_counter() - t0, inbox.qsize(), left, last_due_s):
                return stopped
            try:
                first = inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self.max_batch:
                wait = first.sent_s + self.max_wait_s - (time.perf_counter() - t0)
                try:
                    batch.append(inbox.get(timeout=wait) if wait > 0 else inbox.get_nowait())
                except queue.Empty:
                    break
            self._run(batch, t0, clock)
            left -= len(batch)
        return ""

    def _run(self, batch: list[Request], t0: float, clock: Clock) -> None:
        began = time.perf_counter() - t0
        n_new = max(r.n_new for r in batch)
        out = self.engine.decode_batch([r.prompt for r in batch], n_new, clock)
        self.steps += n_new
        times = began + np.cumsum([out.prefill_ms, *out.step_ms]) / 1e3
        chosen = (torch.cat([torch.as_tensor(c).reshape(len(batch), -1)[:, :1] for c in out.chosen], dim=1)
                  if out.chosen else None)
        for i, r in enumerate(batch):
            r.start_s, r.batch = began, len(batch)
            r.tokens_s = [float(t) for t in times[:r.n_new]]
            r.tokens = [] if chosen is None else chosen[i, :r.n_new].tolist()



def count_overlaps(requests: list[Request]) -> None:
    """For a scheduler that does not report its batches: each finished
    request's ``batch`` = the finished requests in flight when its first
    token came out (itself included)."""
    for r in requests:
        if r.done:
            r.batch = sum(1 for q in requests if q.done and q.start_s <= r.tokens_s[0] <= q.tokens_s[-1])


class ContinuousPolicy(Policy):
    """transformers' continuous batching (``ContinuousBatchingManager``, paged
    KV cache, FIFO scheduler) over the point's own model and quantized layers:
    requests join and leave the running batch at every step. The manager's
    per-token timestamps (``perf_counter``) are the token times; ``batch`` is
    how many requests were in flight when a request's first token came out."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_tokens: int, page_size: int = 32):
        super().__init__()
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        blocks = max_batch * math.ceil(max_tokens / page_size) + max_batch
        cb = ContinuousBatchingConfig(max_requests_per_batch=max_batch, num_blocks=blocks, page_size=page_size,
                                      max_batch_tokens=max(512, max_tokens))
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max_tokens)
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        self._hook = model.register_forward_pre_hook(self._count)
        self._round = 0

    def _count(self, *_):
        self.steps += 1

    def serve(self, requests, t0, last_due_s, limits, start) -> str:
        self._round += 1
        key = {f"{self._round}-{r.rid}": r for r in requests}

        def submit(r: Request) -> None:
            self.manager.add_request(r.prompt.tolist(), request_id=f"{self._round}-{r.rid}",
                                     max_new_tokens=r.n_new, record_timestamps=True)

        start(submit)
        left, stopped = len(requests), ""
        while left:
            in_system = sum(1 for r in requests if not math.isnan(r.sent_s)) - (len(requests) - left)
            waiting = in_system - self.manager.continuous_batching_config.max_requests_per_batch
            if stopped := limits.why_stop(time.perf_counter() - t0, waiting, left, last_due_s):
                break
            out = self.manager.get_result(timeout=0.05)
            if out is None or out.request_id not in key:
                continue
            if out.error:
                raise RuntimeError(f"continuous batching failed request {out.request_id}: {out.error}")
            r = key[out.request_id]
            r.start_s = out.lifespan[0] - t0
            r.tokens_s = [t - t0 for t in out.timestamps or []]
            r.tokens = list(out.generated_tokens)
            left -= 1
        if stopped:
            for rid, r in key.items():
                if not r.done and not math.isnan(r.sent_s):
                    self.manager.cancel_request(rid)
        count_overlaps(requests)
        return stopped

    def close(self) -> None:
        """Stop the manager's thread (it restores the model's attention)."""
        self._hook.remove()
        self.manager.stop(block=True, hard_stop=True)
        self.manager.destroy()


def percentiles(prefix: str, values) -> dict[str, float]:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {}
    return {f"{prefix}_p50": float(np.percentile(a, 50)), f"{prefix}_p99": float(np.percentile(a, 99))}


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
    measures). Goodput: completed requests whose TTFT and mean TPOT both meet
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
    row.update(percentiles("ttft_ms", ((r.tokens_s[0] - r.sent_s) * 1e3 for r in done)))
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


def knee(rows: list[dict], slo_ttft_ms: float | None, keep_up: float = 0.9) -> float:
    """The highest offered rate that ended normally, whose achieved rate is at
    least ``keep_up`` of the realized arrival rate and (with an SLO) whose P99
    TTFT meets the SLO; 0 when none does."""
    ok = [r["offered_rps"] for r in rows
          if not r["stopped"] and r["achieved_rps"] >= keep_up * r["sent_rps"]
          and (slo_ttft_ms is None or r.get("ttft_ms_p99", math.inf) <= slo_ttft_ms)]
    return max(ok, default=0.0)


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


POLICIES = ("continuous", "dynamic", "passthrough")
NEEDS = {"continuous": "continuous", "dynamic": "batch", "passthrough": ""}


def make_policy(name: str, engine, cfg) -> Policy:
    """The policy ``name`` over ``engine`` (``cfg``: :class:`LoadProbeConfig`)."""
    if name == "continuous":
        return engine.scheduler(cfg.max_batch, cfg.prompt_tokens + cfg.new_tokens)
    if name == "dynamic":
        return BatchPolicy(engine, cfg.max_batch, cfg.max_wait_ms)
    if name == "passthrough":
        return BatchPolicy(engine, 1, 0.0)
    raise ValueError(f"probe.load.policies: unknown policy {name!r}; valid: {', '.join(POLICIES)}")


def cannot(name: str, engine) -> str:
    """Why ``engine`` cannot serve policy ``name`` ('' when it can)."""
    return engine.cannot(NEEDS[name]) if NEEDS.get(name) else ""


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
            mine = []
            for i, rate in enumerate(rates):
                policy.steps = 0
                duration = max(cfg.duration_s, cfg.min_requests / rate)
                reqs, stopped = run_rate(policy, prompts, cfg.new_tokens, rate, duration, cfg.arrival,
                                         limits, seed + i, cfg.new_tokens_min)
                row = {"policy": name, **summarize(reqs, rate, stopped, policy.steps, bytes_per_step,
                                                   peak_bytes_per_s, cfg.slo.ttft_ms, cfg.slo.tpot_ms)}
                mine.append(row)
                progress(f"{name} @ {rate:.2f} req/s: achieved {row['achieved_rps']:.2f}, TTFT p99 "
                         f"{row.get('ttft_ms_p99', math.nan):.0f} ms, ITL p99 {row.get('itl_ms_p99', math.nan):.0f} ms"
                         + (f" [{stopped}]" if stopped else ""))
            rows += mine
            metrics[f"load/{name}/knee_rps"] = knee(mine, cfg.slo.ttft_ms)
            metrics[f"load/{name}/achieved_rps_max"] = max(r["achieved_rps"] for r in mine)
            metrics[f"load/{name}/late_ms_p99_max"] = max(r.get("late_ms_p99", 0.0) for r in mine)
            if cfg.slo.ttft_ms is not None and cfg.slo.tpot_ms is not None:
                metrics[f"load/{name}/goodput_rps_max"] = max(r["goodput_rps"] for r in mine)
        finally:
            policy.close()
    knees = {k.split("/")[1]: v for k, v in metrics.items() if k.endswith("/knee_rps")}
    if knees:
        best = max(knees, key=knees.get)
        metrics["load/knee_rps"] = knees[best]
        tags["load.knee_policy"] = best
    return metrics, rows, tags


COLUMNS = ("policy", "offered_rps", "sent_rps", "achieved_rps", "makespan_rps", "tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
           "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "queue_ms_p50", "queue_ms_p99", "batch_mean", "batch_max",
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
