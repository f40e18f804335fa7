"""Export: a measured point as the artifact that ships.

``python -m quantlab.export`` (:mod:`~quantlab.export_cli`) checks its input
with the standard library, then :mod:`~quantlab.export_run` rebuilds the point
and writes it with :mod:`~quantlab.export.checkpoint` (compressed-tensors or
plain safetensors) or :mod:`~quantlab.export.gguf` (llama.cpp), and keeps it
only when :mod:`~quantlab.export.roundtrip` finds the written file equal to the
point. :mod:`~quantlab.export.formats` is the format table a sweep point's
``exportable.*`` tags come from (no heavy imports).

Export never imports a target: the GGUF round trip is handed an engine built
by its caller.
"""
