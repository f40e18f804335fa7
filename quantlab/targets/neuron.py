"""AWS Inferentia2 / Trainium through optimum-neuron, in its own Python.

optimum-neuron pins an older torch/transformers and needs the Neuron SDK
(neuronx-cc, torch-neuronx), which is not on PyPI. So quantlab never imports
it: it drives ``quantlab.targets.neuron_worker`` under the interpreter named by
``target.python`` (e.g. the AWS Neuron virtualenv on an inf2 host), one JSON
request per line on stdin, one JSON reply per line on stdout.
"""
from __future__ import annotations

import contextlib
import json
import select
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import torch

from quantlab.targets.configs import NeuronTargetConfig
from quantlab.decode import Decoded, greedy
from quantlab.engines.base import Engine
from quantlab.errors import UserError
from quantlab.hardware import Hardware
from quantlab.schemes.registry import Applied, Support, weights_handler
from quantlab.targets import register
from quantlab.targets.base import Target

WORKER = "quantlab.targets.neuron_worker"


DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def weight_support(weights: Any) -> Support:
    """What the Neuron stack can run for a quantlab weight scheme (its ``neuron`` mapping)."""
    h = weights_handler(weights)
    m = h.mapping("neuron", weights)
    if not m.ok:
        return Support("unsupported", m.reason if "neuron" in h.formats
                       else f"no Neuron equivalent of {type(weights).__name__} ({weights.short_name()})")
    return Support("real", m.spec["note"])


def compile_dtype(weights: Any) -> str:
    """The torch dtype name the Neuron compiler casts a point to (bf16 or fp16)."""
    h = weights_handler(weights)
    m = h.mapping("neuron", weights) if h.mapping("neuron", weights).ok else h.mapping("checkpoint", weights)
    dtype = m.spec["dtype"] if m.ok else None  # a scheme without a Neuron mapping: the dtype it stores
    if dtype not in DTYPES:
        raise UserError(f"neuron: dtype {dtype} not compilable; valid: {', '.join(DTYPES)}")
    return dtype


def export_kwargs(cfg: NeuronTargetConfig, weights: Any, api: str) -> dict[str, Any]:
    """``NeuronModelForCausalLM.from_pretrained(..., export=True, **kwargs)`` for a point.

    ``api``: ``legacy`` (optimum-neuron < 0.3: ``num_cores``, ``auto_cast_type``)
    or ``current`` (>= 0.3: ``tensor_parallel_size``, ``torch_dtype``).
    """
    dtype = compile_dtype(weights)
    kw: dict[str, Any] = {"export": True, "batch_size": cfg.batch_size, "sequence_length": cfg.sequence_length}
    if api == "legacy":
        kw.update(num_cores=cfg.num_cores, auto_cast_type=DTYPES[dtype])
    elif api == "current":
        kw.update(tensor_parallel_size=cfg.num_cores, torch_dtype=dtype)
    else:
        raise ValueError(f"api {api!r}; valid: legacy, current")
    quant = weights_handler(weights).mapping("neuron", weights).spec["quantization"]
    if quant:
        kw["quantization"] = dict(quant)
    return kw


