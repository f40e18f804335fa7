"""Write a GPTQ or AWQ checkpoint of a model in the layouts GPTQModel /
AutoGPTQ (``gptq``, ``gptq_v2``) and AutoAWQ (``gemm``) save, from
round-to-nearest integers (no calibration: the layout is what is under test),
beside the float original: the artifacts ``scheme/weights=as-is`` measures,
made here without a model hub or those libraries.

    python benchmarks/gptq_artifact.py --out /tmp/smollm2-gptq --kinds gptq-g64,awq-g64

writes ``<out>/float`` (SmolLM2-135M-Instruct's offline weights) and
``<out>/<kind>`` for each kind, then prints the sweep that measures them.
The packing is written from the layout's description (words filled lowest
bits first, rows for GPTQ's ``qweight``, columns for zeros and AWQ, AWQ's
column order 0 2 4 6 1 3 5 7), not from quantlab's reader; vLLM's own
loader reading these folders is the independent check (tests/test_artifacts.py).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

# kind -> (method, bits, group size, symmetric, activation order, checkpoint_format)
KINDS = {
    "gptq-g32": ("gptq", 4, 32, True, False, "gptq"),
    "gptq-g64": ("gptq", 4, 64, True, False, "gptq"),
    "gptq-g32-asym": ("gptq", 4, 32, False, False, "gptq"),
    "gptq-g32-v2": ("gptq", 4, 32, True, False, "gptq_v2"),
    "gptq-g32-act-order": ("gptq", 4, 32, True, True, "gptq"),
    "gptq-w8-g32": ("gptq", 8, 32, True, False, "gptq"),
    "awq-g32": ("awq", 4, 32, False, False, ""),
    "awq-g64": ("awq", 4, 64, False, False, ""),
}
_AWQ_NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble holding output channel j (within 8)


def _pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned ``values`` packed ``32 / bits`` per int32 along ``axis``: value
    ``per * r + i`` in bits ``bits * i ..`` of word ``r``."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(per):
        words |= v[..., i] << np.uint32(bits * i)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def _rtn(w: torch.Tensor, group: torch.Tensor, n_groups: int, bits: int, sym: bool):
    """``(q [K, N], zero [G, N], scale [G, N])`` of ``w`` ``[N, K]`` rounded to
    nearest in the groups ``group`` ``[K]`` assigns (GPTQ's min-max grid:
    symmetric zero at the middle code)."""
    maxq = 2 ** bits - 1
    n, k = w.shape
    lo = torch.full((n, n_groups), float("inf")).scatter_reduce(1, group.expand(n, k), w, "amin")
    hi = torch.full((n, n_groups), float("-inf")).scatter_reduce(1, group.expand(n, k), w, "amax")
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-8).half().float()
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-lo / scale).clamp(0, maxq)
    q = torch.clamp(torch.round(w / scale[:, group]) + zero[:, group], 0, maxq)
    return q.t().int(), zero.t().int(), scale.t()


@torch.no_grad()
def write(model: torch.nn.Module, tokenizer, kind: str, dest: Path, seed: int = 0) -> Path:
    """``model``'s decoder Linears (not the LM head) quantized as ``kind``
    and saved with ``tokenizer`` to ``dest``; an activation-order kind
    assigns each layer's input channels to groups in a seeded random order."""
    from safetensors.torch import save_file

    method, bits, g, sym, act_order, fmt = KINDS[kind]
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, lin in model.named_modules():
        if not isinstance(lin, torch.nn.Linear) or name == "lm_head":
            continue
        w = lin.weight.detach().float()
        n, k = w.shape
        order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        group = torch.empty(k, dtype=torch.long)
        group[order] = torch.arange(k) // g
        q, zero, scale = _rtn(w, group, k // g, bits, sym)
        if method == "gptq":
            stored = (zero - 1) & (2 ** bits - 1) if fmt == "gptq" else zero
            state[f"{name}.qweight"] = torch.from_numpy(_pack(q.numpy(), bits, 0))
            state[f"{name}.qzeros"] = torch.from_numpy(_pack(stored.numpy(), bits, 1))
            state[f"{name}.g_idx"] = group.int()
        else:
            cols = (np.arange(n).reshape(-1, 8)[:, np.argsort(_AWQ_NIBBLE_OF)]).reshape(-1)
            state[f"{name}.qweight"] = torch.from_numpy(_pack(q.numpy()[:, cols], 4, 1))
            state[f"{name}.qzeros"] = torch.from_numpy(_pack(zero.numpy()[:, cols], 4, 1))
        state[f"{name}.scales"] = scale.half().contiguous()
        if lin.bias is not None:
            state[f"{name}.bias"] = lin.bias.detach().half()
    quantized = {k.rsplit(".", 1)[0] for k in state}
    for key, t in model.state_dict().items():
        tied = key == "lm_head.weight" and model.config.tie_word_embeddings
        if key.rsplit(".", 1)[0] not in quantized and not tied:
            state[key] = t.detach().contiguous()
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": g, "sym": sym, "desc_act": act_order,
         "checkpoint_format": fmt, "static_groups": False, "true_sequential": True}
        if method == "gptq" else
        {"quant_method": "awq", "bits": bits, "group_size": g, "zero_point": True, "version": "gemm"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(dest)
    return dest


def main() -> None:
    from quantlab import models
    from quantlab.config import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kinds", default="gptq-g64,awq-g64", help=f"of {', '.join(KINDS)}")
    ap.add_argument("--dtype", default="bfloat16", help="the checkpoints' dtype (what their config says)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tok = models.load(ModelConfig(name="smollm2-135m", source="smollm2"), "~/.cache/quantlab")
    model.to(dtype).save_pretrained(args.out / "float")
    tok.save_pretrained(args.out / "float")
    for kind in args.kinds.split(","):
        write(model, tok, kind, args.out / kind)
        print(f"wrote {args.out / kind}")
    points = ",".join(str(args.out / k) for k in args.kinds.split(","))
    print(f"\nquantlab run -m model=hf 'model.path={points}' scheme/weights=as-is reference.path={args.out / 'float'}")


if __name__ == "__main__":
    main()
