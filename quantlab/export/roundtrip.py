"""Round trips: an export is kept only when the written file reproduces the point.

One tolerance rule per format (:data:`TOLERANCE`), one KL
(:func:`quantlab.divergence.kl_per_token`):

* ``checkpoint``: a fresh interpreter reloads the directory with transformers
  (safetensors only, no remote code) and its logits on the check tokens are
  compared with a dense twin holding the point's own dequantized weights in
  the checkpoint's dtype (same arithmetic as the reload). Against the
  packed-kernel point itself the kernels alone differ by ~1.7e-3 on SmolLM2's
  int8, about as much as int8 quantization costs, so that could not tell a
  reload that lost its quantization. The reload must also stay as far from
  the float model as the point is (``QUANTIZED_SHARE``), once the point is
  measurably away from float (``FLOAT_NOISE``: a faithful reload of the tiny
  test model differs from its dense twin by ~2e-7, bf16 run to run).
* ``gguf``: llama.cpp's logits from the file against the in-memory point; the
  file's tensor types are checked apart (a file whose weights lost their
  quantization fails there, whatever the KL).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from quantlab import corpus
from quantlab.divergence import kl_per_token
from quantlab.errors import UserError


@dataclass(frozen=True)
class Tolerance:
    """A format's rule: mean KL over the check tokens at most ``kl_mean``, the
    reload compared ``against`` what; ``why`` the figure."""

    kl_mean: float
    against: str
    why: str


TOLERANCE = {
    "checkpoint": Tolerance(1e-4, "a dense twin of the point (its dequantized weights, the checkpoint's dtype)",
                            "same arithmetic as the reload: only summation order differs"),
    # Measured on SmolLM2 (128 tokens of the built-in text): bf16 9.1e-4,
    # int8/Q8_0 3.2e-3, int4-g64/Q4_1 3.8e-3, int4-g32-sym/Q4_0 4.5e-3; the gate
    # sits 2x above the largest floor.
    "gguf": Tolerance(1e-2, "the in-memory point",
                      "llama.cpp's quantized dot products quantize the activations to 8 bits (Q8_0/Q8_K)"),
}
QUANTIZED_SHARE = 0.5
FLOAT_NOISE = 1e-6
CHECK_TOKENS = 64
GREEDY_TOKENS = 16


def check_input(tok) -> torch.Tensor:
    """The check tokens: the first ``CHECK_TOKENS`` of the built-in text."""
    return corpus.token_ids(tok, "builtin", CHECK_TOKENS)


@torch.inference_mode()
def logits_and_greedy(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    greedy = model.generate(ids[:, :16], max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                            do_sample=False)[0, 16:]
    return logits, greedy


def verify_in_fresh_process(dest: Path, reference: Path, trust_remote_code: bool = False) -> dict:
    """Reload ``dest`` in a new interpreter with a plain ``from_pretrained``
    (as its users load it); compare with the saved reference."""
    cmd = [sys.executable, "-m", "quantlab.export.roundtrip", str(dest), str(reference)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"round trip: reloading {dest.name} failed: {tail}")
    return json.loads(lines[-1])


def verify_main(dest: str, reference: str, trust_remote_code: bool) -> int:
    """The fresh process of :func:`verify_in_fresh_process`: one JSON line."""
    from transformers import AutoModelForCausalLM

    ref = load_file(reference)
    model = AutoModelForCausalLM.from_pretrained(dest, use_safetensors=True, trust_remote_code=trust_remote_code).eval()
    logits, greedy = logits_and_greedy(model, ref["ids"])
    kl = kl_per_token(ref["logits"], logits)
    out = {"max_abs_diff": float((logits - ref["logits"]).abs().max()),
           "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
           "top1_agree": float((logits.argmax(-1) == ref["logits"].argmax(-1)).double().mean()),
           "greedy_match": bool(torch.equal(greedy, ref["greedy"]))}
    if "float_logits" in ref:
        out["kl_from_float"] = float(kl_per_token(ref["float_logits"], logits).mean())
    print(json.dumps(out))
    return 0


def round_trip_verdict(check: dict, point_from_float: float, tolerance: float | None = None) -> dict:
    """Pass when the reload equals the dense point (KL <= ``tolerance``) and is
    still as far from the float model as the point (a share of
    ``point_from_float``); ``why`` says which failed."""
    tolerance = TOLERANCE["checkpoint"].kl_mean if tolerance is None else tolerance
    out = {"tolerance_kl_mean": tolerance, "point_kl_from_float": point_from_float}
    if check["kl_mean"] > tolerance:
        return {**out, "passed": False, "why": f"reload vs the point's dequantized weights: KL "
                f"{check['kl_mean']:.3e} > {tolerance:g} (max |diff| {check['max_abs_diff']:.3g})"}
    floor = QUANTIZED_SHARE * point_from_float
    if point_from_float > FLOAT_NOISE and check.get("kl_from_float", 0.0) < floor:
        return {**out, "passed": False, "why": f"the reload is the float model, not the point: KL from float "
                f"{check.get('kl_from_float', 0.0):.3e} < {floor:.3e} (the point's {point_from_float:.3e})"}
    return {**out, "passed": True, "why": ""}


def gguf_check(path: Path, engine, model: torch.nn.Module, ids: torch.Tensor, want_type: str) -> dict:
    """llama.cpp's logits of ``ids`` from ``engine`` (a llama.cpp engine built by
    the caller on ``path``) against the in-memory ``model``; passes when the
    mean KL is within ``TOLERANCE["gguf"]`` and the file holds ``want_type``."""
    import gguf

    from quantlab.engines.pytorch import TorchEngine

    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1}
    ref = TorchEngine(model).logits(ids)[0]
    got = engine.logits(ids)[0]
    kl = kl_per_token(ref, got)
    tol = TOLERANCE["gguf"].kl_mean
    out = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "tolerance_kl_mean": tol,
           "top1_agree": float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
           "tensor_types": sorted(types), "expected_type": want_type}
    out["passed"] = out["kl_mean"] <= tol and want_type in types
    return out


if __name__ == "__main__":  # the round trip's fresh process: DEST REFERENCE [--trust-remote-code]
    raise SystemExit(verify_main(sys.argv[1], sys.argv[2], "--trust-remote-code" in sys.argv[3:]))
