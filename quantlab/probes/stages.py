"""Per-stage latency of a decode step: embedding, each decoder layer, final
norm, LM head + sampling (tokenization is timed per request).

Forward hooks stamp the clock around each stage, so this runs in its own
requests, apart from the latency figures it would otherwise inflate.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from quantlab.decode import greedy


def _stage_modules(model) -> list[tuple[str, torch.nn.Module]]:
    inner = model.model
    mods = [("embedding", inner.embed_tokens)]
    if hasattr(inner, "rotary_emb"):
        mods.append(("rotary", inner.rotary_emb))
    mods += [(f"layer.{i:02d}", layer) for i, layer in enumerate(inner.layers)]
    mods += [("final_norm", inner.norm), ("lm_head", model.lm_head)]
    return mods


def measure(engine, tokenizer, prompt: str, prompt_tokens: int, steps: int,
            requests: int, batch: int = 1) -> tuple[dict[str, list[float]], list[float]]:
    """Per-stage samples (ms) over ``requests x steps`` decode steps of a
    :class:`TorchEngine` at ``batch`` sequences, and the step totals they should
    add up to. ``lm_head`` includes the argmax (stamped by the loop's ``choose``)."""
    clock = engine.clock()
    live: dict[str, list[float]] = defaultdict(list)  # the hooks write here
    start: dict[str, float] = {}
    handles = []
    for name, mod in _stage_modules(engine.model):
        handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: start.__setitem__(n, clock.now_ms())))
        if name != "lm_head":
            handles.append(mod.register_forward_hook(
                lambda m, a, o, n=name: live[n].append(clock.now_ms() - start[n])))

    def choose(logits, i: int):
        nxt = greedy(logits, i)
        live["lm_head"].append(clock.now_ms() - start["lm_head"])
        return nxt

    kept: dict[str, list[float]] = defaultdict(list)
    totals: list[float] = []
    try:
        for _ in range(requests):
            t0 = clock.now_ms()
            ids = tokenizer([prompt] * batch, return_tensors="pt", add_special_tokens=False)["input_ids"]
            ids = ids[:, :prompt_tokens]
            kept["tokenizer"].append(clock.now_ms() - t0)
            live.clear()
            out = engine.decode(ids, steps + 1, clock, choose=choose)
            totals.extend(out.step_ms)
            for k, v in live.items():
                kept[k].extend(v[1:])  # the first sample of each stage is the prefill's
    finally:
        for h in handles:
            h.remove()
    return dict(kept), totals


def table(samples: dict[str, list[float]], totals: list[float]) -> tuple[str, dict[str, float]]:
    """CSV (stage, p50, p99, mean, share of step) and flat metrics for the main stages.
    ``between_stages`` is the part of each step no module accounts for (mask and
    cache bookkeeping, Python between modules), so the rows add up to the step."""
    layers = [k for k in samples if k.startswith("layer.")]
    per_step_layers = np.sum([samples[k] for k in layers], axis=0) if layers else np.zeros(0)
    named = [samples[k] for k in ("embedding", "final_norm", "lm_head", *layers)]
    if "rotary" in samples:
        named.append(samples["rotary"])
    between = np.asarray(totals, dtype=float) - np.sum(named, axis=0)
    rows = [("embedding", samples["embedding"]), ("rotary", samples.get("rotary", [0.0])),
            *((k, samples[k]) for k in sorted(layers)),
            ("decoder_layers_total", list(per_step_layers)), ("final_norm", samples["final_norm"]),
            ("lm_head+sample", samples["lm_head"]), ("between_stages", list(between)), ("step_total", totals),
            ("tokenizer", samples["tokenizer"])]
    mean_total = float(np.mean(totals))
    lines = ["stage,p50_ms,p99_ms,mean_ms,share_of_step"]
    metrics = {}
    for name, xs in rows:
        a = np.asarray(xs, dtype=float)
        share = a.mean() / mean_total if name != "tokenizer" else float("nan")
        lines.append(f"{name},{np.percentile(a, 50):.4f},{np.percentile(a, 99):.4f},{a.mean():.4f},{share:.4f}")
        if not name.startswith("layer."):
            key = name.replace("+", "_")
            metrics[f"stage/{key}_ms_p50"] = float(np.percentile(a, 50))
            metrics[f"stage/{key}_ms_p99"] = float(np.percentile(a, 99))
    return "\n".join(lines) + "\n", metrics
