"""The content-keyed export cache the llama.cpp and vLLM targets share.

An entry is ``<root>/<key><suffix>`` (a GGUF file or a checkpoint directory)
beside ``<root>/<key>.json``, a stamp holding the sha256 of every file of the
entry and what the writer returned. The key is a sha256 over every tensor the
point holds (:func:`content_key`), so an unchanged point is not re-exported.
An entry whose files no longer match its stamp is refused in one line (never
served silently); an entry without a stamp (a writer that died) is rewritten.
Writes go to a temporary name of their own first and are renamed into place,
so a crash never leaves a half-written entry under the real name; writers of
one key hold a lock file beside it (``filelock``: ``flock``, which Linux NFS
clients honour), so nodes sharing the cache directory export a point once
and the others reuse it.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from filelock import FileLock

from quantlab.digest import private_tmp, sha256_file, write_atomic
from quantlab.errors import UserError


def content_key(model: torch.nn.Module, extra: str = "") -> str:
    """sha256 over every tensor the point holds (and ``extra``), 24 hex digits."""
    h = hashlib.sha256(extra.encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:24]


def _digests(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {p.name: sha256_file(p) for p in files}


def cached(root: str | Path, key: str, suffix: str, write: Callable[[Path], Any],
           what: str) -> tuple[Path, bool, Any]:
    """The entry for ``key``: ``(path, reused, info)``. ``write(tmp)`` creates
    the entry at ``tmp`` (a file when ``suffix`` is non-empty, else a
    directory it makes) and returns what the stamp keeps as ``info`` (JSON).
    ``what``: the entry's kind in messages (``"GGUF"``, ``"checkpoint"``)."""
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    path, stamp = root / f"{key}{suffix}", root / f"{key}.json"
    with FileLock(root / f".{key}.lock"):
        if path.exists() and stamp.is_file():
            kept = json.loads(stamp.read_text())
            if _digests(path) != kept["sha256"]:
                raise UserError(f"{what} cache entry {path} is corrupt (sha256 differs from {stamp.name}); "
                                "delete both to re-export")
            return path, True, kept.get("info")
        tmp = private_tmp(path)
        try:
            info = write(tmp)
            _remove(path)  # a writer that died before its stamp left it
            tmp.replace(path)
        finally:
            _remove(tmp)  # a writer that failed leaves nothing behind
        write_atomic(stamp, json.dumps({"sha256": _digests(path), "info": info}))
    return path, False, info


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
