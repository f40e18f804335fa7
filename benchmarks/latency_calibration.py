"""How often the decision's latency half states what is false, and how often
the loss half's budgets together qualify a point that loses at least its
budget, simulated through the report's own code (``retime.claim``,
``pareto.fastest_within``). The loss half's per-budget cells are
``benchmarks/decision_calibration.py``'s.

Latency half: two or three candidates, the first ``gap`` (0-6 %) slower in
truth than the others, re-timed in ``rounds`` interleaved rounds as
:mod:`quantlab.retiming` times them (order reversed every other round).
Each request's log TPOT is its point's true log TPOT plus
- a drift of the host shared by requests close in time (AR(1) over the
  request sequence, sd ``drift``, ``phi`` 0.98 per request: minutes-long),
- per-request noise: ``--noise`` ``normal`` (sd 2 %), ``heavy`` (sd 2 % plus,
  one request in ten, a stall of 5-30 %), or ``host``: rounds resampled
  from a measured re-timing of two identical points (``--host FILE``, a
  ``retime.json``; its log ratios, centred, are the noise),
- an engine-instance effect (``--instance``, sd of log TPOT): each
  candidate's engine, built once for the re-timing, is that much faster or
  slower than the scheme is (memory placement, allocator state) for the
  whole session; the claim is about the scheme, so the effect is error.
A trial errs when the claim is false: the pick's true TPOT is more than
``within`` above another candidate's (a "fastest, shown" that is not, or a
tie margin too narrow). Goal: error <= alpha + 2 se in every cell.

Joint budgets: point A's true loss is the smaller budget, B's the larger
(each a null hypothesis at the budget it sits on), normal bounds; an error
is qualifying either at a budget it loses at least. Holm per budget (the
old rule) against closed testing over both budgets (the report's).

    python benchmarks/latency_calibration.py [--trials 2000] [--seed 0] [--noise heavy] [--host retime.json] \
        [--instance 0,0.02] [--allowed 0]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from statistics import NormalDist

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decision_calibration import share  # noqa: E402

from quantlab import retime  # noqa: E402
from quantlab.pareto import Point, fastest_within  # noqa: E402

GAPS = (0.0, 0.01, 0.02, 0.03, 0.04, 0.06)
DRIFTS = (0.0, 0.05)


def host_noise(path: str) -> np.ndarray:
    """Centred per-round log ratios of the first two points of a measured
    ``retime.json`` (identical points: the host's own noise)."""
    r = retime.Retimed.from_json(open(path).read())
    d = np.log(r.column(r.names[0])) - np.log(r.column(r.names[1]))
    return d - d.mean()


def rounds_table(rng, true_ms: list[float], rounds: int, noise: str, drift: float,
                 host: np.ndarray | None = None, instance: float = 0.0) -> retime.Retimed:
    """One simulated re-timing of points with true TPOTs ``true_ms`` (each
    engine off its scheme's truth by its instance effect, sd ``instance``)."""
    true_ms = [t * math.exp(rng.normal(0, instance)) if instance else t for t in true_ms]
    k = len(true_ms)
    n = rounds * k
    walk = np.zeros(n)
    if drift:
        phi = 0.98
        e = rng.normal(0, drift * math.sqrt(1 - phi ** 2), n)
        walk[0] = rng.normal(0, drift)
        for i in range(1, n):
            walk[i] = phi * walk[i - 1] + e[i]
    if noise == "host":
        each = rng.normal(0, 1e-9, n)
    else:
        each = rng.normal(0, 0.02, n)
        if noise == "heavy":
            each += (rng.random(n) < 0.1) * rng.uniform(0.05, 0.30, n)
    table, t = [], 0
    for r in range(rounds):
        order = range(k) if r % 2 == 0 else range(k - 1, -1, -1)
        row = [0.0] * k
        for j in order:
            row[j] = true_ms[j] * math.exp(walk[t] + each[t])
            t += 1
        if noise == "host":  # measured rounds' log ratios (of two points: each point's share is 1/sqrt 2)
            row = [v * math.exp(host[rng.integers(host.size)] / math.sqrt(2)) for v in row]
        table.append(tuple(row))
    return retime.Retimed(tuple(f"p{j}" for j in range(k)), tuple(table))


def latency_error(rng, gap: float, k: int, rounds: int, noise: str, drift: float, alpha: float,
                  trials: int, tie_break: str = "latency", host: np.ndarray | None = None,
                  instance: float = 0.0, allowed: float | None = None) -> tuple[float, float]:
    """(error rate, se): the claim is false (see the module's docstring).
    ``allowed``: the instance sd the claim allows for (default ``instance``)."""
    allowed = instance if allowed is None else allowed
    true_ms = [10.0 * (1 + gap)] + [10.0] * (k - 1)
    names = [f"p{j}" for j in range(k)]
    rank = {n: float(j) for j, n in enumerate(names)}  # tie-break size: p0 (the slow one) is the smallest
    bad = 0
    for _ in range(trials):
        c = retime.claim(names, rounds_table(rng, true_ms, rounds, noise, drift, host, instance), alpha, tie_break,
                         rank, allowed)
        truth = {n: true_ms[j] for j, n in enumerate(names)}
        bad += any(truth[c.pick] > (1 + c.within) * truth[n] for n in names if n != c.pick)
    return share(bad, trials)


def _normal_point(rng, name: str, loss: float, se: float) -> Point:
    est = rng.normal(loss, se)
    upper = lambda a: est + NormalDist().inv_cdf(1 - a) * se  # noqa: E731
    p_value = lambda b: 1 - NormalDist().cdf((b - est) / se)  # noqa: E731
    return Point(name, 1.0 if name == "A" else 2.0, est, loss_upper=upper(0.05), p_value=p_value, upper_at=upper)


def joint_error(rng, budgets: tuple[float, float], se: float, alpha: float, trials: int,
                joint: bool) -> tuple[float, float]:
    """(error rate, se) over both budgets: A's true loss is the smaller
    budget, B's the larger; ``joint``: the report's closed testing, else
    Holm per budget."""
    bad = 0
    for _ in range(trials):
        pts = [_normal_point(rng, "A", budgets[0], se), _normal_point(rng, "B", budgets[1], se)]
        wrong = False
        for b in budgets:
            rec = fastest_within(pts, b, alpha=alpha, budgets=budgets if joint else ())
            truth = {"A": budgets[0], "B": budgets[1]}
            wrong |= any(truth[p.name] >= b for p in rec.qualified)
        bad += wrong
    return share(bad, trials)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--alpha", type=float, default=0.025, help="the latency half's share (default: 0.05 split)")
    ap.add_argument("--noise", default="normal,heavy", help="normal, heavy, host (with --host)")
    ap.add_argument("--host", help="a retime.json of two identical points: its rounds are the host's noise")
    ap.add_argument("--instance", default="0", help="engine-instance sds to simulate, comma-separated (0.02: 2 %%)")
    ap.add_argument("--allowed", default="", help="the instance sd the claim allows for (default: the simulated)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    host = host_noise(args.host) if args.host else None
    noises = [n for n in args.noise.split(",") if n != "host" or host is not None]
    began = time.perf_counter()
    print(f"Latency half: {args.rounds} interleaved rounds, error {args.alpha:g} over all pairs, {args.trials} "
          f"trials a cell; error = the claim is false (goal <= {args.alpha:g} + 2 se).\n")
    print("| noise | host drift sd | instance sd (allowed) | candidates | tie-break | "
          + " | ".join(f"gap {g:.0%}" for g in GAPS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(GAPS))
    worst = 0.0
    for instance in (float(x) for x in args.instance.split(",")):
        allowed = float(args.allowed) if args.allowed else instance
        for noise in noises:
            for drift in DRIFTS:
                for k, tie in ((2, "latency"), (2, "size"), (3, "size")):
                    cells = []
                    for gap in GAPS:
                        p, se = latency_error(rng, gap, k, args.rounds, noise, drift, args.alpha, args.trials, tie,
                                              host, instance, allowed)
                        worst = max(worst, p - args.alpha - 2 * se)
                        cells.append(f"{p:.2%} ± {se:.2%}")
                    print(f"| {noise} | {drift:.0%} | {instance:.0%} ({allowed:.0%}) | {k} | {tie} | "
                          + " | ".join(cells) + " |", flush=True)
    print("\nLoss half over two budgets (A's true loss 0.01, B's 0.05; normal bounds, se 0.01; error = either "
          "qualified at a budget it loses at least; goal <= 0.025 + 2 se):\n")
    print("| rule | error |\n|---|---|")
    for joint in (False, True):
        p, se = joint_error(rng, (0.01, 0.05), 0.01, 0.025, args.trials, joint)
        print(f"| {'closed testing over both budgets (the report)' if joint else 'Holm per budget (before)'} | "
              f"{p:.2%} ± {se:.2%} |")
    print(f"\n{time.perf_counter() - began:.0f} s; worst latency cell over its goal by {max(worst, 0):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
