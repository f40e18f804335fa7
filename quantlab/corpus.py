"""Fixed token sequences for probes (same ids for every point of a sweep)."""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from quantlab.errors import UserError

CORPORA = ("auto", "builtin", "wikitext2")
WIKITEXT = ("wikitext-2-raw", "wiki.test.raw")
# a WikiText article's title line (" = Title = "), not a section's (" = = Section = = ")
TITLE = re.compile(r"^ = [^=].* = $", re.M)


def resolve(name: str, data_dir: str | None) -> str:
    """``auto`` is ``wikitext2`` where the data directory holds it, else
    ``builtin`` (so a fresh install without data still measures fidelity);
    other names are returned as they are."""
    if name != "auto":
        return name
    return "wikitext2" if data_dir and Path(data_dir).expanduser().joinpath(*WIKITEXT).is_file() else "builtin"


def text(name: str, data_dir: str | None) -> str:
    """The raw text of corpus ``name`` (``auto``: see :func:`resolve`).

    ``builtin`` ships with quantlab (original prose, ~3.4 kB); ``wikitext2`` is
    the WikiText-2 raw test file under ``<data_dir>/wikitext-2-raw/``.
    """
    name = resolve(name, data_dir)
    if name == "builtin":
        return resources.files("quantlab").joinpath("builtin_text.txt").read_text()
    if name == "wikitext2":
        if not data_dir:
            raise UserError("corpus wikitext2 needs data_dir (or QUANTLAB_DATA_DIR)")
        path = Path(data_dir).expanduser().joinpath(*WIKITEXT)
        if not path.is_file():
            raise UserError(f"corpus wikitext2: expected {path}")
        return path.read_text()
    raise UserError(f"unknown corpus {name!r}; valid: {', '.join(CORPORA)}")


def token_ids(tokenizer, corpus: str, n_tokens: int, data_dir: str | None = None) -> torch.Tensor:
    """First ``n_tokens`` ids of the corpus as a ``[1, n_tokens]`` tensor.

    The text is repeated when it is shorter than ``n_tokens`` so that any length
    can be asked for (latency probes need long prompts, not meaningful ones).
    """
    corpus = resolve(corpus, data_dir)
    base = text(corpus, data_dir)
    if corpus != "builtin":
        base = base[: 16 * n_tokens]  # enough text for n_tokens; skip tokenizing 1 MB
    _, ids = _repeat(tokenizer, base, n_tokens)
    return torch.tensor([ids[:n_tokens]], dtype=torch.long)


def articles(raw: str) -> list[str]:
    """``raw`` cut before each WikiText article title (the whole text where it
    has none), blank pieces left out."""
    starts = sorted({0, *(m.start() for m in TITLE.finditer(raw))})
    return [raw[a:b] for a, b in zip(starts, [*starts[1:], len(raw)]) if raw[a:b].strip()]


def random_windows(tokenizer, raw: str, window: int, n: int, seed: int) -> tuple[torch.Tensor, int]:
    """``([n, window]`` ids, how many windows there were to draw from)``: the
    windows of :func:`windows_in_articles`, without their articles."""
    wins, total, _ = windows_in_articles(tokenizer, raw, window, n, seed)
    return wins, total


def windows_in_articles(tokenizer, raw: str, window: int, n: int, seed: int) -> tuple[torch.Tensor, int, list[int]]:
    """``([n, window]`` ids, how many windows there were to draw from, each
    window's article)``: the non-overlapping ``window``-token windows inside
    each article of ``raw`` (:func:`articles`, each tokenized on its own: no
    window crosses an article's end), ``n`` of them drawn at random without
    replacement (``seed``), in draw order, so that any prefix is itself a
    random sample: the unit a bound resamples and an adaptive look extends.
    The article (its index in ``raw``) is the cluster a bound over "articles
    like these" resamples. Raises :class:`UserError` when the text has fewer
    than ``n``."""
    pieces = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in articles(raw)]
    starts = [(i, s) for i, ids in enumerate(pieces) for s in range(0, len(ids) - window + 1, window)]
    if len(starts) < n:
        raise UserError(f"the text has {len(starts)} windows of {window} tokens inside its articles, fewer than "
                        f"the {n} asked for: ask fewer or shorter windows")
    drawn = [starts[k] for k in np.random.default_rng(seed).permutation(len(starts))[:n]]
    return torch.tensor([pieces[i][s:s + window] for i, s in drawn], dtype=torch.long), len(starts), \
        [i for i, _ in drawn]


def articles_of_consecutive(tokenizer, raw: str, window: int, n: int) -> list[int]:
    """The article (index in :func:`articles`) each of the first ``n``
    consecutive ``window``-token windows of ``raw`` tokenized whole begins in:
    the cluster of a whole-split window. Article boundaries in the whole
    text's tokens are placed by each article's own token count (a boundary
    can fall a token or two off where the whole text's tokens cross it)."""
    counts = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in articles(raw)]
    starts = np.cumsum([0, *counts[:-1]])
    return [int(np.searchsorted(starts, k * window, side="right")) - 1 for k in range(n)]


def paragraph_ids(tokenizer, corpus: str, data_dir: str | None, max_tokens: int, min_tokens: int,
                  n: int) -> list[torch.Tensor]:
    """Up to ``n`` paragraphs of the corpus, in order, as ``[P]`` id tensors at
    their own lengths (clipped to ``max_tokens``; shorter than ``min_tokens``
    or a WikiText ``= Heading =`` line left out): prompts whose lengths follow
    the text's. Raises :class:`UserError` when none qualifies."""
    out = []
    for block in re.split(r"\n\s*\n", text(corpus, data_dir)):
        block = block.strip()
        if not block or (block.startswith("=") and block.endswith("=")):
            continue
        ids = tokenizer(block, add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens:
            out.append(torch.tensor(ids[:max_tokens], dtype=torch.long))
            if len(out) == n:
                break
    if not out:
        raise UserError(f"corpus {resolve(corpus, data_dir)!r} has no paragraph of >= {min_tokens} tokens")
    return out


def prompt_text(tokenizer, n_tokens: int) -> str:
    """Built-in text repeated until it tokenizes to at least ``n_tokens`` tokens."""
    return _repeat(tokenizer, text("builtin", None), n_tokens)[0]


def _repeat(tokenizer, base: str, n_tokens: int) -> tuple[str, list[int]]:
    """``base`` joined to itself until it tokenizes to at least ``n_tokens``."""
    body = base
    ids = tokenizer(body, add_special_tokens=False)["input_ids"]
    while len(ids) < n_tokens:
        body += "\n\n" + base
        ids = tokenizer(body, add_special_tokens=False)["input_ids"]
    return body, ids
