"""Ray's cost per point and its speed-up with nodes, on local
``ray.cluster_utils.Cluster`` nodes of one CPU each (this machine's cores
bound the speed-up: on 2 cores, 2 nodes at most).

Runs the same N tiny points (model=tiny, probe=smoke) with the basic
launcher in one process (file store), then with ``hydra/launcher=ray`` on
1..``--nodes`` local nodes through a tracking server quantlab starts
(``tracking=server``). Prints per design: wall time, time per point, the
speed-up over one Ray node and the tracking writes the server took per
second (params, tags and metric values of the sweep's runs over its wall
time); then Ray's overhead per point on one node against the basic launcher
(a fresh worker process per point, scheduling, logging over HTTP).

    python benchmarks/ray_scale.py [--points fp32,bf16,fp16,int8,int4-g64,int4-g32] [--nodes 2]
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str]) -> float:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quantlab", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"sweep failed ({' '.join(args)}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def writes(db: Path) -> int:
    """Params, tags and metric values the store holds (one write each, at least)."""
    c = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = c.search_runs([c.get_experiment_by_name("quantlab").experiment_id], max_results=1000)
    return sum(len(r.data.params) + len(r.data.tags) + len(r.data.metrics) for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="fp32,bf16,fp16,int8,int4-g64,int4-g32")
    ap.add_argument("--nodes", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1
    from ray.cluster_utils import Cluster

    n = len(args.points.split(","))
    common = ["-m", "model=tiny", "probe=smoke", f"scheme/weights={args.points}", "probe.latency.repeats=1"]
    root = Path(tempfile.mkdtemp(prefix="quantlab-ray-scale-"))
    basic = run([*common, f"tracking.uri=sqlite:///{root}/basic.db", f"tracking.artifact_root={root}/basic-art"])
    rows = [("basic launcher, 1 process", basic, None)]
    for nodes in range(1, args.nodes + 1):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1)
        serve = root / f"ray{nodes}"
        try:
            wall = run([*common, "hydra/launcher=ray", f"hydra.launcher.ray.init.address={cluster.address}",
                        "hydra.launcher.ray.remote.num_cpus=1", "tracking=server",
                        f"tracking.uri=http://127.0.0.1:{free_port()}", f"tracking.serve={serve}"])
        finally:
            cluster.shutdown()
        rows.append((f"ray, {nodes} node(s) of 1 CPU", wall, writes(serve / "mlflow.db") / wall))
    one_node = rows[1][1]
    print(f"{n} points, model=tiny probe=smoke; {os.cpu_count()} cores; store {root}")
    print(f"{'design':28} {'wall s':>8} {'s/point':>8} {'speed-up vs 1 node':>19} {'writes/s':>9}")
    for name, wall, wps in rows:
        speed = "-" if wps is None else f"{one_node / wall:.2f}x"
        print(f"{name:28} {wall:8.1f} {wall / n:8.1f} {speed:>19} {'-' if wps is None else f'{wps:.0f}':>9}")
    print(f"Ray's overhead per point on one node (fresh worker, scheduling, logging over HTTP, the server's start "
          f"spread over the points): {(one_node - basic) / n:.1f} s, {(one_node - basic) / basic:.0%} of the basic "
          f"launcher's time")

if __name__ == "__main__":
    main()
