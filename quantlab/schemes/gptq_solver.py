"""The GPTQ solver (Frantar et al. 2022, Algorithm 1) for groupwise int4.

Columns are quantized one at a time; each column's rounding error is spread
over the not-yet-quantized columns through the inverse Hessian of the layer
input (H = 2 X^T X / n), which minimizes ||X W^T - X Q^T||^2 rather than
||W - Q||^2 as round-to-nearest does.
"""
from __future__ import annotations

import torch

from quantlab.schemes.qlinear import int4_qparams, int4_quantize


class HessianAccumulator:
    """Running ``2 X^T X / n`` over every row fed to :meth:`add` (fp32 products,
    as the reference implementation; the solver itself runs in fp64)."""

    def __init__(self, k: int):
        self.h = torch.zeros(k, k, dtype=torch.float32)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h.addmm_(x.T, x)
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        return 2.0 * self.h.double() / max(self.n, 1)


def gptq_int4(w: torch.Tensor, h: torch.Tensor, group_size: int, symmetric: bool,
              damp: float = 0.01, act_order: bool = False, block: int = 128):
    """Quantize ``w: [N, K]`` given Hessian ``h: [K, K]``.

    Returns ``q`` (int32 ``[N, K]`` in [0, 15]), ``scale`` and ``zero``
    ``[N, K // group_size]`` in the tinygemm convention, groups in the original
    column order. With ``act_order`` columns are visited by decreasing Hessian
    diagonal and group parameters are fixed up front from the unmodified
    weights ("static groups"), so the groups stay contiguous for the kernel.
    """
    n, k = w.shape
    w = w.detach().double().clone()
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    groups = k // group_size
    static = None
    if act_order:
        static = int4_qparams(w.reshape(n, groups, group_size), symmetric)
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        perm = torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]

    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.zeros(n, k, dtype=torch.float64)
    scale = torch.zeros(n, groups, dtype=torch.float64)
    offset = torch.zeros(n, groups, dtype=torch.float64)
    block = max(block, group_size) // group_size * group_size
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1, err = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0, dtype=torch.float64)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = int(perm[col]) // group_size
            if static is not None:
                s, o = static[0][:, g], static[1][:, g]
            elif col % group_size == 0:  # entering a group: params from its current weights
                s, o = int4_qparams(w1[:, i:i + group_size], symmetric)
            scale[:, g], offset[:, g] = s, o
            qi = int4_quantize(w1[:, i], s, o)
            q[:, col] = qi
            e = (w1[:, i] - (qi * s + o)) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]

    invperm = torch.argsort(perm)
    q = q[:, invperm]
    return q.to(torch.int32), scale.float(), (offset + 8 * scale).float()
