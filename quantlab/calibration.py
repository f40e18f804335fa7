"""Calibration batches from the specs in ``calibration/`` (data is not vendored).

A spec names a file under the data directory and how to split it into
documents; :func:`load` joins the documents, tokenizes once, and draws
``n_samples`` random windows of ``seq_len`` tokens with a fixed seed. The
result is cached on disk, so every point of a sweep sees the same batches.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from quantlab.errors import UserError
from quantlab import corpus
from quantlab import resources

log = logging.getLogger("quantlab")
SPEC_DIR = resources.data_dir("calibration")
_DOC = re.compile(r"<doc [^>]*>\n?(.*?)</doc>", re.S)


def specs() -> list[str]:
    return sorted(p.stem for p in SPEC_DIR.glob("*.yaml"))


def _spec(name: str) -> dict:
    path = SPEC_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown calibration set {name!r}; valid: {', '.join(specs())}")
    return yaml.safe_load(path.read_text())


def files(name: str) -> list[str]:
    """The data-directory files calibration set ``name`` reads (none for builtin)."""
    spec = _spec(name)
    return [] if spec["format"] == "builtin" else [spec["file"]]


def missing(name: str, data_dir: str | None) -> str:
    """Why calibration set ``name`` cannot be read here ("" when it can)."""
    spec = _spec(name)
    if spec["format"] == "builtin":
        return ""
    if not data_dir:
        return f"calibration set {name!r} needs data_dir (or QUANTLAB_DATA_DIR) holding {spec['file']}"
    path = Path(data_dir).expanduser() / spec["file"]
    return "" if path.is_file() else f"calibration set {name!r}: expected {path}"


def documents(name: str, data_dir: str | None) -> list[str]:
    spec = _spec(name)
    if spec["format"] == "builtin":
        return [corpus.text("builtin", None)]
    if why := missing(name, data_dir):
        raise UserError(why)
    path = Path(data_dir).expanduser() / spec["file"]
    text = path.read_text(encoding="utf-8")
    if spec["format"] == "wikiextractor":
        return [d.strip() for d in _DOC.findall(text)]
    if spec["format"] == "lines":
        return [line for line in text.splitlines() if line.strip()]
    raise UserError(f"calibration spec {name}: unknown format {spec['format']!r}")


def load(name: str, tokenizer, n_samples: int, seq_len: int, seed: int,
         data_dir: str | None, cache_dir: str) -> torch.Tensor:
    """``[n_samples, seq_len]`` token ids; windows drawn uniformly with ``seed``."""
    key = json.dumps([name, n_samples, seq_len, seed, tokenizer.name_or_path,
                      len(tokenizer), str(data_dir)], sort_keys=True)
    path = Path(cache_dir).expanduser() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"
    if path.is_file():
        return load_file(path)["ids"]
    spec = _spec(name)
    ids = tokenizer(spec["join"].join(documents(name, data_dir)), add_special_tokens=False)["input_ids"]
    while len(ids) <= seq_len:  # tiny corpora (builtin): repeat until one window fits
        ids = ids + ids
    ids = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len, (n_samples,), generator=gen)
    batch = torch.stack([ids[s: s + seq_len] for s in starts.tolist()])
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"ids": batch}, path)
    return batch


def batch_or_builtin(name: str, who: str, ctx, n_samples: int, seq_len: int) -> tuple[torch.Tensor, dict[str, str]]:
    """Calibration ids for ``who`` (a scheme name) from set ``name``, or from
    the built-in text when that set cannot be read here (a newcomer without the
    data directory still gets the point, tagged and warned). Returns the ids
    and the tags that say which set was used (``calibration``,
    ``calibration.fallback``)."""
    source, tags = name, {"calibration": name}
    if why := missing(name, ctx.data_dir):
        log.warning("%s: %s; calibrating on the built-in text instead (weaker: a few KB of prose)", who, why)
        source, tags = "builtin", {"calibration": "builtin", "calibration.fallback": why}
    return load(source, ctx.tokenizer, n_samples, seq_len, ctx.seed, ctx.data_dir, ctx.cache_dir), tags
