"""quantlab beside llama.cpp's own tools on the same GGUF files: the KL
divergence and same-top-token rate of a quant against its F16 as
``llama-perplexity --kl-divergence`` prints them, and decode speed as
``llama-bench`` prints it.

KL: ``llama-perplexity`` tokenizes the text with the model's tokenizer, cuts
it into chunks of ``--ctx`` tokens and scores the second half of each chunk
(positions ``ctx/2 .. ctx-2``, each predicting the next token); quantlab does
the same through its llama.cpp engine (llama-cpp-python on the same llama.cpp)
and its own :func:`quantlab.divergence.kl_per_token`. Both print a mean and
its standard error over tokens. Both run flash attention off, as quantlab's
engine does with an F16 cache: llama.cpp's default (auto: on, on a CPU) moves
SmolLM2's Q6_K KL by 6 %, 3 standard errors.

TPOT: ``llama-bench -p 0 -n N`` (decode only, from an empty context) against
the greedy decode quantlab's latency probe times (:meth:`LlamaCppEngine.decode`
from a one-token prompt), interleaved ``--rounds`` times, same threads: the
ratio is each round's quantlab TPOT over the llama-bench TPOT of the same
round, its geometric mean over rounds with a 95 % t interval (the host's
drift between rounds hits both sides of a round alike).

    python benchmarks/llamacpp_peers.py --model smollm2 --quants Q4_K_M,Q6_K [--tools DIR]

The tools: ``bash scripts/build_llama_tools.sh DIR`` (default DIR:
``~/.cache/quantlab/llama-tools/<llama-cpp-python version>-r<its revision>``).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from quantlab import divergence, hardware, model_files, models
from quantlab.config import ModelConfig, TinyModelConfig
from quantlab.engines.llamacpp import LlamaCppEngine, extra_buffers_ok
from quantlab.export import gguf as gguf_export

_KLD = re.compile(r"Mean\s+KLD:\s+([-\d.eE+]+)\s+±\s+([-\d.eE+]+)")
_TOP = re.compile(r"Same top p:\s+([-\d.eE+]+)\s+±\s+([-\d.eE+]+)\s*%")


BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_llama_tools.sh"


def default_tools() -> Path:
    """Where the tools of this llama-cpp-python's llama.cpp, built by this
    checkout's build script, are cached:
    ``~/.cache/quantlab/llama-tools/<version>-r<the script's revision>``."""
    revision = subprocess.run(["bash", str(BUILD_SCRIPT), "--revision"], capture_output=True, text=True,
                              check=True).stdout.strip()
    return (Path("~/.cache/quantlab/llama-tools").expanduser()
            / f"{importlib.metadata.version('llama-cpp-python')}-r{revision}")


def _repack(bench: bool = False) -> list[str]:
    """Weight repacking off where quantlab's engine turns it off (AMX-INT8
    hosts: :func:`extra_buffers_ok`), so the tools run what the engine runs."""
    if extra_buffers_ok(hardware.cpu_flags()):
        return []
    return ["--repack", "0"] if bench else ["--no-repack"]


def theirs_kld(tools: Path, base: Path, quant: Path, text: Path, ctx: int, threads: int) -> dict[str, float]:
    """``llama-perplexity --kl-divergence`` of ``quant`` against ``base`` on
    ``text``: ``kld``, ``kld_se``, ``same_top``, ``same_top_se`` (fractions)."""
    exe = str(tools / "llama-perplexity")
    # as quantlab's engine runs an F16 cache: flash attention off (llama-perplexity's default, auto, turns it on)
    common = ["-c", str(ctx), "-b", str(ctx), "-t", str(threads), "-ngl", "0", "-fa", "off", *_repack()]
    with tempfile.TemporaryDirectory() as tmp:
        logits = str(Path(tmp) / "base.kld")
        first = subprocess.run([exe, "-m", str(base), "-f", str(text), "--kl-divergence-base", logits, *common],
                               capture_output=True, text=True, timeout=1800)
        if first.returncode != 0:
            raise RuntimeError(f"llama-perplexity (base) failed: {first.stderr[-1500:]}")
        second = subprocess.run([exe, "-m", str(quant), "--kl-divergence-base", logits, "--kl-divergence",
                                 *common], capture_output=True, text=True, timeout=1800)
        if second.returncode != 0:
            raise RuntimeError(f"llama-perplexity (kl) failed: {second.stderr[-1500:]}")
        out = second.stdout + second.stderr
        kld, top = _KLD.search(out), _TOP.search(out)
        if kld is None or top is None:
            raise RuntimeError(f"llama-perplexity printed no KLD statistics (tools built before "
                               f"scripts/build_llama_tools.sh drained its log?): {out[-1500:]}")
    return {"kld": float(kld[1]), "kld_se": float(kld[2]),
            "same_top": float(top[1]) / 100, "same_top_se": float(top[2]) / 100}


