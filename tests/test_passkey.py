"""Retrieval at a distance (quantlab.probes.passkey): the key is where the
trial says and the prompt is as long as asked; scoring is exact (an engine
that knows every next token finds every key, one that misses a digit finds
none, and the bookkeeping of the chunked cached pass puts each prediction on
its token); an exact cache scores what the uncached pass scores; Wilson
intervals; and a sweep point logs it all to MLflow and the report."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantlab import models
from quantlab.config import ModelConfig
from quantlab.decode import decode_loop
from quantlab.engines.base import Engine
from quantlab.engines.pytorch import TorchEngine
from quantlab.errors import UserError
from quantlab.probes import passkey as pk
from quantlab.schemes.kv import Int8KV, NoKV, cache_factory

TOK = models.byte_tokenizer()


def _text(ids) -> str:
    return TOK.decode(list(map(int, ids)))


@settings(max_examples=30, deadline=None)
@given(length=st.integers(300, 1500), depth=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
       digits=st.integers(1, 9), index=st.integers(0, 5), seed=st.integers(0, 99))
def test_the_key_is_where_the_trial_says(length, depth, digits, index, seed):
    key = pk.key_for(seed, length, depth, index, digits)
    t = pk.build(TOK, length, depth, key, index)
    assert len(key) == digits and key[0] != "0"
    assert t.prompt_tokens == length and _text(t.answer) == " " + key  # the prompt is exactly `length` tokens
    needle = pk.NEEDLE.format(key=key)
    assert _text(t.ids[t.needle_at:t.needle_at + len(TOK(needle, add_special_tokens=False)["input_ids"])]) == needle
    prompt = _text(t.ids[:t.prompt_tokens])
    assert prompt.startswith(pk.INTRO) and prompt.endswith(pk.QUESTION) and prompt.count(key) == 2
    filler = length - len(TOK(pk.INTRO + pk.QUESTION + needle)["input_ids"])
    before = t.needle_at - len(TOK(pk.INTRO)["input_ids"])
    sentence = len(TOK(pk.FILLER)["input_ids"])
    assert before % sentence == 0 or before == filler  # at a sentence's start (or the filler's end)
    assert abs(before - depth * filler) <= sentence / 2 + 1


def test_depth_zero_and_one_are_the_ends_and_keys_are_seeded():
    first, last = pk.build(TOK, 600, 0.0, "12345"), pk.build(TOK, 600, 1.0, "12345")
    assert first.needle_at == len(TOK(pk.INTRO)["input_ids"])
    assert _text(last.ids[:last.prompt_tokens]).endswith(pk.NEEDLE.format(key="12345") + pk.QUESTION)
    cells = pk.trials(TOK, [300, 600], [0.0, 1.0], 3, 5, seed=7)
    assert [t.id for t in cells[:4]] == ["L300-d0-t0", "L300-d0-t1", "L300-d0-t2", "L300-d1-t0"]
    assert [t.key for t in cells] == [t.key for t in pk.trials(TOK, [300, 600], [0.0, 1.0], 3, 5, seed=7)]
    assert len({t.key for t in cells}) > 6  # 12 draws of 5 digits: repeats would say the seed is not used
    with pytest.raises(UserError, match="passkey length 100: the intro, needle and question alone take"):
        pk.build(TOK, 100, 0.5, "12345")


class Oracle(Engine):
    """Knows the trial's sequence: the logits at each position put ``margin``
    on the true next token, except at the positions in ``wrong``, where a
    wrong digit wins. Host-side choices allowed when ``cached``."""

    name = "oracle"

    def __init__(self, seq: torch.Tensor, wrong: set[int] = frozenset(), cached: bool = True, margin: float = 8.0):
        super().__init__(TOK.vocab_size + 3, 10_000)
        self.seq, self.wrong, self.cached, self.margin = seq, wrong, cached, margin
        self.fed: list[tuple[int, int]] = []

    def cannot(self, probe: str) -> str:
        return "" if probe in ("cache", "logits") and self.cached else ("greedy only" if probe == "cache" else "")

    def _rows(self, start: int, n: int) -> torch.Tensor:
        out = torch.zeros(1, n, self.vocab_size)
        for j in range(n):
            pos = start + j + 1  # the token this position predicts
            if pos < len(self.seq):
                tok = int(self.seq[pos])
                out[0, j, (tok + 1) % 256 if pos in self.wrong else tok] = self.margin
        return out

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self._rows(0, ids.shape[1])

    def decode(self, prompt, n_new, clock=None, choose=None, record=None):
        from quantlab.decode import Clock, greedy

        def forward(ids, start):
            self.fed.append((start, ids.shape[1]))
            if self.cached:  # teacher-forced: every token fed is the sequence's own, at its place
                assert torch.equal(ids[0], self.seq[start:start + ids.shape[1]]), "fed a token out of place"
            return self._rows(start, ids.shape[1])

        return decode_loop(forward, prompt, n_new, clock or Clock(), choose or greedy, record)


def _nll(margin: float, vocab: int, n: int) -> float:
    return n * -math.log(math.exp(margin) / (math.exp(margin) + vocab - 1))


@pytest.mark.parametrize("chunk", [1, 7, 64, 5000])
def test_scoring_puts_each_prediction_on_its_token(chunk):
    t = pk.build(TOK, 400, 0.5, "90417")
    eng = Oracle(t.ids)
    match, nll = pk.through_cache(eng, t, chunk)
    n = t.answer.numel()
    assert match and nll == pytest.approx(_nll(8.0, eng.vocab_size, n), rel=1e-5)
    # the prompt went in chunk tokens at a time (the first prefilled), the key one token at a time
    assert eng.fed[0] == (0, min(chunk, 400)) and [f[1] for f in eng.fed[-(n - 1):]] == [1] * (n - 1)
    assert sum(f[1] for f in eng.fed) == t.ids.numel() - 1  # every token but the last fed once, in order
    for miss in (400, 400 + n - 1):  # the first or the last digit wrong: not found; the NLL grows
        wrong = pk.through_cache(Oracle(t.ids, {miss}), t, chunk)
        assert not wrong[0] and wrong[1] > nll + 7
    assert pk.without_cache(eng, t) == (True, pytest.approx(nll, rel=1e-5))
    assert not pk.without_cache(Oracle(t.ids, {402}), t)[0]


def test_engines_that_decode_only_greedily_are_scored_by_their_greedy_answer():
    t = pk.build(TOK, 300, 1.0, "555")
    rows = pk.probe(Oracle(t.ids, cached=False), [t], 64)
    assert rows[0]["acc/passkey"] == 1.0 and "passkey/acc_nocache" not in rows[0]
    assert pk.probe(Oracle(t.ids, {301}, cached=False), [t], 64)[0]["acc/passkey"] == 0.0


def test_summary_wilson_intervals_and_items():
    rows = [{"id": f"L{L}-d{d:g}-t0", "length": L, "depth": d, "match": m, "nll": 1.0 + m, "match_ref": True,
             "nll_ref": 1.0} for L, d, m in [(512, 0.0, True), (512, 1.0, False), (1024, 0.0, True),
                                             (1024, 1.0, True)]]
    m, items, table = pk.summarize(rows, cached=True)
    assert m["acc/passkey"] == 0.75 and m["passkey/acc_512"] == 0.5 and m["passkey/acc_1k"] == 1.0
    lo, hi = pk.wilson(1, 2)
    assert (m["passkey/acc_512_lower"], m["passkey/acc_512_upper"]) == (lo, hi)
    # Wilson 95 % for 1 of 2 (z = 1.96): 0.0945 to 0.9055; for 2 of 2: 0.342 to 1
    assert lo == pytest.approx(0.0945, abs=1e-3) and hi == pytest.approx(0.9055, abs=1e-3)
    assert m["passkey/acc_1k_lower"] == pytest.approx(0.342, abs=1e-3) and m["passkey/acc_1k_upper"] == 1.0
    assert m["passkey/acc_nocache"] == 1.0 and m["passkey/dnll"] == pytest.approx(0.75)
    assert items["acc/passkey"] == [1.0, 0.0, 1.0, 1.0] and items["doc_ids/passkey"][1] == "L512-d1-t0"
    assert "| 512 | 1/1 | 0/1 | 0.50 [0.09, 0.91] |" in table


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model(ModelConfig(name="tiny", source="tiny"), torch.float64)


def test_an_exact_cache_scores_what_the_uncached_pass_scores(tiny):
    """In float64 the cached pass equals the uncached one but for the
    reference's float32 scoring (1e-7 nats); an int8 cache adds 1e-4."""
    cells = pk.trials(TOK, [260, 330], [0.0, 0.5, 1.0], 1, 4, seed=0)
    exact, _, _ = pk.probe(TorchEngine(tiny, cache_factory=cache_factory(NoKV())), cells, 32)
    assert abs(exact["passkey/dnll"]) < 1e-5 and exact["acc/passkey"] == exact["passkey/acc_nocache"]
    int8, _, _ = pk.probe(TorchEngine(tiny, cache_factory=cache_factory(Int8KV("dynamic"))), cells, 32)
    assert abs(int8["passkey/dnll"]) > 100 * abs(exact["passkey/dnll"]) and int8["passkey/dnll_stderr"] > 0
    assert int8["passkey/acc_nocache"] == exact["passkey/acc_nocache"]  # same weights, no cache: same answers


