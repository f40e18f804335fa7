"""Retrieval at a distance: the passkey task, through the point's KV cache.

A random key of ``digits`` digits is hidden at a chosen depth of filler text
("The grass is green. The sky is blue. ..."; the task of Mohtashami and Jaggi,
2023, the one KIVI and KVQuant report) and asked for at the end:

    <intro> <filler ...> The pass key is 48213. Remember it. 48213 is the
    pass key. <... filler> What is the pass key? The pass key is

The prompt is built from token lists (each piece tokenized on its own), so it
is exactly ``length`` tokens and the needle starts at the token position
:class:`Trial` records; ``depth`` is the fraction of the filler before it
(0: right after the intro, 1: right before the question). The answer is the
key's tokens as the needle holds them.

Each trial is scored two ways: whether greedy decoding reproduces the key
exactly, and the key's log-likelihood. Through the cache (engines that take
host-side choices, ``cannot("cache")`` empty): the prompt is fed ``chunk``
tokens at a time after a first chunk, then the key one token at a time,
teacher-forced; greedy decoding reproduces the key exactly when every one of
those steps' argmax is the key's next token (given the key so far), so one
pass gives both. The same engine without a cache (one forward of the whole
sequence) is the trial's reference, so each point carries its own paired
comparison. Engines that decode only greedily (llama.cpp and vLLM attend
through their own cache in every forward): one greedy decode for the match,
the key's log-probabilities from the engine's scoring for the likelihood, and
no cache-free reference (compare with the unquantized-cache point).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from quantlab.metric_names import CLUSTERS
from quantlab.errors import UserError
from quantlab.probes.kv_position import tokens_name
from quantlab.uncertainty import mean_stderr, wilson_upper

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about it.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Trial:
    """One prompt: ``ids`` (prompt then answer), the prompt's length, where
    the needle starts, and the key."""

    length: int
    depth: float
    index: int
    key: str
    ids: torch.Tensor  # [length + len(answer)]
    prompt_tokens: int
    needle_at: int

    @property
    def answer(self) -> torch.Tensor:
        return self.ids[self.prompt_tokens:]

    @property
    def id(self) -> str:
        """Stable across points (the pairing key of the report's bound)."""
        return f"L{self.length}-d{self.depth:g}-t{self.index}"


def _tok(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def key_for(seed: int, length: int, depth: float, index: int, digits: int) -> str:
    """The trial's key: seeded by its cell and index, so every point of a
    sweep is asked for the same keys; no leading zero."""
    rng = random.Random(f"{seed}-{length}-{depth:g}-{index}")
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def build(tokenizer, length: int, depth: float, key: str, index: int = 0) -> Trial:
    """The prompt of ``length`` tokens with the needle at ``depth`` of the
    filler (snapped to the nearest start of a filler sentence, or the
    filler's end); the answer is the tokens that follow "is" in the needle
    (the space, then the key). Raises UserError (the probe is then skipped,
    with the reason) when ``length`` cannot hold the intro, needle and
    question."""
    intro, question = _tok(tokenizer, INTRO), _tok(tokenizer, QUESTION)
    needle = _tok(tokenizer, NEEDLE.format(key=key))
    said = NEEDLE.split("{key}")[0]  # " The pass key is "
    stem, full = _tok(tokenizer, said.rstrip()), _tok(tokenizer, said + key)
    answer = full[len(stem):]
    if full[:len(stem)] != stem or full != needle[:len(full)]:
        raise ValueError(f"the tokenizer splits the key differently inside the needle: {key}")
    fill = length - len(intro) - len(needle) - len(question)
    if fill < 0:
        raise UserError(f"passkey length {length}: the intro, needle and question alone take "
                         f"{length - fill} tokens")
    sentence = _tok(tokenizer, FILLER)
    filler = (sentence * (fill // len(sentence) + 1))[:fill]
    at = min([*range(0, fill, len(sentence)), fill], key=lambda b: abs(b - depth * fill))  # a sentence's start
    prompt = intro + filler[:at] + needle + filler[at:] + question
    return Trial(length, depth, index, key, torch.tensor(prompt + answer, dtype=torch.long), len(prompt),
                 len(intro) + at)


def trials(tokenizer, lengths: list[int], depths: list[float], n: int, digits: int, seed: int) -> list[Trial]:
    """Every cell's ``n`` trials, lengths outer, depths inner."""
    return [build(tokenizer, L, d, key_for(seed, L, d, i, digits), i)
            for L in lengths for d in depths for i in range(n)]


def through_cache(engine, trial: Trial, chunk: int) -> tuple[bool, float]:
    """``(greedy reproduces the key, key NLL in nats)`` with the prompt fed
    through the engine's cache ``chunk`` tokens at a time (the first chunk
    prefilled) and the key teacher-forced one token at a time."""
    ids = trial.ids[None].to(engine.device)
    p, total = trial.prompt_tokens, trial.ids.numel()
    # the prefill ends at cuts[0]; step k feeds ids[cuts[k-1]:cuts[k]]; output k predicts token cuts[k]
    cuts = [*range(min(chunk, p), p, chunk), p, *range(p + 1, total)]
    rows: list[torch.Tensor] = []

    def teacher(_logits, i: int) -> torch.Tensor:
        k = min(i + 1, len(cuts) - 1)  # the last choice is never fed
        return ids[:, cuts[k - 1]:cuts[k]]

    def keep(logits) -> None:
        rows.append(torch.as_tensor(logits)[0, -1].double().cpu())

    engine.reset()
    engine.decode(ids[:, :cuts[0]], len(cuts), choose=teacher, record=keep)
    at = cuts.index(p)  # outputs at .. predict the key's tokens p .. total - 1
    logp = torch.log_softmax(torch.stack(rows[at:at + total - p]), dim=-1)
    answer = trial.answer
    return bool((logp.argmax(-1) == answer).all()), float(-logp.gather(-1, answer[:, None]).sum())


def without_cache(engine, trial: Trial) -> tuple[bool, float]:
    """The same two figures from the engine's scoring of the whole sequence
    (one forward; on the PyTorch engines no KV cache is involved)."""
    logp, top1 = engine.token_logprobs(trial.ids[None], first=trial.prompt_tokens - 1)
    return bool(top1.all()), float(-logp.sum())


def greedy(engine, trial: Trial) -> bool:
    """Greedy decoding of the prompt reproduces the key (engines that decode only greedily)."""
    engine.reset()
    out = engine.decode(trial.ids[None, :trial.prompt_tokens].to(engine.device), trial.answer.numel())
    got = torch.cat([torch.as_tensor(c).reshape(-1).cpu() for c in out.chosen])
    return bool(torch.equal(got, trial.answer))


def wilson(hits: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Two-sided Wilson score interval of ``hits`` of ``n``."""
    alpha = (1.0 - level) / 2.0
    p = hits / n
    return 1.0 - wilson_upper(1.0 - p, n, alpha), wilson_upper(p, n, alpha)


def summarize(rows: list[dict], cached: bool) -> tuple[dict[str, float], dict[str, list], str]:
    """Metrics, items and a markdown table of per-trial ``rows`` (keys
    ``id, length, depth, match, nll`` and, with a cache-free reference,
    ``match_ref, nll_ref``).

    ``acc/passkey``: the exact-match rate over every trial (per-trial 0/1
    items with ``doc_ids/passkey``: the report pairs points trial by trial;
    ``clusters/passkey``: each trial's cell, length and depth, whose trials
    share their filler and position: the report's bound counts cells);
    ``passkey/acc_<length>`` with its two-sided 95 % Wilson interval
    (``_lower``, ``_upper``); ``passkey/key_nll``; with the reference,
    ``passkey/acc_nocache`` and ``passkey/dnll`` (cached minus uncached key
    NLL, per trial, mean and se over trials)."""
    n = len(rows)
    match = np.array([r["match"] for r in rows], dtype=float)
    metrics: dict[str, float] = {"passkey/trials": float(n), "acc/passkey": float(match.mean()),
                                 "passkey/key_nll": float(np.mean([r["nll"] for r in rows]))}
    items: dict[str, list] = {"acc/passkey": match.tolist(), "doc_ids/passkey": [r["id"] for r in rows],
                              f"{CLUSTERS}passkey": [f"L{r['length']}-d{r['depth']:g}" for r in rows],
                              "passkey/key_nll": [round(r["nll"], 6) for r in rows]}
    if cached:
        ref = np.array([r["match_ref"] for r in rows], dtype=float)
        dnll = np.array([r["nll"] - r["nll_ref"] for r in rows])
        metrics.update({"passkey/acc_nocache": float(ref.mean()), "passkey/dnll": float(dnll.mean())})
        if n > 1:
            metrics["passkey/dnll_stderr"] = mean_stderr(dnll)
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    for L in lengths:
        hits = [r["match"] for r in rows if r["length"] == L]
        lo, hi = wilson(int(sum(hits)), len(hits))
        key = f"passkey/acc_{tokens_name(L)}"
        metrics.update({key: sum(hits) / len(hits), f"{key}_lower": lo, f"{key}_upper": hi})
    head = ["length \\ depth", *(f"{d:g}" for d in depths), "all (95 % Wilson)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for L in lengths:
        cells = []
        for d in depths:
            hits = [r["match"] for r in rows if r["length"] == L and r["depth"] == d]
            cells.append(f"{int(sum(hits))}/{len(hits)}")
        key = f"passkey/acc_{tokens_name(L)}"
        cells.append(f"{metrics[key]:.2f} [{metrics[key + '_lower']:.2f}, {metrics[key + '_upper']:.2f}]")
        lines.append("| " + " | ".join([str(L), *cells]) + " |")
    return metrics, items, "\n".join(lines)


def probe(engine, trials_: list[Trial], chunk: int, log=None) -> tuple[dict[str, float], dict[str, list], str]:
    """Score every trial on ``engine`` (through its cache where ``cannot("cache")``
    is empty, else by its greedy answer); see :func:`summarize`."""
    cached = not engine.cannot("cache")
    rows = []
    for k, t in enumerate(trials_):
        if cached:
            match, nll = through_cache(engine, t, chunk)
            match_ref, nll_ref = without_cache(engine, t)
            row = {"match_ref": match_ref, "nll_ref": nll_ref}
        else:
            match, nll, row = greedy(engine, t), without_cache(engine, t)[1], {}
        rows.append({"id": t.id, "length": t.length, "depth": t.depth, "match": match, "nll": nll, **row})
        if log is not None and (k + 1) % max(1, len(trials_) // 4) == 0:
            log("passkey: %d of %d trials, %d found", k + 1, len(trials_), sum(r["match"] for r in rows))
    if any(math.isnan(r["nll"]) for r in rows):
        raise ValueError("passkey: a key log-likelihood is NaN")
    return summarize(rows, cached)
