"""quantlab: what do I lose in accuracy, and gain in latency, memory and cost,
by shipping a causal LM in FP16/BF16/FP8/INT8/INT4? Run ``python -m quantlab``."""

__version__ = "0.1.0"
