"""Content digests for files quantlab writes and checks (exports, caches)."""
from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Callable, TypeVar

from filelock import FileLock

T = TypeVar("T")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def private_tmp(path: Path) -> Path:
    """A hidden name beside ``path`` that no other writer of ``path`` uses
    (``.<stem>.<random>.tmp<suffix>``: the suffix kept for tools that read it),
    to write under and rename into place."""
    return path.with_name(f".{path.stem}.{uuid.uuid4().hex[:12]}.tmp{path.suffix}")


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all, for any reader at any time."""
    tmp = private_tmp(path)
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def computed_once(path: Path, load: Callable[[Path], T], compute: Callable[[], T],
                  save: Callable[[T, Path], None]) -> T:
    """The value cached in the file ``path``: ``load(path)`` when it is there;
    else ``compute()``, once for all the processes (and nodes, on a shared
    directory) that miss together: they wait on a lock file beside it
    (``filelock``: flock, which Linux NFS clients honour) and load the
    winner's. ``save(value, tmp)`` writes under a name of its own, renamed
    into place, so no reader ever sees half a file."""
    if path.is_file():
        return load(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_suffix(".lock")):
        if path.is_file():  # another process computed it while this one waited
            return load(path)
        value = compute()
        tmp = private_tmp(path)
        save(value, tmp)
        tmp.replace(path)
    return value
