"""The latency half of a decision: "fastest" among the points that qualified
on loss, stated with its error from a paired, interleaved re-timing.

A sweep times its points one after another, minutes apart: a drift of the
host (another process, a clock, the page cache) moves a point's TPOT by as
much as the schemes differ (5-6 % between two headline sweeps on one host).
So at the end of a sweep the candidates are timed again side by side
(:mod:`quantlab.retiming`): every engine held at once, ``rounds`` rounds of
one request each, the order reversed every other round (a drift inside a
round cancels over two). The unit is the round: per round, each
candidate's median step time (:class:`Retimed`, logged as ``retime.json``
on the sweep's parent run).

The claim (:func:`claim`): for every ordered pair (a, b) of the re-timed
candidates, the one-sided t bound over rounds on the mean of
``ln(TPOT_a / TPOT_b)`` at ``alpha / (K (K - 1))``: simultaneous over all
pairs, so every budget's claim holds at once with error at most ``alpha``.
Each engine is built once for the re-timing, and one instance of a scheme
may run a few percent off another for a whole session (six re-timings of
the same points moved a ratio with sd 2.7 % where one's rounds gave a
standard error of 0.9 %): the bound's variance adds ``2 instance_sd**2``,
so the claim is about the schemes, not these engine instances.
Among a budget's qualified points the leader has the least mean log TPOT;
tied with it is every point the leader is not shown faster than. The pick
is the leader, or the tie-break's choice among the tied (least weight
memory, fewest bits per weight); its claim: its TPOT is at most ``within``
above every other qualified re-timed point's (``within`` < 0: faster than
each of them by at least ``-within``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

ARTIFACT = "retime.json"


@dataclass(frozen=True)
class Retimed:
    """Per round, each candidate's median step time (ms), in ``names`` order."""

    names: tuple[str, ...]
    rounds: tuple[tuple[float, ...], ...]
    cell: str = ""  # the request timed, in words
    note: str = ""  # why a candidate was left out, where one was

    def column(self, name: str) -> np.ndarray:
        i = self.names.index(name)
        return np.array([r[i] for r in self.rounds], dtype=np.float64)

    def to_json(self) -> str:
        return json.dumps({"names": list(self.names), "rounds": [list(r) for r in self.rounds],
                           "cell": self.cell, "note": self.note}, indent=1)

    @staticmethod
    def from_json(text: str) -> Retimed:
        d = json.loads(text)
        return Retimed(tuple(d["names"]), tuple(tuple(r) for r in d["rounds"]), d.get("cell", ""),
                       d.get("note", ""))


@dataclass(frozen=True)
class Claim:
    pick: str
    leader: str  # least mean log TPOT among the qualified re-timed points
    tied: tuple[str, ...]  # the others the leader is not shown faster than
    within: float  # the pick's TPOT is at most this much above each other's (< 0: faster by at least -within)
    ratio: dict[str, float]  # each qualified re-timed point's TPOT over the pick's (geometric mean over rounds)
    level: float  # one-sided error of each comparison
    rounds: int
    untimed: tuple[str, ...]  # qualified points that were not re-timed
    instance_sd: float = 0.0  # each engine's allowed offset from its scheme


def upper(a: np.ndarray, b: np.ndarray, level: float, instance_sd: float = 0.0) -> float:
    """One-sided ``1 - level`` upper bound on the mean over rounds of
    ``ln(a / b)`` (t on the rounds, ``R - 1`` degrees of freedom), its
    variance widened by each engine's own offset from its scheme (sd
    ``instance_sd`` each, independent)."""
    d = np.log(a) - np.log(b)
    se = math.sqrt(float(d.var(ddof=1)) / d.size + 2 * instance_sd ** 2)
    return float(d.mean()) + float(stats.t.ppf(1.0 - level, d.size - 1)) * se


def claim(qualified: list[str], retimed: Retimed | None, alpha: float, tie_break: str = "latency",
          rank: dict[str, float] | None = None, instance_sd: float = 0.0) -> Claim | None:
    """The latency claim among ``qualified`` (point names) from ``retimed``;
    None when none of them was re-timed. ``rank``: name -> the tie-break's
    figure (weight MiB for ``size``, bits per weight for ``bits``; lower
    wins), required unless ``tie_break`` is ``latency``. ``instance_sd``:
    see :func:`upper`."""
    if retimed is None or len(retimed.rounds) < 2:
        return None
    timed = [n for n in qualified if n in retimed.names]
    if not timed:
        return None
    k = len(retimed.names)
    level = alpha / max(1, k * (k - 1))
    col = {n: retimed.column(n) for n in timed}
    mean_log = {n: float(np.log(col[n]).mean()) for n in timed}
    leader = min(timed, key=lambda n: (mean_log[n], n))
    tied = tuple(n for n in sorted(timed, key=lambda n: (mean_log[n], n))
                 if n != leader and upper(col[leader], col[n], level, instance_sd) >= 0)
    pool = [leader, *tied]
    pick = leader if tie_break == "latency" else min(pool, key=lambda n: (rank[n], mean_log[n], n))
    others = [n for n in timed if n != pick]
    within = max((math.expm1(upper(col[pick], col[n], level, instance_sd)) for n in others), default=math.nan)
    ratio = {n: math.exp(mean_log[n] - mean_log[pick]) for n in timed}
    return Claim(pick, leader, tied, within, ratio, level, len(retimed.rounds),
                 tuple(n for n in qualified if n not in retimed.names), instance_sd)


def claim_lines(c: Claim, tie_break: str) -> list[str]:
    """The report's lines under a budget's pick: what the re-timing shows."""
    others = ", ".join(f"{n} x{c.ratio[n]:.3f}" for n in sorted(c.ratio, key=lambda n: (c.ratio[n], n))
                       if n != c.pick)
    design = f"re-timed side by side, {c.rounds} interleaved rounds, each comparison at error {c.level:.3g}" + (
        f", allowing each engine {c.instance_sd:.1%} off its scheme's speed" if c.instance_sd else "")
    if not others:
        lines = [f"  - the only qualified point re-timed ({design})"]
    elif c.within < 0:
        lines = [f"  - fastest, shown: its TPOT is at least {-c.within:.1%} below each other qualified point's "
                 f"({design}; their TPOT over the pick's: {others})"]
    else:
        tied = ", ".join(n for n in (c.leader, *c.tied) if n != c.pick)
        why = "" if c.pick == c.leader else f" (the fastest by the re-timing is {c.leader}; tie-break `{tie_break}`)"
        lines = [f"  - tied on latency with {tied}: the re-timing does not separate them{why}. The pick's TPOT is at "
                 f"most {c.within:.1%} above each other qualified point's ({design}; their TPOT over the pick's: "
                 f"{others})"]
    if c.untimed:
        lines.append(f"  - not re-timed: {', '.join(c.untimed)} (qualified, slower by the sweep's estimate than the "
                     f"candidates decision.retime_points admits): the latency claim leaves them out")
    return lines
