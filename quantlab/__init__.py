"""quantlab: what do I lose in accuracy, and gain in latency, memory and cost,
by shipping a causal LM in FP16/BF16/FP8/INT8/INT4? Run ``quantlab run``
(or ``python -m quantlab``); from Python: :func:`run`, :func:`results`,
:func:`fastest_within`, :func:`export` (:mod:`quantlab.api`, imported on
first use)."""

__version__ = "0.1.0"

import logging as _logging

# Import-time noise that says nothing about a run: torchao's CUDA-only extensions
# and Triton missing on a CPU host, torch's pytree deprecation for torchao's enums.
# Their errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__all__ = ["run", "results", "fastest_within", "export"]


def __getattr__(name: str):
    """The Python API on first use, so ``import quantlab`` stays light."""
    if name in __all__:
        from quantlab import api

        return getattr(api, name)
    raise AttributeError(f"module 'quantlab' has no attribute {name!r}")
