"""Serving: requests, batching policies, and clients of engine servers.

What a server does with requests that arrive over time, apart from how the
arrivals are made and summarised (that is :mod:`quantlab.probes.load`):
:mod:`~quantlab.serving.requests` (a request and what happened to it),
:mod:`~quantlab.serving.policies` (the policy contract, quantlab's reference
batcher, the policy names), :mod:`~quantlab.serving.transformers_cb`
(transformers' continuous batching) and :mod:`~quantlab.serving.llama_server`
(llama.cpp's server over HTTP). Engines build their scheduler from here;
nothing here imports an engine, a probe or a target.
"""
