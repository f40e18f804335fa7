"""NF4 / FP4 blockwise 4-bit weights through bitsandbytes (CPU and CUDA backends)."""
from __future__ import annotations


import torch

from quantlab.hardware import Hardware
from quantlab.schemes.configs import BnB4Scheme
from quantlab.schemes import layers
from quantlab.schemes.registry import Applied, ApplyContext, Mapping, Support, register_weights

def support(cfg: BnB4Scheme, hw: Hardware) -> Support:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return Support("unsupported", "bitsandbytes is not installed (pip install bitsandbytes)")
    if hw.device in ("cpu", "cuda"):
        return Support("real")
    return Support("unsupported", f"bitsandbytes on {hw.device}")


def apply(model: torch.nn.Module, cfg: BnB4Scheme, ctx: ApplyContext) -> Applied:
    import bitsandbytes as bnb

    dtype = getattr(torch, cfg.compute_dtype)
    device = "cuda" if ctx.hw.device == "cuda" else "cpu"
    for name, lin in layers.select(model, cfg.skip):
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=dtype, quant_type=cfg.quant_type,
                              quant_storage=torch.uint8)
        q.weight = bnb.nn.Params4bit(lin.weight.detach().float(), requires_grad=False,
                                     quant_type=cfg.quant_type, blocksize=cfg.block_size)
        if lin.bias is not None:
            q.bias = torch.nn.Parameter(lin.bias.detach().to(dtype), requires_grad=False)
        layers.replace(model, name, q.to(device).eval())  # .to() quantizes
    layers.cast_parameters_except(model, dtype, bnb.nn.Params4bit)
    return Applied(backend=f"bitsandbytes-{bnb.__version__}", emulated=False)


def gguf(cfg: BnB4Scheme) -> Mapping:
    nearest = "IQ4_NL (a non-linear 4-bit grid of its own, not NF4's levels)" if cfg.quant_type == "nf4" else "Q4_0"
    return Mapping(reason=f"{cfg.short_name()} has no GGUF type; nearest: {nearest}; for llama.cpp use "
                          "int4-g32-sym (Q4_0) or gptq-g32-sym")


def checkpoint(cfg: BnB4Scheme) -> Mapping:
    return Mapping(reason=f"{cfg.short_name()} checkpoints are not built yet (bitsandbytes' own 4-bit "
                          "serialization through transformers would be the route)")


def compile_blocker(cfg: BnB4Scheme, device: str) -> str:
    if device != "cpu":
        return ""
    return ("bitsandbytes 4-bit under torch.compile on CPU: the compiled graph expects the logical weight shape "
            "(192x288) and gets the packed one (55296x1); run nf4/fp4 eager (target.compile=false)")


register_weights("bnb4", BnB4Scheme, support, apply, compile_blocker, checkpoint=checkpoint, gguf=gguf)
