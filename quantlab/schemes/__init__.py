"""Quantization schemes: one file per family, each a config dataclass plus handler.

Adding a scheme means adding one file that calls :func:`registry.register_weights`
(or ``register_kv``) and listing its module in ``registry._MODULES``.
"""
