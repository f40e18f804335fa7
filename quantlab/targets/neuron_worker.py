"""Runs inside the Neuron Python environment; speaks JSON lines on stdin/stdout.

Requests: ``{"op": "hello"}``, ``{"op": "export", "model": DIR, "out": DIR,
"kwargs": {...}}``, ``{"op": "generate", "model": DIR, "prompt": str,
"new_tokens": N}`` (times each token), ``{"op": "shutdown"}``. Each reply is
``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}``. Only the
standard library is imported at start, so ``hello`` works (and says what is
missing) in any Python.
"""
from __future__ import annotations

import json
import sys
import time


def _hello(_req: dict) -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import optimum.neuron as on  # noqa: F401
        from importlib.metadata import version

        info["optimum_neuron"] = version("optimum-neuron")
        major, minor = (int(x) for x in info["optimum_neuron"].split(".")[:2])
        info["api"] = "current" if (major, minor) >= (0, 3) else "legacy"
    except ImportError as e:
        return {"ok": True, **info, "neuron_cores": 0, "missing": f"optimum-neuron not importable: {e}"}
    try:
        import torch_neuronx  # noqa: F401
        import subprocess

        out = subprocess.run(["neuron-ls", "--json-output"], capture_output=True, text=True, timeout=30)
        devices = json.loads(out.stdout or "[]")
        info["neuron_cores"] = sum(d.get("nc_count", 0) for d in devices)
    except (ImportError, OSError, ValueError) as e:
        info["neuron_cores"] = 0
        info["missing"] = f"Neuron runtime unavailable: {e}"
    return {"ok": True, **info}


def _export(req: dict) -> dict:
    from optimum.neuron import NeuronModelForCausalLM

    t = time.perf_counter()
    model = NeuronModelForCausalLM.from_pretrained(req["model"], **req["kwargs"])
    model.save_pretrained(req["out"])
    return {"ok": True, "compile_s": time.perf_counter() - t, "out": req["out"]}


def _generate(req: dict) -> dict:
    from optimum.neuron import NeuronModelForCausalLM
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(req["model"])
    model = NeuronModelForCausalLM.from_pretrained(req["model"])
    ids = tok(req["prompt"], return_tensors="pt")
    t0 = time.perf_counter()
    out = model.generate(**ids, max_new_tokens=req["new_tokens"], min_new_tokens=req["new_tokens"], do_sample=False)
    e2e = time.perf_counter() - t0
    return {"ok": True, "e2e_s": e2e, "tokens": int(out.shape[1] - ids["input_ids"].shape[1])}


OPS = {"hello": _hello, "export": _export, "generate": _generate}


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
