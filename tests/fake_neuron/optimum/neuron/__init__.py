"""Stand-in for optimum-neuron's NeuronModelForCausalLM (current API), for tests.

Contract mimicked: ``from_pretrained(path, export=True, batch_size=,
sequence_length=, tensor_parallel_size=, torch_dtype=, quantization=)`` compiles
(here: loads, casts and, for int8, rounds weights per output channel as the SDK
stores them); ``save_pretrained``; ``from_pretrained(compiled_dir)``; ``reset()``;
``model(input_ids=, position_ids=)`` -> output whose ``logits`` are the last
position's only, with the KV cache kept inside the model and fixed compiled
shapes (batch size, sequence length) enforced.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

_REQUIRED = ("batch_size", "sequence_length", "tensor_parallel_size", "torch_dtype")


class NeuronModelForCausalLM:
    def __init__(self, model, neuron_config: dict):
        self.model = model.eval()
        self.neuron_config = neuron_config
        self._cache = None

    @classmethod
    def from_pretrained(cls, path: str, export: bool = False, **kwargs):
        if not export:
            cfg = json.loads((Path(path) / "neuron_config.json").read_text())
            return cls(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg["torch_dtype"])), cfg)
        missing = [k for k in _REQUIRED if k not in kwargs]
        if missing:
            raise TypeError(f"export needs {missing}")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, kwargs["torch_dtype"]))
        quant = kwargs.get("quantization") or {}
        if quant.get("quantization_dtype") == "int8":  # per_channel_symmetric, as quantlab's int8
            from quantlab.schemes.qlinear import rtn_int8

            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings():
                        q, scale = rtn_int8(m.weight.float())
                        m.weight.copy_(q.float() * scale[:, None])
        return cls(model, {k: kwargs[k] for k in _REQUIRED} | {"quantization": quant})

    def save_pretrained(self, out: str) -> None:
        self.model.save_pretrained(out)
        (Path(out) / "neuron_config.json").write_text(json.dumps(self.neuron_config))

    def reset(self) -> None:
        self._cache = None

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        b, n = input_ids.shape
        if b > self.neuron_config["batch_size"]:
            raise ValueError(f"compiled for batch {self.neuron_config['batch_size']}, got {b}")
        if int(position_ids.max()) >= self.neuron_config["sequence_length"]:
            raise ValueError(f"position {int(position_ids.max())} beyond sequence_length")
        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache=self._cache, use_cache=True)
        return CausalLMOutputWithPast(logits=out.logits[:, -1:].float())
