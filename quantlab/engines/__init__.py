"""Engines: where a point's model runs (``base.Engine`` is the contract every
probe talks to). ``pytorch.TorchEngine`` serves the cpu and cuda targets; other
runtimes define theirs beside their target (``targets/neuron.py``,
``targets/llamacpp.py``)."""
