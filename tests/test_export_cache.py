"""The content-keyed export cache shared by target=llamacpp and target=vllm."""
from __future__ import annotations

import json

import pytest
import torch

from quantlab.errors import UserError
from quantlab.export import cache


def _dir_writer(calls: list):
    def write(tmp):
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "a.bin").write_bytes(b"abc")
        (tmp / "b.json").write_text("{}")
        return "fmt"
    return write


def test_an_entry_is_written_once_then_reused_with_its_info(tmp_path):
    calls = []
    path, reused, info = cache.cached(tmp_path, "k1", "", _dir_writer(calls), "checkpoint")
    assert (reused, info) == (False, "fmt") and sorted(p.name for p in path.iterdir()) == ["a.bin", "b.json"]
    again = cache.cached(tmp_path, "k1", "", _dir_writer(calls), "checkpoint")
    assert again == (path, True, "fmt") and len(calls) == 1
    assert not any(".tmp" in p.name for p in tmp_path.iterdir())  # no temporary left


def test_writers_racing_for_one_key_export_it_once(tmp_path):
    """Points on nodes sharing the cache directory miss together: one writes,
    the others wait on its lock and reuse the entry (never a half-written
    directory, never a rename onto another writer's entry)."""
    import threading
    import time

    calls, results = [], []

    def slow(tmp):
        time.sleep(0.3)
        return _dir_writer(calls)(tmp)

    threads = [threading.Thread(target=lambda: results.append(cache.cached(tmp_path, "k", "", slow, "checkpoint")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3
    assert sorted(r[1] for r in results) == [False, True, True] and len({r[0] for r in results}) == 1


def test_a_changed_file_is_refused_in_one_line(tmp_path):
    path, _, _ = cache.cached(tmp_path, "k", ".gguf", lambda tmp: tmp.write_bytes(b"x" * 100) and 1, "GGUF")
    path.write_bytes(b"y" * 100)
    with pytest.raises(UserError, match=r"GGUF cache entry .*k\.gguf is corrupt \(sha256 differs from k\.json\)"):
        cache.cached(tmp_path, "k", ".gguf", lambda tmp: pytest.fail("must not rewrite"), "GGUF")


def test_an_entry_without_its_stamp_is_rewritten(tmp_path):
    calls = []
    path, _, _ = cache.cached(tmp_path, "k", "", _dir_writer(calls), "checkpoint")
    (tmp_path / "k.json").unlink()  # a writer killed between the rename and the stamp
    (path / "a.bin").write_bytes(b"half")
    _, reused, _ = cache.cached(tmp_path, "k", "", _dir_writer(calls), "checkpoint")
    assert not reused and len(calls) == 2 and (path / "a.bin").read_bytes() == b"abc"
    assert json.loads((tmp_path / "k.json").read_text())["info"] == "fmt"


def test_a_writer_that_fails_leaves_no_entry(tmp_path):
    def broken(tmp):
        tmp.mkdir()
        (tmp / "part").write_bytes(b"1")
        raise UserError("export failed")

    with pytest.raises(UserError, match="export failed"):
        cache.cached(tmp_path, "k", "", broken, "checkpoint")
    assert not (tmp_path / "k").exists() and not (tmp_path / "k.json").exists()


def test_the_key_follows_every_tensor_and_the_extra():
    m = torch.nn.Linear(4, 3)
    k = cache.content_key(m, "v")
    assert cache.content_key(m, "v") == k and cache.content_key(m, "w") != k
    with torch.no_grad():
        m.bias[1] += 1e-6
    assert cache.content_key(m, "v") != k
