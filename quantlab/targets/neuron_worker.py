"""Runs inside the Neuron Python environment; speaks JSON lines on stdin/stdout.

Requests (one JSON object a line; each reply is ``{"ok": true, ...}`` or
``{"ok": false, "error": "one line"}``):

* ``hello``: interpreter, optimum-neuron version and API generation, NeuronCores.
* ``export {model, out, kwargs}``: ``NeuronModelForCausalLM.from_pretrained(model,
  export=True, **kwargs)`` saved to ``out``; an ``out`` already holding an export
  with the same kwargs is reused (``cached: true``, compile_s 0): the caller names
  ``out`` after the checkpoint's content.
* ``load {model}``: load a compiled model into this worker (kept for the calls below).
* ``logits {ids, out}``: next-token logits of every position of every row of
  ``ids`` (``[B][T]`` token ids), saved with ``torch.save`` as float32 ``[B, T, V]``
  to ``out``. Position ``t`` comes from a fresh prefill of ``ids[:t+1]``: slow
  (T prefills a row) but valid for any compiled decoder, whose graphs return
  last-position logits only.
* ``generate {ids, new_tokens}``: greedy decode, timed here, next to the device:
  ``prefill_ms`` (prompt forward + first token) and one ``step_ms`` per further token.
* ``shutdown``.

Only the standard library is imported at start (``quantlab.decode`` and the
``quantlab.targets`` package are standard-library only), so ``hello`` works
(and says what is missing) in any Python.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_STATE: dict = {}
MARKER = "quantlab-export.json"


def _api() -> tuple[str, str]:
    """(installed optimum-neuron version, API generation: ``current`` >= 0.3 or ``legacy``)."""
    from importlib.metadata import version

    v = version("optimum-neuron")
    major, minor = (int(x) for x in v.split(".")[:2])
    return v, "current" if (major, minor) >= (0, 3) else "legacy"


def _hello(_req: dict) -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import optimum.neuron  # noqa: F401

        info["optimum_neuron"], info["api"] = _api()
    except ImportError as e:
        return {"ok": True, **info, "neuron_cores": 0, "missing": f"optimum-neuron not importable: {e}"}
    try:
        import subprocess

        import torch_neuronx  # noqa: F401

        out = subprocess.run(["neuron-ls", "--json-output"], capture_output=True, text=True, timeout=30)
        devices = json.loads(out.stdout or "[]")
        info["neuron_cores"] = sum(d.get("nc_count", 0) for d in devices)
    except (ImportError, OSError, ValueError) as e:
        info["neuron_cores"] = 0
        info["missing"] = f"Neuron runtime unavailable: {e}"
    return {"ok": True, **info}


def _export(req: dict) -> dict:
    out = Path(req["out"])
    stamp = {"kwargs": req["kwargs"]}  # ``out`` is named by the checkpoint's content
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return {"ok": True, "compile_s": 0.0, "cached": True, "out": str(out), "bytes": _bytes(out)}
    from optimum.neuron import NeuronModelForCausalLM

    t = time.perf_counter()
    model = NeuronModelForCausalLM.from_pretrained(req["model"], **req["kwargs"])
    model.save_pretrained(str(out))
    marker.write_text(json.dumps(stamp))
    return {"ok": True, "compile_s": time.perf_counter() - t, "cached": False, "out": str(out),
            "bytes": _bytes(out)}


def _bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and f.name != MARKER)


def _load(req: dict) -> dict:
    from optimum.neuron import NeuronModelForCausalLM

    t = time.perf_counter()
    _STATE["model"] = NeuronModelForCausalLM.from_pretrained(req["model"])
    _STATE["api"] = _api()[1]
    return {"ok": True, "load_s": time.perf_counter() - t}


def _forward(ids, start: int):
    """Last-position logits ``[B, 1, V]`` of ``ids: [B, n]`` placed at ``start``;
    ``start == 0`` starts new sequences (cache reset)."""
    import torch

    model, api = _STATE["model"], _STATE["api"]
    n = ids.shape[1]
    if api == "legacy":
        if start == 0:
            model.reset_generation()
        out = model(ids, cache_ids=torch.arange(start, start + n, dtype=torch.int32), start_ids=None)
    else:
        if start == 0:
            model.reset()
        pos = torch.arange(start, start + n).expand(ids.shape[0], n)
        out = model(input_ids=ids, position_ids=pos)
    logits = out.logits if hasattr(out, "logits") else out
    if logits is None:
        raise RuntimeError("the compiled model samples on device (on_device_sampling): no logits to return")
    return logits.reshape(ids.shape[0], -1, logits.shape[-1])[:, -1:].float()


def _logits(req: dict) -> dict:
    import torch

    ids = torch.tensor(req["ids"], dtype=torch.long)
    rows = [torch.stack([_forward(row[None, : t + 1], 0)[0, 0] for t in range(ids.shape[1])]) for row in ids]
    torch.save(torch.stack(rows), req["out"])
    return {"ok": True, "shape": [ids.shape[0], ids.shape[1], rows[0].shape[-1]]}


def _generate(req: dict) -> dict:
    import torch

    from quantlab.decode import Clock, decode_loop

    out = decode_loop(_forward, torch.tensor(req["ids"], dtype=torch.long), req["new_tokens"], Clock())
    return {"ok": True, "prefill_ms": out.prefill_ms, "step_ms": out.step_ms}


OPS = {"hello": _hello, "export": _export, "load": _load, "logits": _logits, "generate": _generate}


def main() -> None:
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if req.get("op") == "shutdown":
                print(json.dumps({"ok": True}), flush=True)
                return
            op = OPS.get(req.get("op"))
            reply = op(req) if op else {"ok": False, "error": f"unknown op {req.get('op')!r}; valid: {', '.join(OPS)}"}
        except Exception as e:  # noqa: BLE001 - every failure goes back as one line
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
