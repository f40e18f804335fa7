"""The GPTQ solver (Frantar et al. 2022, Algorithm 1) for any grid with per-group
parameters: groupwise int4 (:func:`gptq_int4`) and the 4-bit float formats.

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


def gptq(w: torch.Tensor, h: torch.Tensor, group_size: int, fit, rnd, damp: float = 0.01,
         act_order: bool = False, block: int = 128):
    """Quantize ``w: [N, K]`` given Hessian ``h: [K, K]`` onto any grid with
    per-group parameters.

    ``fit(cols [N, group] fp64) -> params`` (a tuple of ``[N]`` tensors) sets a
    group's parameters from its current (error-updated) weights when the
    solver enters it; ``rnd(col [N] fp64, params) -> (codes [N], values [N])``
    rounds one column onto the grid. Returns ``(codes [N, K], params)`` in the
    original column order, ``params`` each stacked to ``[N, K // group_size]``.
    With ``act_order`` columns are visited by decreasing Hessian diagonal and
    group parameters are fixed up front from the unmodified weights ("static
    groups"), so the groups stay contiguous for the kernels.
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
        static = [fit(w[:, g * group_size:(g + 1) * group_size]) for g in range(groups)]
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        perm = torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]

    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    codes = torch.zeros(n, k, dtype=torch.float64)
    params: list = [None] * groups
    block = max(block, group_size) // group_size * group_size
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1, err = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0, dtype=torch.float64)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = int(perm[col]) // group_size
            if static is not None:
                p = static[g]
            elif col % group_size == 0:  # entering a group: params from its current weights
                p = fit(w1[:, i:i + group_size])
            params[g] = p
            qi, value = rnd(w1[:, i], p)
            codes[:, col] = qi
            e = (w1[:, i] - value) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]

    stacked = tuple(torch.stack([p[j] for p in params], dim=1) for j in range(len(params[0])))
    return codes[:, torch.argsort(perm)], stacked


def gptq_int4(w: torch.Tensor, h: torch.Tensor, group_size: int, symmetric: bool,
              damp: float = 0.01, act_order: bool = False, block: int = 128):
    """:func:`gptq` onto groupwise int4. Returns ``q`` (int32 ``[N, K]`` in
    [0, 15]), ``scale`` and ``zero`` ``[N, K // group_size]`` in the tinygemm
    convention."""
    def rnd(col, p):
        q = int4_quantize(col, *p)
        return q, q * p[0] + p[1]

    q, (scale, offset) = gptq(w, h, group_size, lambda cols: int4_qparams(cols, symmetric), rnd, damp, act_order,
                              block)
    return q.to(torch.int32), scale.float(), (offset + 8 * scale).float()
