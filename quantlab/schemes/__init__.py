"""Quantization schemes: one file per family, each a config dataclass plus handler.

Adding a scheme means a config dataclass (``HANDLER`` naming its module), one
module that calls :func:`registry.register_weights` (or ``register_kv``), an
entry point in the ``quantlab.schemes`` group and a preset under
``conf/scheme/`` (docs/guides/schemes.md).
"""
