"""Engines: where a point's model runs (``base.Engine`` is the contract every
probe talks to). ``pytorch.TorchEngine`` runs the in-memory model for the cpu
and cuda targets; ``llamacpp`` and ``vllm`` speak over HTTP to a server that
serves the point's exported file; the neuron target defines its own beside it
(``targets/neuron.py``). Engines have no registry: a target's ``engine()``
returns one."""
