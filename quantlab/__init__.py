"""quantlab: what do I lose in accuracy, and gain in latency, memory and cost,
by shipping a causal LM in FP16/BF16/FP8/INT8/INT4? Run ``python -m quantlab``."""

__version__ = "0.1.0"

import logging as _logging

# Import-time noise that says nothing about a run: torchao's CUDA-only extensions
# and Triton missing on a CPU host, torch's pytree deprecation for torchao's enums.
# Their errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
