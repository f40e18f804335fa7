"""A calibrated point's quantized model, kept when it is measured so that its
export writes the very tensors that were measured instead of calibrating again
(GPTQ, AWQ, SmoothQuant, calibrated activation scales: minutes each).

The whole module is saved (``torch.save``: its layers' own classes, codes,
scales, zero points and folded norms), under ``<cache_dir>/states/`` by the
sha256 of the file; the point's run records that sha256 (tag
:data:`TAG`). :func:`load` reads a file only when its sha256 still equals the
run's, so a stale or altered cache entry is never exported; without one the
export rebuilds the point as before.
"""
from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

from quantlab.digest import private_tmp, sha256_file

log = logging.getLogger("quantlab")
TAG = "quantized_state.sha256"


def _root(cache_dir: str) -> Path:
    return Path(cache_dir).expanduser() / "states"


def keep(model: torch.nn.Module, cache_dir: str) -> dict[str, str]:
    """Save ``model`` into the cache; the run's tags that name it (``{}``
    when the model cannot be pickled, e.g. a layer holding a closure: its
    export rebuilds the point)."""
    root = _root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = private_tmp(root / "state.pt")
    try:
        torch.save(model, tmp)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        tmp.unlink(missing_ok=True)
        log.warning("quantized state not kept (%s): an export of this point calibrates again", e)
        return {}
    digest = sha256_file(tmp)
    tmp.replace(root / f"{digest}.pt")
    return {TAG: digest}


def load(cache_dir: str, digest: str) -> tuple[torch.nn.Module | None, str]:
    """``(model, "")`` from the cache when the file for ``digest`` is there
    and still hashes to it, else ``(None, why not)``."""
    path = _root(cache_dir) / f"{digest}.pt"
    if not path.is_file():
        return None, f"{path} is no longer in the cache"
    if sha256_file(path) != digest:
        return None, f"{path} no longer hashes to the run's {digest[:12]}..."
    # quantlab's own cache file, checked against the sha256 the run recorded when it was written; without
    # autograd: a layer may hold a plain tensor that requires grad, which unpickling fills in place
    with torch.no_grad():
        return torch.load(path, weights_only=False).eval(), ""
