"""Per-layer sensitivity, and mixed-precision recipes under a bits budget.

    python -m quantlab.sensitivity --model smollm2-135m --candidates int4-g64,int4-g32,int8 --budgets 5.0,5.5

1. **Sensitivity**: for every quantizable Linear layer and every candidate, the
   mean KL divergence of the model with *only that layer* quantized from the
   unquantized model (both in fp32, see :func:`measure`) over the fidelity text
   (``--proxy fisher``: predicted from the diagonal Fisher, :func:`fisher`), and
   the layer's bits per weight as the candidate stores it (packed weights,
   scales and zero points, measured on the built module). ``bf16`` (the layer
   kept) is always a candidate: KL 0, 16 bits.
2. **Recipe**: one candidate per layer minimising the summed KL under a budget
   (a multiple-choice knapsack: Lagrangian relaxation, then a greedy fill of
   what budget is left) in bits per Linear weight (``--budget-kind bits``) or
   in milliseconds per decoded token spent in the Linear layers
   (``--budget-kind ms``: each candidate module timed on this machine at
   decode shape, one token, in the compute dtype, with its real kernel; see
   :func:`time_layers`). Summed per-layer KL
   is a proxy; the recipe runs as a normal point
   (``scheme/weights=mixed scheme.weights.recipe=...``) so that its real KL,
   perplexity and latency are measured, not predicted.

Writes ``sensitivity.json`` (the table; reused when model, candidates, corpus
and token count match), ``sensitivity.png`` (layer x candidate heat map) and
one ``<budget>b.yaml`` (``<budget>ms.yaml``) recipe per budget into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import copy
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from quantlab.divergence import kl_per_token
from quantlab.errors import UserError

log = logging.getLogger("quantlab")


@dataclass
class Table:
    """``kl[layer][candidate]``, ``bits[layer][candidate]``, ``numel[layer]``
    and, once timed, ``ms[layer][candidate]`` (decode-shape forward, ms);
    ``key`` identifies what was measured."""

    key: dict
    candidates: list[str]
    numel: dict[str, int]
    kl: dict[str, dict[str, float]]
    bits: dict[str, dict[str, float]]
    ms: dict[str, dict[str, float]] = field(default_factory=dict)
    timed_on: str = ""  # the CPU and threads ``ms`` ran on

    @property
    def layers(self) -> list[str]:
        return list(self.numel)

    def average_bits(self, choice: dict[str, str]) -> float:
        total = sum(self.numel.values())
        return sum(self.bits[n][c] * self.numel[n] for n, c in choice.items()) / total

    def predicted_kl(self, choice: dict[str, str]) -> float:
        return sum(self.kl[n][c] for n, c in choice.items())

    def linear_ms(self, choice: dict[str, str]) -> float:
        return sum(self.ms[n][c] for n, c in choice.items())

    def cost(self, kind: str) -> dict[str, dict[str, float]]:
        """Each layer's cost per candidate in budget units: its share of the
        average bits per Linear weight (``bits``), or its ms per token (``ms``);
        a recipe's cost is the sum over layers."""
        if kind == "ms":
            return self.ms
        total = sum(self.numel.values())
        return {n: {c: b * self.numel[n] / total for c, b in row.items()} for n, row in self.bits.items()}


def _module_bytes(module: torch.nn.Module) -> int:
    from quantlab.probes.size import tensor_bytes

    persistent = [b for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    return sum(tensor_bytes(t) for t in (*module.parameters(recurse=False), *persistent))


def _dense(q: torch.nn.Module, lin: torch.nn.Linear) -> torch.nn.Linear:
    """An fp32 ``nn.Linear`` holding the weights ``q`` computes with."""
    dense = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    dense.weight.data = q.dequantize().float().contiguous()
    if lin.bias is not None:
        dense.bias.data = lin.bias.data.float()
    return dense


def _new_table(key: dict, candidates: list[str]) -> Table:
    from quantlab.schemes.mixed import KEEP

    return Table(key=key, candidates=[KEEP, *[c for c in candidates if c != KEEP]], numel={}, kl={}, bits={})


def _add_layer(table: Table, name: str, lin: torch.nn.Linear, dtype: torch.dtype) -> None:
    from quantlab.schemes.mixed import KEEP

    table.numel[name] = lin.weight.numel()
    table.kl[name] = {KEEP: 0.0}
    table.bits[name] = {KEEP: float(torch.finfo(dtype).bits)}  # kept in the compute dtype


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
    from quantlab.schemes.mixed import quantize_linear

    model.float().eval()
    ref = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].double(), -1)
    linears = layers.select(model, skip)
    table = _new_table(key, candidates)
    start = time.perf_counter()
    for i, (name, lin) in enumerate(linears):
        _add_layer(table, name, lin, dtype)
        for cand in table.candidates[1:]:
            q = quantize_linear(lin, cand, dtype)
            layers.replace(model, name, _dense(q, lin))
            logq = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].double(), -1)
            table.kl[name][cand] = float(kl_per_token(ref, logq, logits=False).mean())
            table.bits[name][cand] = 8.0 * _module_bytes(q) / lin.weight.numel()
        layers.replace(model, name, lin)
        if (i + 1) % 10 == 0 or i + 1 == len(linears):
            log.info("sensitivity: %d/%d layers (%.0f s)", i + 1, len(linears), time.perf_counter() - start)
    return table