class WorkerClient:
    """One worker process; ``call(op, **args)`` sends a request and waits for its reply."""

    def __init__(self, python: str, timeout_s: float, env: dict[str, str] | None = None):
        exe = shutil.which(python) or (python if Path(python).is_file() else None)
        if exe is None:
            raise UserError(f"neuron: interpreter {python!r} not found; set target.python to the "
                            "Neuron virtualenv's python (e.g. /opt/aws_neuronx_venv_pytorch/bin/python)")
        src = str(Path(__file__).resolve().parent.parent.parent)
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([exe, "-m", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=src,
                                     env={**(env or {}), "PYTHONPATH": src, "PYTHONUNBUFFERED": "1",
                                          **_passthrough()})

    def call(self, op: str, **args) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise UserError(f"neuron worker exited ({self.proc.returncode}): {self._stderr_tail()}")
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:
            self.proc.kill()
            raise UserError(f"neuron worker gave no reply to {op!r} within {self.timeout_s:.0f} s (target.timeout_s)")
        line = self.proc.stdout.readline()
        if not line:
            raise UserError(f"neuron worker died during {op!r}: {self._stderr_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise UserError(f"neuron worker {op!r} failed: {reply.get('error', 'unknown error')}")
        return reply

    def _stderr_tail(self) -> str:
        try:
            _, err = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            return "(no stderr)"
        lines = [line for line in (err or "").strip().splitlines() if line.strip()]
        return lines[-1] if lines else "(no stderr)"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown")
            except UserError:
                pass
            self.proc.wait(timeout=10)


def _passthrough() -> dict[str, str]:
    import os

    keep = ("PATH", "HOME", "NEURON_RT_VISIBLE_CORES", "NEURON_CC_FLAGS", "HF_HOME", "HF_HUB_OFFLINE")
    return {k: os.environ[k] for k in keep if k in os.environ}


class NeuronEngine(Engine):
    """The model compiled in the worker: logits and timed greedy requests come
    from there. It holds no host-side cache, so step-by-step probes that drive
    one (cache probe, stage table) are refused, and host bandwidth and energy
    counters say nothing about a NeuronCore."""

    name = "neuron"

    def __init__(self, client: WorkerClient, config):
        c = config.get_text_config(decoder=True)
        super().__init__(c.vocab_size, getattr(c, "max_position_embeddings", 2048))
        self.client = client

    def cannot(self, probe: str) -> str:
        if probe in ("cache", "stages"):
            return "the model runs in the neuron worker"
        if probe == "energy":
            return "no energy counter read on the neuron device"
        return "host bandwidth is not a NeuronCore's" if probe == "roofline" else super().cannot(probe)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "logits.pt")
            self.client.call("logits", ids=ids.tolist(), out=out)
            return torch.load(out, weights_only=True)

    def decode(self, prompt: torch.Tensor, n_new: int, clock=None, choose=greedy, record=None) -> Decoded:
        """Greedy decoding timed inside the worker, next to the device."""
        if choose is not greedy or record is not None:
            raise UserError("neuron: the worker decodes greedily; a host-side choice or record per step "
                            "cannot cross the worker boundary")
        r = self.client.call("generate", ids=prompt.tolist(), new_tokens=n_new)
        return Decoded(prefill_ms=r["prefill_ms"], step_ms=r["step_ms"])


class NeuronTarget(Target):
    """Export + compile through the worker, then probe the compiled model there.

    The Neuron SDK quantizes weights itself at export (``export_kwargs``), so the
    host keeps the float checkpoint (cast to the compile dtype) and hands it over;
    every probe then talks to the :class:`NeuronEngine`.
    """

    name = "neuron"
    cfg: NeuronTargetConfig

    def __init__(self, cfg: NeuronTargetConfig):
        super().__init__(cfg)
        self._hello: dict[str, Any] | None = None
        self._why = ""
        self._root = Path(cfg.compile_cache).expanduser()
        self._client: WorkerClient | None = None
        self._export_kw: dict[str, Any] = {}

    def client(self) -> WorkerClient:
        """The worker this target drives (started once, closed by ``close``)."""
        if self._client is None:
            self._client = WorkerClient(self.cfg.python, self.cfg.timeout_s,
                                        env={"NEURON_COMPILE_CACHE_URL": str(self._root / "neuronx-cc")})
        return self._client

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The worker lives for one point (started on first use)."""
        try:
            yield
        finally:
            self.close()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def hello(self) -> dict[str, Any] | None:
        """Ask the worker what it sees (optimum-neuron version, NeuronCores); cached."""
        if self._hello is None and not self._why:
            try:
                self._hello = self.client().call("hello")
            except UserError as e:
                self._why = str(e)
                self.close()
        return self._hello

    def hardware(self) -> Hardware | None:
        info = self.hello()
        if not info or not info.get("neuron_cores"):
            self._why = self._why or (info or {}).get("missing") or \
                "no NeuronCore visible to the worker (not an inf2/trn host?)"
            return None
        return Hardware(device="neuron", name=f"{info['neuron_cores']} NeuronCores")

    def missing_reason(self) -> str:
        return self._why

    def supports(self, weights: Any, kv: Any) -> Support:
        if self.hardware() is None:
            return Support("unsupported", self.missing_reason())
        if kv.short_name():  # '' is the unquantized cache
            return Support("unsupported", "quantized KV caches are not exposed by optimum-neuron")
        return weight_support(weights)

    def apply_weights(self, model: torch.nn.Module, weights: Any, ctx) -> Applied:
        """No host-side quantization: cast to the compile dtype and let the SDK
        quantize at export (``export_kwargs``)."""
        self._export_kw = kw = export_kwargs(self.cfg, weights, self.hello().get("api", "current"))
        model.to(getattr(torch, compile_dtype(weights)))
        quant = kw.get("quantization", {}).get("quantization_dtype")
        return Applied(backend=f"optimum-neuron {self.hello().get('optimum_neuron')}"
                               f" ({quant or 'no'} weight quantization)", emulated=False)

    def engine(self, model: torch.nn.Module, kv: Applied, tokenizer=None) -> NeuronEngine:
        """Save the checkpoint, export it (compile cache keyed by checkpoint and
        export arguments: an unchanged point is not recompiled) and load it;
        ``ready_s`` is export + load seconds (0 export seconds on a cache hit)."""
        import hashlib
        import tempfile

        kw = self._export_kw  # set by apply_weights, which the pipeline calls first
        self._root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self._root) as ckpt:
            model.save_pretrained(ckpt)
            digest = hashlib.sha256(json.dumps(kw, sort_keys=True).encode())
            for f in sorted(Path(ckpt).glob("*.safetensors")):
                digest.update(f.read_bytes())
            out = self._root / digest.hexdigest()[:20]
            reply = self.client().call("export", model=ckpt, out=str(out), kwargs=kw)
        loaded = self.client().call("load", model=str(out))
        eng = NeuronEngine(self.client(), model.config)
        eng.ready_s = reply["compile_s"] + loaded["load_s"]
        eng.metrics = {"compile/neuron_export_s": reply["compile_s"], "compile/neuron_load_s": loaded["load_s"],
                       "compile/neuron_cached": float(reply["cached"]),
                       "size/neuron_artifact_mb": reply["bytes"] / 2**20}
        return eng


register(NeuronTargetConfig, NeuronTarget)
