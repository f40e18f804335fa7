"""Per-layer sensitivity, and mixed-precision recipes under a bits budget.

    python -m quantlab.sensitivity --model smollm2-135m --candidates int4-g64,int4-g32,int8 --budgets 5.0,5.5

1. **Sensitivity**: for every quantizable Linear layer and every candidate, the
   mean KL divergence of the model with *only that layer* quantized from the
   unquantized model (both in fp32, see :func:`measure`) over the fidelity text, and
   the layer's bits per weight as the candidate stores it (packed weights,
   scales and zero points, measured on the built module). ``bf16`` (the layer
   kept) is always a candidate: KL 0, 16 bits.
2. **Recipe**: one candidate per layer minimising the summed KL under a budget
   in bits per Linear weight (a multiple-choice knapsack: Lagrangian
   relaxation, then a greedy fill of what budget is left). Summed per-layer KL
   is a proxy; the recipe runs as a normal point
   (``scheme/weights=mixed scheme.weights.recipe=...``) so that its real KL,
   perplexity and latency are measured, not predicted.

Writes ``sensitivity.json`` (the table; reused when model, candidates, corpus
and token count match), ``sensitivity.png`` (layer x candidate heat map) and
one ``<budget>b.yaml`` recipe per budget into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from quantlab.errors import UserError

log = logging.getLogger("quantlab")


@dataclass
class Table:
    """``kl[layer][candidate]``, ``bits[layer][candidate]``, ``numel[layer]``; ``key`` identifies what was measured."""

    key: dict
    candidates: list[str]
    numel: dict[str, int]
    kl: dict[str, dict[str, float]]
    bits: dict[str, dict[str, float]]

    @property
    def layers(self) -> list[str]:
        return list(self.numel)

    def average_bits(self, choice: dict[str, str]) -> float:
        total = sum(self.numel.values())
        return sum(self.bits[n][c] * self.numel[n] for n, c in choice.items()) / total

    def predicted_kl(self, choice: dict[str, str]) -> float:
        return sum(self.kl[n][c] for n, c in choice.items())


def _module_bytes(module: torch.nn.Module) -> int:
    from quantlab.probes.size import tensor_bytes

    persistent = [b for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    return sum(tensor_bytes(t) for t in (*module.parameters(recurse=False), *persistent))


def _kl(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    logq = torch.log_softmax(logits.double(), -1)
    return float((ref_logp.exp() * (ref_logp - logq)).sum(-1).mean())


def _dense(q: torch.nn.Module, lin: torch.nn.Linear) -> torch.nn.Linear:
    """An fp32 ``nn.Linear`` holding the weights ``q`` computes with."""
    dense = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    dense.weight.data = q.dequantize().float().contiguous()
    if lin.bias is not None:
        dense.bias.data = lin.bias.data.float()
    return dense


@torch.inference_mode()
def measure(model: torch.nn.Module, ids: torch.Tensor, candidates: list[str], dtype: torch.dtype,
            skip: list[str], key: dict) -> Table:
    """The sensitivity table of ``model`` (fp32). Each candidate's weights,
    built on its real module in compute ``dtype``, are dequantized into an fp32
    layer, and the model runs in fp32: in bf16, swapping any one layer
    re-rolls the rounding of everything after it (KL ~5e-4 whatever the
    change, on SmolLM2), which would swamp the quantization error and not add
    up across layers."""
    from quantlab.schemes import layers
    from quantlab.schemes.mixed import KEEP, quantize_linear

    model.float().eval()
    ref = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].double(), -1)
    linears = layers.select(model, skip)
    table = Table(key=key, candidates=[KEEP, *[c for c in candidates if c != KEEP]], numel={}, kl={}, bits={})
    start = time.perf_counter()
    for i, (name, lin) in enumerate(linears):
        table.numel[name] = lin.weight.numel()
        table.kl[name] = {KEEP: 0.0}
        table.bits[name] = {KEEP: float(torch.finfo(dtype).bits)}  # kept in the compute dtype
        for cand in table.candidates[1:]:
            q = quantize_linear(lin, cand, dtype)
            layers.replace(model, name, _dense(q, lin))
            table.kl[name][cand] = _kl(ref, model(input_ids=ids, use_cache=False).logits[0])
            table.bits[name][cand] = 8.0 * _module_bytes(q) / lin.weight.numel()
        layers.replace(model, name, lin)
        if (i + 1) % 10 == 0 or i + 1 == len(linears):
            log.info("sensitivity: %d/%d layers (%.0f s)", i + 1, len(linears), time.perf_counter() - start)
    return table


def solve(table: Table, budget_bits: float) -> dict[str, str]:
    """One candidate per layer, least summed KL with average bits <= budget."""
    cheapest = {n: min(table.candidates, key=lambda c: (table.bits[n][c], table.kl[n][c])) for n in table.layers}
    floor = table.average_bits(cheapest)
    if floor > budget_bits + 1e-9:
        raise UserError(f"budget {budget_bits:g} bits/weight is below the cheapest recipe ({floor:.3f}): "
                        f"add a smaller candidate or raise the budget")
    total = sum(table.numel.values())

    def pick(lam: float) -> dict[str, str]:
        return {n: min(table.candidates, key=lambda c: (table.kl[n][c] + lam * table.bits[n][c] *
                                                         table.numel[n] / total, table.bits[n][c]))
                for n in table.layers}

    lo, hi = 0.0, 1.0
    while table.average_bits(pick(hi)) > budget_bits:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if table.average_bits(pick(mid)) > budget_bits else (lo, mid)
    choice = pick(hi)
    while True:  # greedy fill: the upgrade with the most KL saved per bit that still fits
        used = table.average_bits(choice) * total
        best, best_rate = None, 0.0
        for n in table.layers:
            for c in table.candidates:
                extra = (table.bits[n][c] - table.bits[n][choice[n]]) * table.numel[n]
                saved = table.kl[n][choice[n]] - table.kl[n][c]
                if extra > 0 and saved > 0 and used + extra <= budget_bits * total and saved / extra > best_rate:
                    best, best_rate = (n, c), saved / extra
        if best is None:
            return choice
        choice[best[0]] = best[1]


def recipe(table: Table, choice: dict[str, str], budget_bits: float) -> dict:
    """The recipe YAML content: the most common candidate as ``default``, the rest by layer."""
    counts: dict[str, int] = {}
    for c in choice.values():
        counts[c] = counts.get(c, 0) + 1
    default = max(counts, key=counts.get)
    return {"name": f"{budget_bits:g}b", "default": default,
            "layers": {n: c for n, c in choice.items() if c != default},
            "predicted": {"bits_per_linear_weight": round(table.average_bits(choice), 4),
                          "kl_sum": float(f"{table.predicted_kl(choice):.4g}"), "layers_by_candidate": counts},
            "source": table.key}


def heatmap(table: Table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cands = table.candidates[1:]
    data = np.array([[max(table.kl[n][c], 1e-9) for c in cands] for n in table.layers])
    fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(cands), max(4.0, 0.06 * len(table.layers))))
    im = ax.imshow(np.log10(data), aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(cands)), cands)
    step = max(1, len(table.layers) // 40)
    ax.set_yticks(range(0, len(table.layers), step), [table.layers[i] for i in range(0, len(table.layers), step)],
                  fontsize=6)
    ax.set_title("log10 KL, only this layer quantized")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _model_config(name: str):
    from omegaconf import OmegaConf

    from quantlab.cli import CONF_DIR, presets
    from quantlab.config import ModelConfig

    if name not in presets("model"):
        raise UserError(f"unknown model {name!r}; valid: {', '.join(presets('model'))}")
    node = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    node.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


def main(argv: list[str] | None = None) -> int:
    import os

    ap = argparse.ArgumentParser(prog="python -m quantlab.sensitivity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a conf/model preset")
    ap.add_argument("--candidates", default="int4-g64,int4-g32,int8")
    ap.add_argument("--budgets", default="5.0", help="bits per Linear weight, comma-separated")
    ap.add_argument("--corpus", default="auto", help="fidelity text: auto (WikiText-2 when present), builtin, ...")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--compute-dtype", default="bfloat16")
    ap.add_argument("--out", help="directory for the table, heat map and recipes (default recipes/<model>)")
    ap.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"))
    ap.add_argument("--cache-dir", default="~/.cache/quantlab")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    try:
        from quantlab.schemes.mixed import valid_candidate

        candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
        bad = [c for c in candidates if not valid_candidate(c)]
        if bad or not candidates:
            raise UserError(f"candidates {bad or '(none)'}; valid: bf16, int8, int4-g32/g64/g128/g256[-sym]")
        budgets = [float(b) for b in args.budgets.split(",")]
        if any(b <= 0 for b in budgets) or args.tokens < 2:
            raise UserError("budgets must be > 0 bits/weight and --tokens >= 2")
        table = run(args.model, candidates, args.corpus, args.tokens, args.compute_dtype,
                    Path(args.out or f"recipes/{args.model}"), args.data_dir, args.cache_dir, budgets)
    except (UserError, ValueError) as e:
        print(f"quantlab.sensitivity: {e}", file=sys.stderr)
        return 2
    log.info("sensitivity: %d layers x %d candidates in %s", len(table.layers), len(table.candidates), args.out or f"recipes/{args.model}")
    return 0


def run(model_name: str, candidates: list[str], corpus_name: str, tokens: int, compute_dtype: str, out: Path,
        data_dir: str | None, cache_dir: str, budgets: list[float]) -> Table:
    """Measure (or reuse) the table, draw it, write a recipe per budget."""
    from quantlab import models
    from quantlab.probes import corpus
    from quantlab.schemes.layers import DEFAULT_SKIP

    cfg = _model_config(model_name)
    corpus_used = corpus.resolve(corpus_name, data_dir)
    key = {"model": model_name, "candidates": candidates, "corpus": corpus_used, "tokens": tokens,
           "compute_dtype": compute_dtype, "skip": DEFAULT_SKIP, "reference": "fp32, dequantized layer"}
    out.mkdir(parents=True, exist_ok=True)
    cached = out / "sensitivity.json"
    table = None
    if cached.is_file():
        data = json.loads(cached.read_text())
        if data.get("key") == key:
            table = Table(**data)
            log.info("sensitivity: reusing %s (same model, candidates, corpus, tokens)", cached)
    if table is None:
        model, tok = models.load(cfg, cache_dir)
        ids = corpus.token_ids(tok, corpus_used, tokens, data_dir)
        log.info("sensitivity: %s, %d tokens of %s, candidates %s", model_name, tokens, corpus_used, candidates)
        table = measure(model, ids, candidates, getattr(torch, compute_dtype), list(DEFAULT_SKIP), key)
        cached.write_text(json.dumps(asdict(table), indent=1))
    heatmap(table, out / "sensitivity.png")
    for b in budgets:
        r = recipe(table, solve(table, b), b)
        path = out / f"{b:g}b.yaml"
        path.write_text(yaml.safe_dump(r, sort_keys=False))
        log.info("recipe %s: %.3f bits/Linear weight, predicted KL sum %.3g, %s", path,
                 r["predicted"]["bits_per_linear_weight"], r["predicted"]["kl_sum"], r["predicted"]["layers_by_candidate"])
    return table


if __name__ == "__main__":
    raise SystemExit(main())
