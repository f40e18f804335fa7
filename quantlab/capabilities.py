"""Scheme x target -> real / emulated / unsupported (reason), from the same
``supports()`` the sweep asks before running a point.

    python -m quantlab.capabilities                    # every preset x every target, this machine
    python -m quantlab.capabilities --assume-cuda 9.0  # plus a column for a GPU of that capability
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from quantlab import point, targets
from quantlab.cli import CONF_DIR, presets
from quantlab.compose import register_configs


def _objects(group: str) -> dict[str, object]:
    """Every preset of ``group`` as its typed config. A scheme preset is
    composed alone (it reads nothing outside itself: half the time of a whole
    run config, which a target needs for ``${cache_dir}``)."""
    register_configs()
    out = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for name in presets(group):
            if group == "target":
                out[name] = OmegaConf.to_object(compose("config", overrides=[f"target={name}", "model=tiny"])).target
            else:
                node = compose(f"{group}/{name}")
                out[name] = OmegaConf.to_object(OmegaConf.select(node, group.replace("/", ".")))
    return out


def matrix() -> dict[tuple[str, str, str], tuple[str, str]]:
    """``{(group, preset, target): (status, reason)}`` for the installed environment."""
    weights, kvs, tgts = _objects("scheme/weights"), _objects("scheme/kv"), _objects("target")
    none_kv, bf16 = kvs["none"], weights["bf16"]
    out = {}
    for tname, tcfg in tgts.items():
        target = targets.get(tcfg)
        with target.session():  # releases a worker the questions started
            for name, w in weights.items():
                s = target.supports(w, none_kv)
                out[("weights", name, tname)] = (s.status, s.reason)
            for name, kv in kvs.items():
                s = target.supports(bf16, kv)
                out[("kv", name, tname)] = (s.status, s.reason)
    return out


def assumed_cuda(capability: tuple[int, int]) -> dict[tuple[str, str, str], tuple[str, str]]:
    """What each preset would be on a CUDA GPU of ``capability`` (no GPU needed)."""
    from quantlab.hardware import Hardware
    from quantlab.schemes.registry import kv_handler, weights_handler

    hw = Hardware(device="cuda", name=f"assumed sm_{capability[0]}{capability[1]}", cuda_capability=capability)
    col = f"cuda sm_{capability[0]}{capability[1]} (assumed)"
    out = {}
    for name, w in _objects("scheme/weights").items():
        s = weights_handler(w).support(w, hw)
        out[("weights", name, col)] = (s.status, s.reason)
    for name, kv in _objects("scheme/kv").items():
        s = kv_handler(kv).support(kv, hw)
        out[("kv", name, col)] = (s.status, s.reason)
    return out


ENV_PREFIXES = ("QUANTLAB_", "ATEN_", "ONEDNN_", "CUDA_", "NEURON_")
ENV_IGNORED = (point.PARENT_ENV, point.EVAL_SEED_ENV)  # a sweep's own: every sweep sets them anew


def _tree_digest(h, root: Path, pattern: str) -> None:
    for path in sorted(root.rglob(pattern)):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())


def environment_key() -> str:
    """sha256 (24 hex) of everything :func:`matrix` reads: quantlab's sources
    and presets, every installed distribution's version, the sources of the
    packages behind quantlab's entry points (plugins edited in place
    included), this host's CPU/GPU fingerprint, ``PATH`` and the environment
    variables that pick runtimes (``QUANTLAB_*``, ``ATEN_*``, ``ONEDNN_*``,
    ``CUDA_*``, ``NEURON_*``). Two sweeps with one key get one matrix."""
    from quantlab import provenance

    h = hashlib.sha256(provenance.code_version().encode())
    _tree_digest(h, CONF_DIR, "*.yaml")
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    h.update("\n".join(dists).encode())
    eps = sorted({ep.value.split(":")[0].split(".")[0] for d in importlib.metadata.distributions()
                  for ep in d.entry_points if ep.group.startswith("quantlab")} - {"quantlab"})
    for top in eps:
        spec = importlib.util.find_spec(top)
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue
        origin = Path(spec.origin)
        if spec.submodule_search_locations:
            _tree_digest(h, origin.parent, "*.py")
        else:
            h.update(origin.read_bytes())
    h.update(provenance.host().encode())
    env = sorted((k, v) for k, v in os.environ.items()
                 if k == "PATH" or (k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED))
    h.update(repr(env).encode())
    return h.hexdigest()[:24]


def render(m: dict[tuple[str, str, str], tuple[str, str]]) -> str:
    tnames = sorted({t for _, _, t in m})
    rows = sorted({(g, n) for g, n, _ in m})
    lines = ["| scheme | " + " | ".join(tnames) + " |", "|---|" + "---|" * len(tnames)]
    notes = []
    for g, n in rows:
        cells = []
        for t in tnames:
            status, reason = m[(g, n, t)]
            cells.append(status)
            if reason:
                notes.append(f"- {g} {n} @ {t}: {status}: {reason}")
        lines.append(f"| {g}={n} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", *notes]) + "\n"


def _capability(text: str) -> tuple[int, int]:
    """``9.0`` -> ``(9, 0)``; anything else is argparse's one-line error (exit 2)."""
    import argparse

    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: a CUDA compute capability MAJOR.MINOR, e.g. 9.0")
    return int(major), int(minor)


def main(argv: list[str] | None = None, prog: str = "python -m quantlab.capabilities") -> int:
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description="Which scheme runs on which target, on this machine.")
    ap.add_argument("--assume-cuda", type=_capability, metavar="MAJOR.MINOR",
                    help="add a column for a CUDA GPU of this capability, e.g. 9.0")
    args = ap.parse_args(argv)
    m = matrix()
    if args.assume_cuda:
        m.update(assumed_cuda(args.assume_cuda))
    print(render(m))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