def test_the_config_refuses_what_cannot_be_scored():
    from tests.conftest import compose_cfg

    from quantlab.config_check import validate
    from quantlab.probes.configs import PasskeyProbeConfig

    with pytest.raises(ValueError, match=r"depths=\[1.5\]: must be 0..1"):
        validate(PasskeyProbeConfig(depths=[1.5]), "probe.passkey.")
    with pytest.raises(ValueError, match=r"lengths=\[\], probe.passkey.depths=.*at least one of each"):
        validate(PasskeyProbeConfig(lengths=[]), "probe.passkey.")
    with pytest.raises(ValueError, match="probe.passkey would measure nothing"):
        validate(compose_cfg(["model=shape", "probe=latency", "probe.passkey.enabled=true"]))
    with pytest.raises(ValueError, match=r"probe.passkey.lengths \(longest 4096\) \+ digits needs 4101 tokens"):
        validate(compose_cfg(["target=llamacpp", "probe.passkey.enabled=true", "probe.passkey.lengths=[4096]"]))


def test_a_sweep_logs_retrieval_and_the_report_decides_on_it(tmp_path):
    """Through a sweep of two KV schemes: acc/passkey with per-trial items
    (paired by trial in the report), per-length Wilson intervals, the
    per-cell table as an artifact, the report's retrieval section, and
    --metric acc/passkey as a decision metric."""
    import json

    from mlflow import MlflowClient

    from tests.conftest import run_cli

    uri = f"sqlite:///{tmp_path}/m.db"
    out = run_cli(["-m", "model=tiny", "probe=smoke", "scheme/kv=none,int8", "probe.latency.enabled=false",
                   "probe.fidelity.enabled=false", "probe.passkey.enabled=true", "probe.passkey.lengths=[256,384]",
                   "probe.passkey.depths=[0,1]", "probe.passkey.trials=2", "probe.passkey.chunk=32",
                   f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    assert out.returncode == 0, out.stderr[-2000:]
    client = MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])}
    run = runs["bf16+kv8@cpu"]
    m = run.data.metrics
    assert m["passkey/trials"] == 8 and 0 <= m["acc/passkey"] <= 1 and "time/passkey_s" in m
    assert m["passkey/acc_256_lower"] <= m["passkey/acc_256"] <= m["passkey/acc_256_upper"]
    assert "passkey/dnll" in m and "passkey/acc_nocache" in m
    items = json.loads(open(client.download_artifacts(run.info.run_id, "items.json", str(tmp_path))).read())
    assert len(items["acc/passkey"]) == 8 and items["doc_ids/passkey"][0] == "L256-d0-t0"
    table = open(client.download_artifacts(run.info.run_id, "passkey.md", str(tmp_path))).read()
    assert "| 384 |" in table
    section = out.stdout.split("Passkey retrieval", 1)[1].split("\n\n", 2)[1]
    assert "| point | 256 tokens | 384 tokens | without cache | key NLL cached - uncached |" in section
    assert len([ln for ln in section.splitlines() if ln.startswith("| bf16")]) == 2
    # a latency-free, perplexity-free sweep decides on retrieval by default
    assert "acc/passkey" in out.stdout.split("Declared at launch", 1)[1]
    # 4 cells cannot bound any loss (fewer than 8 clusters): shown, and said to decide nothing
    assert "no measured metric can decide a budget (auto passed over acc/passkey" in out.stdout
    # no latency probe: nothing to pick by, and the report says so rather than "no point qualifies"
    assert "Within 1% loss: nothing to rank: no point measured lat/tpot_ms_p50" in out.stdout