def ours_kld(base: Path, quant: Path, text: str, ctx: int, vocab: int, threads: int) -> dict[str, float]:
    """The same figures from quantlab's llama.cpp engine and KL: the text
    tokenized by the base file's tokenizer as llama-perplexity does (BOS where
    the vocabulary asks for it, also as each chunk's first token), chunks of
    ``ctx``, positions ``ctx/2 .. ctx-2``; standard errors over tokens."""
    ref = LlamaCppEngine(base, "F16", vocab, n_ctx=ctx, n_batch=ctx, threads=threads)
    other = LlamaCppEngine(quant, "F16", vocab, n_ctx=ctx, n_batch=ctx, threads=threads)
    try:
        add_bos = bool(ref.llm._model.add_bos_token())
        ids = ref.llm.tokenize(text.encode(), add_bos=True, special=False)
        first = ctx // 2
        kl, same = [], []
        for c in range(len(ids) // ctx):
            chunk = list(ids[c * ctx:(c + 1) * ctx])
            if add_bos:
                chunk[0] = ref.llm.token_bos()
            row = torch.tensor([chunk])
            p, q = ref.logits(row)[0, first:ctx - 1], other.logits(row)[0, first:ctx - 1]
            kl.append(divergence.kl_per_token(p, q))
            same.append((p.argmax(-1) == q.argmax(-1)).double())
    finally:
        ref.close()
        other.close()
    k, s = torch.cat(kl), torch.cat(same)
    n = k.numel()
    return {"kld": float(k.mean()), "kld_se": float(k.std(correction=1) / n ** 0.5),
            "same_top": float(s.mean()), "same_top_se": float((s.mean() * (1 - s.mean()) / (n - 1)) ** 0.5),
            "tokens": float(n)}


def theirs_tpot_ms(tools: Path, path: Path, n_gen: int, threads: int) -> float:
    """``llama-bench -p 0 -n n_gen`` (flash attention off, as the engine runs
    an F16 cache): ms per generated token (its mean)."""
    proc = subprocess.run([str(tools / "llama-bench"), "-m", str(path), "-p", "0", "-n", str(n_gen), "-t", str(threads),
                           "-r", "3", "-ngl", "0", "-fa", "off", "-o", "json", *_repack(bench=True)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr[-1500:]}")
    row = json.loads(proc.stdout)[0]
    return 1e3 / float(row["avg_ts"])


def ours_tpot_ms(path: Path, vocab: int, n_gen: int, threads: int) -> float:
    """quantlab's engine: median of 3 greedy decodes of ``n_gen`` tokens from
    a one-token prompt, each the mean of its step times (the tokens after the
    first, as the latency probe's TPOT)."""
    eng = LlamaCppEngine(path, "F16", vocab, n_ctx=n_gen + 8, threads=threads)
    try:
        eng.decode(torch.tensor([[1]]), 4)  # warm-up
        runs = [statistics.mean(eng.decode(torch.tensor([[1]]), n_gen).step_ms) for _ in range(3)]
    finally:
        eng.close()
    return statistics.median(runs)


def _model(name: str):
    if name == "tiny":
        cfg = ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(hidden_size=256, intermediate_size=512))
    else:
        from hydra import compose, initialize_config_dir

        from quantlab.cli import CONF_DIR
        from quantlab.compose import register_configs
        from omegaconf import OmegaConf

        register_configs()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = OmegaConf.to_object(compose("config", overrides=[f"model={name}"])).model
    return models.load(cfg, "~/.cache/quantlab")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model preset, or tiny")
    ap.add_argument("--quants", default="Q4_K_M,Q6_K,Q8_0")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chars", type=int, default=60000, help="characters of WikiText-2's test split scored")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tools", type=Path, default=default_tools())
    args = ap.parse_args()
    from quantlab.probes import perplexity

    data = os.environ.get("QUANTLAB_DATA_DIR") or str(Path(__file__).resolve().parents[2] / "shared" / "data")
    text = perplexity.wikitext2_text(data)[:args.chars]
    model, tok = _model(args.model)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "text.txt").write_text(text)
        model.half()
        base = tmp / "F16.gguf"
        gguf_export.write(model, tok, base, getattr(model, "quantlab_gguf", None))
        print(f"# {hardware.cpu_name()}, {args.threads} threads; {args.model}; ctx {args.ctx}; "
              f"{len(text)} characters of WikiText-2 test\n")
        print("| quant | types | KLD quantlab | KLD llama-perplexity | same top quantlab | same top llama-perplexity "
              "| TPOT ms quantlab (median) | TPOT ms llama-bench (median) | quantlab / llama-bench (95 % CI) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for quant in args.quants.split(","):
            path = tmp / f"{quant}.gguf"
            gguf_export.quantize(base, path, quant, threads=args.threads)
            mix = ", ".join(f"{k} {v:.0%}" for k, v in model_files.gguf_type_mix(str(path)).items())
            ours = ours_kld(base, path, text, args.ctx, vocab, args.threads)
            theirs = theirs_kld(args.tools, base, path, tmp / "text.txt", args.ctx, args.threads)
            t_ours, t_theirs = [], []
            for _ in range(args.rounds):  # interleaved: drift hits both
                t_ours.append(ours_tpot_ms(path, vocab, args.n_gen, args.threads))
                t_theirs.append(theirs_tpot_ms(args.tools, path, args.n_gen, args.threads))
            print(f"| {quant} | {mix} | {ours['kld']:.5f} ± {ours['kld_se']:.5f} | {theirs['kld']:.5f} ± "
                  f"{theirs['kld_se']:.5f} | {ours['same_top']:.4f} ± {ours['same_top_se']:.4f} | "
                  f"{theirs['same_top']:.4f} ± {theirs['same_top_se']:.4f} | "
                  f"{statistics.median(t_ours):.2f} | {statistics.median(t_theirs):.2f} | "
                  f"{ratio_text(t_ours, t_theirs)} |", flush=True)


def ratio_text(ours: list[float], theirs: list[float]) -> str:
    """Geometric mean of the per-round ratios with its 95 % t interval
    (``x1.04 [0.99, 1.09]``); the ratio alone for one round."""
    from scipy import stats

    logs = [math.log(a / b) for a, b in zip(ours, theirs)]
    m = statistics.mean(logs)
    if len(logs) < 2:
        return f"x{math.exp(m):.3f}"
    h = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return f"x{math.exp(m):.3f} [{math.exp(m - h):.3f}, {math.exp(m + h):.3f}]"


if __name__ == "__main__":
    main()
