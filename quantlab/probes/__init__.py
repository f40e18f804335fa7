"""Probes: what a point measures. Each is a class with ``name``, ``order``,
``enabled(cfg)`` and ``run(ctx) -> ProbeResult`` (``base``: the contract),
registered from the ``quantlab.probes`` entry-point group (``runner``);
``standard`` holds quantlab's own, ``configs`` their typed settings (no
torch: read at launch), the other modules their numerics. What each probe's
metrics mean is declared in :mod:`quantlab.metric_names`."""
