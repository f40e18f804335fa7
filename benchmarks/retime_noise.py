"""The host's own re-timing noise: one point built twice and re-timed
against itself in the interleaved rounds :mod:`quantlab.retiming` times a
sweep's candidates with, so every difference between the two copies is
noise. Prints the spread of the per-round log ratio and the interval the
report would state over 12 rounds; writes a ``retime.json`` that
``benchmarks/latency_calibration.py --host`` resamples.

    python benchmarks/retime_noise.py [--rounds 40] [--out retime-noise.json] [overrides ...]
        (default overrides: model=smollm2-135m scheme/weights=bf16 probe=headline)
"""
from __future__ import annotations

import argparse
import contextlib
import math
import time
from pathlib import Path

import numpy as np

from quantlab import hardware, pipeline, retime
from quantlab.measurement import Measurement
from quantlab.retiming import interleave


def main(argv: list[str] | None = None) -> int:
    from tests.conftest import compose_cfg

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default="retime-noise.json")
    ap.add_argument("overrides", nargs="*", default=["model=smollm2-135m", "scheme/weights=bf16", "probe=headline"])
    args = ap.parse_args(argv)
    cfg = compose_cfg(args.overrides)
    began = time.perf_counter()
    with contextlib.ExitStack() as stack:
        built = []
        for name in ("a", "b"):
            engine, _model, tok, _target = stack.enter_context(pipeline.built(cfg, name, Measurement()))
            built.append((name, engine, tok, cfg.probe.latency))
        timed = interleave(built, args.rounds)
    Path(args.out).write_text(timed.to_json())
    d = np.log(timed.column("a")) - np.log(timed.column("b"))
    c = retime.claim(["a", "b"], retime.Retimed(timed.names, timed.rounds[:12]), 0.025 / 2)
    print(f"{cfg.model.name} {cfg.scheme.weights.short_name()} against itself, {args.rounds} rounds "
          f"({hardware.cpu_name()}, {time.perf_counter() - began:.0f} s): TPOT median "
          f"{np.median(timed.column('a')):.2f} ms; per-round log ratio sd {d.std(ddof=1):.4f} "
          f"(mean {d.mean():+.4f}); over the first 12 rounds the report would say the pick is within "
          f"{c.within:.1%} (tie-break latency); written {args.out}")
    return 0 if math.isfinite(c.within) else 1


if __name__ == "__main__":
    raise SystemExit(main())
