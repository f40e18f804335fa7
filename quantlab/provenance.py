"""What a finished point's numbers depend on beyond its config: the code that
measured them, the data files it read, and (for timings) the host.

Reuse rules (``pipeline.run_point``): a point is reused only when its config,
quantlab's code and the data files all match; when it times anything, the host
fingerprint must match as well (latency measured on another machine, e.g. one
sharing the tracking server, is never ranked beside this machine's).
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from quantlab import hardware, point, tracking
from quantlab.export import formats

PACKAGE = Path(__file__).resolve().parent
WIKITEXT = "wikitext-2-raw/wiki.test.raw"


@functools.cache
def code_version() -> str:
    """sha256 (16 hex) over quantlab's Python sources: any change to a scheme,
    probe, engine or the pipeline gives another version."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def host() -> str:
    """Readable host fingerprint: CPU model, cores, torch threads, the CPU
    kernels' instruction set (ATen's build, whether oneDNN multiplies bf16:
    lowered by ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA``, which change
    timings as another CPU would), GPU and driver."""
    gpu = hardware.cuda(0)
    driver = ""
    if gpu is not None:
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = f" driver {pynvml.nvmlSystemGetDriverVersion()}"
        except Exception:  # noqa: BLE001 - pynvml raises its own error types; the name still identifies the GPU
            driver = ""
    bf16 = "yes" if hardware.cpu_native_matmul(torch.bfloat16) else "no"
    return (f"{hardware.cpu_name()} x{os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"ATen {hardware.cpu_vector_isa()}, oneDNN bf16 {bf16}; "
            f"gpu {gpu.name + driver if gpu else 'none'}")


def host_id(text: str | None = None) -> str:
    """Short hash of :func:`host` (a value MLflow can filter on)."""
    return hashlib.sha256((text or host()).encode()).hexdigest()[:12]


def data_files(cfg) -> list[str]:
    """Paths (relative to the data directory) the point's probes and its
    calibration read, as configured."""
    from quantlab import calibration
    from quantlab.probes.accuracy import LOCAL_FILES

    p = cfg.probe
    files: set[str] = set()
    if (p.fidelity.enabled and p.fidelity.corpus != "builtin") or p.perplexity.enabled or \
            (p.cache.enabled and p.cache.corpus != "builtin"):
        files.add(WIKITEXT)
    if p.accuracy.enabled:
        files.update(f for t in p.accuracy.tasks for f in LOCAL_FILES.get(t, []))
    for scheme in (cfg.scheme.weights, cfg.scheme.kv):
        if name := scheme.calibration_set():
            files.update(calibration.files(name))
    return sorted(files)


@functools.cache
def _sha(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_fingerprint(cfg) -> str:
    """sha256 (16 hex) over the point's data files (a missing one counts as
    missing, so a run without the data directory is never reused for one with it)."""
    h = hashlib.sha256()
    root = Path(cfg.data_dir).expanduser() if cfg.data_dir else None
    for rel in data_files(cfg):
        path = root / rel if root else None
        if path is not None and path.is_file():
            st = path.stat()
            h.update(f"{rel}:{_sha(str(path), st.st_size, st.st_mtime_ns)}".encode())
        else:
            h.update(f"{rel}:missing".encode())
    return h.hexdigest()[:16]


def run_params(cfg, ident, as_dict: dict) -> dict[str, str]:
    """The config as MLflow params, plus ``scheme`` (the point's scheme name, a
    param so that the UI's charts can plot against it); the settings of the
    in-memory ``tiny`` model, and of a named ``shape``, only where that is the model."""
    params = tracking.flatten(as_dict)
    for source in ("tiny", "shape"):
        if cfg.model.source != source:
            params = {k: v for k, v in params.items() if not k.startswith(f"model.{source}.")}
    params[point.SCHEME_TAG] = ident.scheme
    return params


def run_tags(cfg, ident) -> dict[str, str]:
    """The tags every run of a point starts with: its identity, host and versions."""
    gpu, fingerprint = hardware.cuda(0), host()
    return {
        point.SWEEP_TAG: cfg.sweep_name,
        point.SCHEME_TAG: ident.scheme,
        "scheme.weights": ident.weights,
        "scheme.weights.type": type(cfg.scheme.weights).__name__,
        "scheme.kv": ident.kv or "none",
        "target": cfg.target.name,
        "target.variant": ident.target,
        "model": cfg.model.name,
        "model.random_weights": str(cfg.model.source in ("shape", "tiny")).lower(),
        point.HASH_TAG: ident.hash,
        point.HOST_CPU_TAG: hardware.cpu_name(),
        "host.gpu": gpu.name if gpu else "none",
        point.HOST_ID_TAG: host_id(fingerprint),
        point.HOST_FINGERPRINT_TAG: fingerprint,
        "quantlab.code": ident.code,
        "data.sha256": ident.data,
        "git_commit": tracking.git_commit(),
        **formats.exportable_tags(cfg.scheme.weights),
        **tracking.versions(),
    }
