"""Which Linear layers a scheme quantizes, and swapping them in place."""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from quantlab.errors import UserError
from quantlab.schemes.configs import GROUP_SIZES


def select(model: nn.Module, skip: list[str]) -> list[tuple[str, nn.Linear]]:
    """All ``nn.Linear`` modules whose qualified name matches no ``skip`` glob
    (a pattern matches the full name or its last component, so ``lm_head`` and
    ``*.o_proj`` both work). Embeddings are not Linear layers and stay as they are."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in skip):
            continue
        out.append((name, mod))
    if not out:
        raise UserError(f"no Linear layer left to quantize after skip={skip}")
    return out


def check_group_size(linears: list[tuple[str, nn.Linear]], group_size: int, scheme: str) -> None:
    """Fail, never skip silently, when a layer's input size is not a multiple of the group."""
    bad = [(n, m.in_features) for n, m in linears if m.in_features % group_size]
    if not bad:
        return
    sizes = sorted({k for _, k in bad})
    ok = [g for g in GROUP_SIZES if all(m.in_features % g == 0 for _, m in linears)]
    raise UserError(
        f"{scheme}: group_size {group_size} does not divide in_features {sizes} of "
        f"{len(bad)} layers (first: {bad[0][0]}); group sizes that fit every layer: "
        f"{', '.join(map(str, ok)) or 'none'}, or add those layers to skip"
    )


def torchao_quantize(model: nn.Module, linears: list[tuple[str, nn.Linear]], dtype: torch.dtype,
                     config) -> None:
    """Move ``model`` to CUDA in ``dtype`` and apply a torchao ``config`` to the
    selected layers only (the CUDA path of the int8/int4/fp8 schemes)."""
    from torchao.quantization import quantize_

    names = {n for n, _ in linears}
    model.to(device="cuda", dtype=dtype)
    quantize_(model, config, filter_fn=lambda m, fqn: fqn in names)


def replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast float *parameters* only; quantized modules keep their buffers as they are."""
    cast_parameters_except(model, dtype, ())


def cast_parameters_except(model: nn.Module, dtype: torch.dtype, keep: type | tuple) -> None:
    """Like :func:`cast_parameters`, leaving parameters of type ``keep`` untouched."""
    for p in model.parameters():
        if p.is_floating_point() and not isinstance(p, keep):
            p.data = p.data.to(dtype)
