"""Probes: what a point measures. Each is a class with ``name``, ``order``,
``enabled(cfg)`` and ``run(ctx) -> ProbeResult`` (``base``: the contract),
registered from the ``quantlab.probes`` entry-point group (``runner``);
``standard`` holds quantlab's own, the other modules their numerics."""
