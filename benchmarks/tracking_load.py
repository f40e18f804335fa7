"""How many sweep points a second one MLflow tracking server can take: the
ceiling that decides when a large sweep's logging, not its points, sets the pace.

Starts ``mlflow server`` the way ``tracking=server`` does
(:func:`quantlab.tracking_server.command`; SQLite under a temporary
directory, or ``--backend`` a database URI such as PostgreSQL), then W writer
processes each log P synthetic points shaped like a quantlab point (through
quantlab's own tracking calls: a run with its tags and params, the config and
per-item artifacts, its metrics, its end) as fast as they can, for W in
``--writers``. Prints per W: points a second, tracking writes (params + tags +
metric values) a second, and the median and P99 time to log one point. The
writers share this machine's cores with the server: on a 2-core host the
figure is a floor of what a dedicated head node takes.

    python benchmarks/tracking_load.py [--writers 1,2,4,8] [--points 20] [--backend postgresql+psycopg2://...]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantlab import tracking, tracking_server
from quantlab.tracking_config import TrackingConfig

PARAMS, TAGS, METRICS = 100, 36, 150  # a smoke point on model=tiny: 99 params, 41 tags (5 from Tracker.start), 85 metrics
WRITES = PARAMS + TAGS + 5 + METRICS + 1  # Tracker.start adds 5 tags (host, pid, ...), end the outcome
CONFIG_BYTES, ITEMS = 2_000, 2_000  # config.yaml, and per-item values (items.json)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_points(uri: str, n: int, seed: int, go, out) -> None:
    """Log ``n`` synthetic points to ``uri`` once every writer is ready (``go``);
    put (start, end, each point's seconds) on ``out``."""
    sys.stdout = open(os.devnull, "w")  # MLflow prints a "View run" line per run ended
    rng = random.Random(seed)
    tracker = tracking.connect(TrackingConfig(uri=uri, artifact_root=None, experiment="load"))
    go.wait()
    start, times = time.time(), []
    for i in range(n):
        t = time.perf_counter()
        tags = {f"tag.{k}": f"v{rng.random():.6f}" for k in range(TAGS)}
        params = {f"param.{k}": f"{rng.random():.6f}" for k in range(PARAMS)}
        run = tracker.start(f"w{seed}-p{i}", tags, parent="load", params=params)
        run.log_text("x" * CONFIG_BYTES, "config.yaml")
        run.log_metrics({f"metric/{k}": rng.random() for k in range(METRICS)})
        run.log_text(json.dumps([rng.random() for _ in range(ITEMS // 20)]), tracking.ITEMS_ARTIFACT)
        run.end("finished")
        times.append(time.perf_counter() - t)
    out.put((start, time.time(), times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", default="1,2,4,8")
    ap.add_argument("--points", type=int, default=20, help="points each writer logs")
    ap.add_argument("--backend", default=None, help="the server's database URI (default: SQLite in a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="quantlab-load-"))
    uri = f"http://127.0.0.1:{free_port()}"
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen(tracking_server.command(uri, root, args.backend), stdout=log, stderr=log,
                                  start_new_session=True)
    try:
        while tracking_server.unreachable(uri):
            if server.poll() is not None:
                raise SystemExit(f"server exited: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                   platform.processor())
        print(f"# {cpu}, {os.cpu_count()} cores; server {uri} (1 worker), backend "
              f"{args.backend or 'SQLite'}; {args.points} points per writer, each {PARAMS} params, {TAGS} tags, "
              f"{METRICS} metrics, 2 artifacts")
        print("| writers | points/s | writes/s | s/point P50 | s/point P99 |")
        print("|---|---|---|---|---|")
        ctx = mp.get_context("spawn")
        for w in [0, *(int(x) for x in args.writers.split(","))]:  # 0: one writer's warm-up, not printed
            warmup, w = w == 0, max(w, 1)
            out, go = ctx.Queue(), ctx.Barrier(w)
            procs = [ctx.Process(target=log_points, args=(uri, args.points, 1000 * w + k, go, out))
                     for k in range(w)]
            for p in procs:
                p.start()
            got = [out.get() for _ in procs]
            for p in procs:
                p.join()
            wall = max(g[1] for g in got) - min(g[0] for g in got)
            times = [s for g in got for s in g[2]]
            n = len(times)
            times.sort()
            if not warmup:
                print(f"| {w} | {n / wall:.2f} | {n * WRITES / wall:.0f} | "
                      f"{statistics.median(times):.3f} | {times[min(n - 1, int(0.99 * n))]:.3f} |", flush=True)
    finally:
        tracking_server.stop(server.pid)
        server.wait()


if __name__ == "__main__":
    main()