def fisher(model: torch.nn.Module, ids: torch.Tensor, candidates: list[str], dtype: torch.dtype,
           skip: list[str], key: dict, chunk: int = 32, seed: int = 0) -> Table:
    """The same table with each KL *predicted* from the diagonal Fisher
    information instead of measured: ``0.5 * sum F * (Q(W) - W)^2`` per layer
    and candidate, the second-order term of the KL of a small weight change.
    ``F`` is the per-token Fisher of the model's own predictive distribution:
    labels sampled from the fp32 model (seeded), squared gradients of the
    log-likelihood summed over chunks of ``chunk`` positions and divided by the
    token count (under sampled labels, gradients of different positions are
    uncorrelated in expectation, so the chunk sums estimate it without bias).
    One forward and ``len(ids) / chunk`` backward passes over its graph, then no forward per candidate:
    far cheaper than :func:`measure`, and blind to what the quadratic term
    misses (large changes, interactions)."""
    from quantlab.schemes import layers
    from quantlab.schemes.mixed import quantize_linear

    model.float().eval()
    linears = layers.select(model, skip)
    weights = [lin.weight for _, lin in linears]
    squares = {name: torch.zeros_like(lin.weight, dtype=torch.float32) for name, lin in linears}
    start = time.perf_counter()
    with torch.enable_grad():  # one forward; each chunk's backward reuses its graph
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        probs = torch.softmax(logits.detach().double(), -1)
        labels = torch.multinomial(probs.float(), 1, generator=torch.Generator().manual_seed(seed))[:, 0]
        logp = torch.log_softmax(logits.float(), -1)
        positions = labels.numel()
        for lo in range(0, positions, chunk):
            grads = torch.autograd.grad(logp[lo:lo + chunk].gather(1, labels[lo:lo + chunk, None]).sum(), weights,
                                        retain_graph=lo + chunk < positions)
            for (name, _), g in zip(linears, grads):
                squares[name] += g.float() ** 2
    log.info("sensitivity: Fisher from %d positions in %d backward passes over one forward (%.0f s)", positions,
             -(-positions // chunk), time.perf_counter() - start)
    table = _new_table(key, candidates)
    with torch.no_grad():
        for name, lin in linears:
            _add_layer(table, name, lin, dtype)
            f = squares[name] / positions
            for cand in table.candidates[1:]:
                q = quantize_linear(lin, cand, dtype)
                table.kl[name][cand] = float(0.5 * (f * (q.dequantize().float() - lin.weight.float()) ** 2).sum())
                table.bits[name][cand] = 8.0 * _module_bytes(q) / lin.weight.numel()
    return table


UNITS = {"bits": "bits/weight", "ms": "ms/token in Linear layers"}
PROXIES = {"kl": "fp32, dequantized layer", "fisher": "diagonal Fisher, sampled labels"}  # the table's key


def solve(table: Table, budget: float, kind: str = "bits") -> dict[str, str]:
    """One candidate per layer with summed cost (see :meth:`Table.cost`) <=
    ``budget`` and a small summed KL: the Lagrangian relaxation's recipe,
    filled greedily with the upgrades that save the most KL per unit of cost.
    Not always the least (a multiple-choice knapsack), but never worse than a
    uniform recipe that fits: where one is better (a relaxation gap), it is
    returned."""
    if kind == "ms" and not table.ms:
        raise UserError("a latency budget needs the table's per-layer times (time_layers)")
    cost = table.cost(kind)

    def spent(choice: dict[str, str]) -> float:
        return sum(cost[n][c] for n, c in choice.items())

    floor = spent({n: min(table.candidates, key=lambda c: (cost[n][c], table.kl[n][c])) for n in table.layers})
    if floor > budget + 1e-9:
        raise UserError(f"budget {budget:g} {UNITS[kind]} is below the cheapest recipe ({floor:.3f}): "
                        f"add a smaller candidate or raise the budget")

    def pick(lam: float) -> dict[str, str]:
        return {n: min(table.candidates, key=lambda c: (table.kl[n][c] + lam * cost[n][c], cost[n][c]))
                for n in table.layers}

    budget += 1e-9 * max(1.0, budget)  # sums of float costs: the floor itself must fit
    lo, hi = 0.0, 1.0
    while spent(pick(hi)) > budget:  # ends: for a large enough lambda pick() is the cheapest recipe
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(pick(mid)) > budget else (lo, mid)
    choice = pick(hi)
    while True:  # greedy fill: the upgrade with the most KL saved per unit of cost that still fits
        used = spent(choice)
        best, best_rate = None, 0.0
        for n in table.layers:
            for c in table.candidates:
                extra = cost[n][c] - cost[n][choice[n]]
                saved = table.kl[n][choice[n]] - table.kl[n][c]
                if extra > 0 and saved > 0 and used + extra <= budget and saved / extra > best_rate:
                    best, best_rate = (n, c), saved / extra
        if best is None:
            break
        choice[best[0]] = best[1]
    uniform = [{n: c for n in table.layers} for c in table.candidates]
    fits = [u for u in uniform if spent(u) <= budget]
    return min([choice, *fits], key=lambda r: (table.predicted_kl(r), spent(r)))


def _forward_ms(module: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        module(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        module(x)
        times.append((time.perf_counter_ns() - t) / 1e6)
    return statistics.median(times)


@torch.inference_mode()
def time_layers(model: torch.nn.Module, table: Table, dtype: torch.dtype, repeats: int = 30) -> None:
    """Fill ``table.ms``: each layer's candidates, built as the point builds
    them (real kernels, compute ``dtype``; ``bf16``: the layer kept in that
    dtype), timed on one token (decode shape), median of ``repeats``, the
    candidates of a layer interleaved round by round so drift hits them alike."""
    from quantlab.schemes.mixed import KEEP, quantize_linear

    for i, name in enumerate(table.layers):
        lin = model.get_submodule(name)
        mods = {c: copy.deepcopy(lin).to(dtype) if c == KEEP else quantize_linear(lin, c, dtype)
                for c in table.candidates}
        x = torch.randn(1, 1, lin.in_features, dtype=dtype)
        rounds = {c: [] for c in mods}
        for _ in range(3):
            for c, m in mods.items():
                rounds[c].append(_forward_ms(m, x, max(1, repeats // 3)))
        table.ms[name] = {c: statistics.median(v) for c, v in rounds.items()}
        if (i + 1) % 30 == 0 or i + 1 == len(table.layers):
            log.info("timing: %d/%d layers", i + 1, len(table.layers))


def recipe(table: Table, choice: dict[str, str], budget: float, kind: str = "bits") -> dict:
    """The recipe YAML content: the most common candidate as ``default``, the
    rest by layer; named ``<budget>b`` or ``<budget>ms``, ``-fisher`` added
    where the table is the Fisher prediction."""
    counts: dict[str, int] = {}
    for c in choice.values():
        counts[c] = counts.get(c, 0) + 1
    default = max(counts, key=counts.get)
    predicted = {"bits_per_linear_weight": round(table.average_bits(choice), 4),
                 "kl_sum": float(f"{table.predicted_kl(choice):.4g}"), "layers_by_candidate": counts}
    if table.ms:
        predicted["linear_ms_per_token"] = round(table.linear_ms(choice), 4)
        predicted["timed_on"] = table.timed_on
    proxy = "-fisher" if table.key.get("reference") == PROXIES["fisher"] else ""
    return {"name": f"{budget:g}{'b' if kind == 'bits' else 'ms'}{proxy}", "default": default,
            "layers": {n: c for n, c in choice.items() if c != default}, "predicted": predicted,
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


def main(argv: list[str] | None = None, prog: str = "python -m quantlab.sensitivity") -> int:
    import os

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a conf/model preset")
    ap.add_argument("--candidates", default="int4-g64,int4-g32,int8")
    ap.add_argument("--budgets", default="5.0", help="comma-separated budgets, in --budget-kind units")
    ap.add_argument("--budget-kind", default="bits", choices=sorted(UNITS),
                    help="bits: bits per Linear weight; ms: ms per decoded token in the Linear layers (timed here)")
    ap.add_argument("--proxy", default="kl", choices=sorted(PROXIES),
                    help="kl: measured per layer and candidate (one forward each); fisher: predicted from the "
                         "diagonal Fisher (a few backward passes; default --out recipes/<model>/fisher)")
    ap.add_argument("--corpus", default="auto", help="fidelity text: auto (WikiText-2 when present), builtin, ...")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--compute-dtype", default="bfloat16")
    ap.add_argument("--out", help="directory for the table, heat map and recipes (default recipes/<model>)")
    ap.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"))
    ap.add_argument("--cache-dir", default="~/.cache/quantlab")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    try:
        from quantlab.schemes.configs import CANDIDATES, valid_candidate

        candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
        bad = [c for c in candidates if not valid_candidate(c)]
        if bad or not candidates:
            raise UserError(f"candidates {bad or '(none)'}; valid: {CANDIDATES}")
        budgets = [float(b) for b in args.budgets.split(",")]
        if any(b <= 0 for b in budgets) or args.tokens < 2:
            raise UserError("budgets must be > 0 and --tokens >= 2")
        out = Path(args.out or f"recipes/{args.model}{'/fisher' if args.proxy == 'fisher' else ''}")
        table = run(args.model, candidates, args.corpus, args.tokens, args.compute_dtype, out, args.data_dir,
                    args.cache_dir, budgets, args.budget_kind, args.proxy)
    except (UserError, ValueError) as e:
        print(f"quantlab.sensitivity: {e}", file=sys.stderr)
        return 2
    log.info("sensitivity: %d layers x %d candidates in %s", len(table.layers), len(table.candidates), out)
    return 0


def run(model_name: str, candidates: list[str], corpus_name: str, tokens: int, compute_dtype: str, out: Path,
        data_dir: str | None, cache_dir: str, budgets: list[float], kind: str = "bits", proxy: str = "kl") -> Table:
    """Measure (or reuse) the table, time its layers where a latency budget
    needs them (the times are this machine's: kept in the table, with the CPU
    they ran on), draw it, write a recipe per budget."""
    from quantlab import models
    from quantlab import corpus
    from quantlab.schemes.configs import DEFAULT_SKIP

    cfg = _model_config(model_name)
    corpus_used = corpus.resolve(corpus_name, data_dir)
    key = {"model": model_name, "candidates": candidates, "corpus": corpus_used, "tokens": tokens,
           "compute_dtype": compute_dtype, "skip": DEFAULT_SKIP, "reference": PROXIES[proxy]}
    out.mkdir(parents=True, exist_ok=True)
    cached = out / "sensitivity.json"
    table = None
    if cached.is_file():
        data = json.loads(cached.read_text())
        if data.get("key") == key:
            table = Table(**data)
            log.info("sensitivity: reusing %s (same model, candidates, corpus, tokens)", cached)
    model = None
    if table is None:
        model, tok = models.load(cfg, cache_dir)
        ids = corpus.token_ids(tok, corpus_used, tokens, data_dir)
        log.info("sensitivity: %s, %d tokens of %s, candidates %s", model_name, tokens, corpus_used, candidates)
        build = fisher if proxy == "fisher" else measure
        table = build(model, ids, candidates, getattr(torch, compute_dtype), list(DEFAULT_SKIP), key)
        cached.write_text(json.dumps(asdict(table), indent=1))
    if kind == "ms" and not table.ms:
        from quantlab import hardware

        model = model or models.load(cfg, cache_dir)[0]
        log.info("sensitivity: timing %d layers x %d candidates at decode shape", len(table.layers),
                 len(table.candidates))
        time_layers(model.float(), table, getattr(torch, compute_dtype))
        table.timed_on = f"{hardware.cpu().name}, {torch.get_num_threads()} threads"
        cached.write_text(json.dumps(asdict(table), indent=1))
    heatmap(table, out / "sensitivity.png")
    for b in budgets:
        r = recipe(table, solve(table, b, kind), b, kind)
        path = out / f"{r['name'].removesuffix('-fisher')}.yaml"
        path.write_text(yaml.safe_dump(r, sort_keys=False))
        log.info("recipe %s: %.3f bits/Linear weight%s, predicted KL sum %.3g, %s", path,
                 r["predicted"]["bits_per_linear_weight"],
                 f", {r['predicted']['linear_ms_per_token']:.3f} ms/token" if table.ms else "",
                 r["predicted"]["kl_sum"], r["predicted"]["layers_by_candidate"])
    return table


if __name__ == "__main__":
    raise SystemExit(main())
