"""Accuracy probes: parity with lm-eval run directly, perplexity vs an independent
computation, local task data, recovery. Uses ../shared/data (QUANTLAB_DATA_DIR)."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from quantlab import models, report, tracking
from quantlab.config import ModelConfig
from quantlab.probes.configs import AccuracyProbeConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.errors import UserError
from quantlab.probes import accuracy, perplexity
from quantlab.records import PointRecord
from tests.conftest import SHARED_DATA, run_cli, tracker

needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="no benchmark data (QUANTLAB_DATA_DIR or ../shared/data)")


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()


@needs_data
@pytest.mark.parametrize("task,n_docs", [
    ("arc_easy_local", 2376), ("arc_challenge_local", 1172), ("hellaswag_local", 10042),
    ("piqa_local", 1838), ("winogrande_local", 1267), ("boolq_local", 3270),
    ("lambada_openai_local", 5153), ("wikitext2_local", 62),
])
def test_local_tasks_prepare_every_record(tmp_path, task, n_docs):
    _, counts = accuracy.prepare_tasks([task], str(SHARED_DATA), str(tmp_path))
    assert counts == {task: n_docs}


@needs_data
def test_lm_eval_parity_with_direct_run(tiny, tmp_path):
    """quantlab's numbers are exactly lm-eval's on the same model and documents."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tok = tiny
    cfg = AccuracyProbeConfig(enabled=True, tasks=["arc_easy_local", "piqa_local"], limit=24, batch_size=4)
    ours, _, items = accuracy.evaluate(TorchEngine(model), tok, cfg, str(SHARED_DATA), str(tmp_path), seed=3)
    include, counts = accuracy.prepare_tasks(cfg.tasks, str(SHARED_DATA), str(tmp_path))
    samples = {t: accuracy.sample_indices(counts[t], 24, 3, t) for t in cfg.tasks}
    # bootstrap_iters > 0 makes lm-eval compute acc_stderr (analytically, for a mean)
    direct = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=1),
                             tasks=cfg.tasks, samples=samples, bootstrap_iters=10,
                             task_manager=TaskManager(include_path=str(include)))
    for t in cfg.tasks:
        for m in ("acc", "acc_norm"):
            assert ours[f"{m}/{t}"] == direct["results"][t][f"{m},none"]
            assert ours[f"{m}_stderr/{t}"] == pytest.approx(direct["results"][t][f"{m}_stderr,none"], rel=1e-9)
            assert sum(items[f"{m}/{t}"]) / 24 == pytest.approx(ours[f"{m}/{t}"])
        assert items[f"doc_ids/{t}"] == sorted(items[f"doc_ids/{t}"]) and len(items[f"doc_ids/{t}"]) == 24
    assert len(samples["arc_easy_local"]) == 24


@needs_data
def test_lambada_items_are_nlls_so_a_worse_model_loses(tiny, tmp_path):
    """lm-eval logs LAMBADA's per-document log-likelihood under ``perplexity``;
    quantlab keeps NLLs, so exp(mean) is lm-eval's perplexity and a model that
    gives the documents less probability shows a positive loss (the sign
    flipped before: a worse model gained)."""
    from quantlab import decision

    model, tok = tiny
    cfg = AccuracyProbeConfig(enabled=True, tasks=["lambada_openai_local"], limit=12, batch_size=4)
    key = "perplexity/lambada_openai_local"
    base_m, _, base_i = accuracy.evaluate(TorchEngine(model), tok, cfg, str(SHARED_DATA), str(tmp_path), seed=0)
    assert min(base_i[key]) > 0 and math.exp(sum(base_i[key]) / 12) == pytest.approx(base_m[key], rel=1e-9)
    assert f"{key}_ln_stderr" in base_m and "perplexity_stderr/lambada_openai_local" not in base_m
    worse = models.tiny_model(ModelConfig(name="tiny", source="tiny"))
    with torch.no_grad():
        worse.lm_head.weight.mul_(0.2).add_(0.05 * torch.randn_like(worse.lm_head.weight))
    m, _, i = accuracy.evaluate(TorchEngine(worse), tok, cfg, str(SHARED_DATA), str(tmp_path), seed=0)
    assert m[key] > base_m[key]  # lm-eval's own perplexity: worse
    lo = decision.loss(key, m, i, base_m, base_i)
    assert lo.bounded and lo.value == pytest.approx(1 - base_m[key] / m[key], rel=1e-6) and lo.value > 0


def test_sample_indices_fixed_by_seed():
    a = accuracy.sample_indices(1000, 50, 0, "t")
    assert a == accuracy.sample_indices(1000, 50, 0, "t") and len(set(a)) == 50
    assert a != accuracy.sample_indices(1000, 50, 1, "t")
    assert accuracy.sample_indices(10, 50, 0, "t") is None


def test_missing_data_names_task_and_path(tmp_path):
    with pytest.raises(UserError, match=r"task piqa_local: expected .*/piqa/valid.jsonl"):
        accuracy.prepare_tasks(["piqa_local"], str(tmp_path), str(tmp_path))
    with pytest.raises(UserError, match="task piqa_local needs data_dir"):
        accuracy.prepare_tasks(["piqa_local"], None, str(tmp_path))


def test_flatten_results():
    flat = accuracy.flatten_results({"arc": {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": "arc"}})
    assert flat == {"acc/arc": 0.5}


@needs_data
def test_wikitext_rows_rebuilt_like_hf():
    text = perplexity.wikitext2_text(str(SHARED_DATA))
    assert text.startswith("\n\n = Robert Boulter = \n")  # first HF row is ""
    assert text.count("\n\n") >= 4358 - 1


def test_token_perplexity_matches_independent_computation(tiny):
    """Against HF's own shifted cross-entropy, a different code path."""
    model, tok = tiny
    ids = torch.randint(0, 256, (4 * 64 + 10,), generator=torch.Generator().manual_seed(0))
    wins, _ = perplexity.windows(ids, 64, None)
    assert wins.shape == (4, 64)
    ours = perplexity.token_perplexity(TorchEngine(model), wins)["ppl_token_wikitext2_w64"]
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in wins]
    assert ours == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-4)
    assert perplexity.windows(ids, 64, 2)[0].shape == (2, 64)
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity.windows(ids[:10], 64, None)


def _run(name, bits, metrics, outcome="finished"):
    return PointRecord(name, name, metrics={"size/bits_per_weight": bits, **metrics},
                       tags={tracking.OUTCOME_TAG: outcome, "scheme": name})


def test_recovery_orientation_and_baseline():
    runs = [_run("bf16", 16, {"acc/a": 0.5, "ppl_token_wikitext2_w2048": 10.0}),
            _run("int4", 4.5, {"acc/a": 0.45, "ppl_token_wikitext2_w2048": 12.5}),
            _run("fp32", 32, {"acc/a": 0.5}, outcome="failed")]
    base = report.table.baseline_run(runs)
    assert base.name == "bf16"  # fp32 failed: next-highest precision
    rec = report.table.recovery(runs[1].metrics, base.metrics)
    assert rec == {"recovery/acc/a": pytest.approx(0.9),
                   "recovery/ppl_token_wikitext2_w2048": pytest.approx(0.8)}
    assert report.table.baseline_run(runs, "int4").name == "int4"
    assert report.table.baseline_run(runs, "nope") is None


@needs_data
def test_sweep_logs_accuracy_perplexity_recovery_and_results_json(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["-m", "model=tiny", "scheme/weights=fp32,int8", "probe=quick",
                    "probe.accuracy.tasks=[arc_easy_local]", "probe.accuracy.limit=16",
                    "probe.perplexity.window=256", "probe.perplexity.max_windows=2",
                    "probe.fidelity.tokens=256", "probe.latency.repeats=1", "probe.latency.new_tokens=4",
                    f"data_dir={SHARED_DATA}", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    c = MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])}
    m = runs["int8@cpu"].data.metrics
    ppl = "ppl_token_wikitext2_w256_rand2"  # 2 windows drawn at random: named so
    assert "acc/arc_easy_local" in m and ppl in m and 0 < m["acc_stderr/arc_easy_local"] < 0.2
    assert 0 < m[f"{ppl}_ln_stderr"] < 0.5 and "fid/ln_ppl_ratio_stderr" in m
    assert m[f"recovery/{ppl}"] == pytest.approx(runs["fp32@cpu"].data.metrics[ppl] / m[ppl])
    assert runs["fp32@cpu"].data.metrics["recovery/acc/arc_easy_local"] == 1.0
    assert {"lm_eval_results.json", "items.json"} <= {a.path for a in c.list_artifacts(runs["int8@cpu"].info.run_id)}
    items = tracker(c.tracking_uri).items(runs["int8@cpu"].info.run_id)
    assert len(items["acc/arc_easy_local"]) == 16 and len(items[ppl]) == 2 * 255
    assert math.exp(sum(items[ppl]) / len(items[ppl])) == pytest.approx(m[ppl], rel=1e-4)
    # each window's article, the same for both points (same seed): the cluster the report's bound resamples
    arts = items[f"articles/{ppl}"]
    assert len(arts) == 2 and arts == tracker(c.tracking_uri).items(runs["fp32@cpu"].info.run_id)[f"articles/{ppl}"]
    assert m[f"{ppl}_articles"] == len(set(arts)) and all(0 <= a < 70 for a in arts)
    text = proc.stdout
    assert "±" in text and "Decision rule:" in text and "one-sided upper bound" in text
    assert "int8@cpu: acc/arc_easy_local: diff" in text and "ln PPL ratio" in text


def test_missing_data_dir_skips_accuracy_but_logs_the_rest(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    (tmp_path / "empty").mkdir()  # a data directory without the benchmark files (one that does not exist: refused)
    proc = run_cli(["model=tiny", "probe=quick", "probe.fidelity.corpus=builtin", f"data_dir={tmp_path}/empty",
                    "probe.latency.repeats=1", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    c = MlflowClient(uri)
    (run,) = c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])
    assert run.info.status == "FINISHED" and "fid/kl_mean" in run.data.metrics
    assert "expected" in run.data.tags["probe.accuracy.skipped"]
    assert "wiki.test.raw" in run.data.tags["probe.perplexity.skipped"]


@needs_data
def test_rolling_loglikelihood_parity_with_hflm(tiny, tmp_path):
    """Word perplexity (loglikelihood_rolling over max_length windows) through
    EngineLM equals HFLM's on the same model and documents."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tok = tiny
    cfg = AccuracyProbeConfig(enabled=True, tasks=["wikitext2_local"], limit=2, batch_size=2, max_length=256)
    ours, _, _ = accuracy.evaluate(TorchEngine(model), tok, cfg, str(SHARED_DATA), str(tmp_path), seed=0)
    include, counts = accuracy.prepare_tasks(cfg.tasks, str(SHARED_DATA), str(tmp_path))
    samples = {"wikitext2_local": accuracy.sample_indices(counts["wikitext2_local"], 2, 0, "wikitext2_local")}
    direct = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=1, max_length=256),
                             tasks=cfg.tasks, samples=samples, bootstrap_iters=0,
                             task_manager=TaskManager(include_path=str(include)))
    want = direct["results"]["wikitext2_local"]["word_perplexity,none"]
    assert ours["word_perplexity/wikitext2_local"] == pytest.approx(want, rel=1e-5)


@needs_data
def test_wikitext_local_counts_words_and_bytes_as_lm_eval(tmp_path):
    """Pages as EleutherAI/wikitext_document_level; words and bytes counted by
    lm-eval's own process_results on the original page (241,335 words, the
    count of lm-eval's wikitext task), the scored text from its detokenizer."""
    import json as _json

    from lm_eval.tasks.wikitext import preprocess_wikitext as lm

    include, _ = accuracy.prepare_tasks(["wikitext2_local"], str(SHARED_DATA), str(tmp_path))
    docs = [_json.loads(line) for line in (include / "wikitext2.jsonl").read_text().splitlines()]
    assert len(docs) == 62 and docs[0]["page"].startswith(" = Robert Boulter = \n")
    counts = [lm.process_results(d, (0.0,)) for d in docs]
    assert sum(c["word_perplexity"][1] for c in counts) == 241335
    assert sum(c["byte_perplexity"][1] for c in counts) == 1290527
    assert " @-@ " in docs[0]["page"] and " @-@ " not in lm.wikitext_detokenizer(docs[0])
    assert (include / "preprocess_wikitext.py").is_file()
    assert "!function preprocess_wikitext.process_results" in (include / "wikitext2_local.yaml").read_text()


@needs_data
def test_recovery_is_not_relogged_onto_a_reused_run(tmp_path):
    """A point reused by a second sweep keeps the recovery its own sweep gave
    it; the second sweep's report computes its own against its baseline."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    common = ["model=tiny", "probe.perplexity.enabled=true", "probe.perplexity.window=64",
              "probe.perplexity.max_windows=2", "probe.latency.repeats=1", "probe.latency.new_tokens=2",
              f"data_dir={SHARED_DATA}", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a",
              "eval_seed=0"]  # the second sweep repeats the first's draws: its points can be reused
    assert run_cli(["-m", "scheme/weights=fp32,bf16", *common]).returncode == 0
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("quantlab").experiment_id
    bf16 = c.search_runs([exp], filter_string="attributes.run_name = 'bf16@cpu'")[0]
    key = "recovery/ppl_token_wikitext2_w64_rand2"
    first = bf16.data.metrics[key]
    assert first != 1.0  # against fp32
    second = run_cli(["-m", "scheme/weights=bf16,int8", *common])
    assert second.returncode == 0 and "| reused" in second.stdout
    assert "bf16@cpu (baseline)" in second.stdout  # the reused run is this sweep's baseline ...
    assert c.get_run(bf16.info.run_id).data.metrics[key] == first  # ... without overwriting its recovery
    assert len(c.get_metric_history(bf16.info.run_id, key)) == 1


@needs_data
def test_boolq_local_says_how_it_differs_from_lm_eval(tmp_path):
    """The source file has no passage title (SuperGLUE's passages, lm-eval's,
    start with one): the task's YAML and evaluation/README.md must say so
    rather than claim lm-eval's boolq."""
    import json as _json

    include, _ = accuracy.prepare_tasks(["boolq_local"], str(SHARED_DATA), str(tmp_path))
    doc = _json.loads((include / "boolq.jsonl").read_text().splitlines()[0])
    assert "title" not in doc
    row = next(line for line in (accuracy.TEMPLATES / "README.md").read_text().splitlines()
               if line.startswith("| `boolq_local`"))
    assert "without the passage title" in row and "as lm-eval `boolq`" not in row
    assert "no title field" in (accuracy.TEMPLATES / "boolq_local.yaml").read_text()


@needs_data
def test_adaptive_perplexity_stops_a_clear_point_and_the_report_bounds_it_over_its_looks(tmp_path):
    """fp32 (identical to the reference, shown by the fidelity probe) takes
    the reference's windows over the cap, scoring them once on its own engine
    to fill the cache; int8 on the tiny model (a per-token NLL change ~1e-3)
    stops once both budgets are decided; the report pairs it on the windows
    it scored with the anytime-valid bound."""
    from safetensors.torch import load_file
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["-m", "model=tiny", "scheme/weights=fp32,int8", "probe=smoke", "probe.cache.enabled=false",
                    "probe.perplexity.enabled=true", "probe.perplexity.window=128", "probe.perplexity.max_windows=16",
                    "probe.perplexity.adaptive=true", "probe.latency.repeats=1", "probe.latency.new_tokens=4",
                    f"cache_dir={tmp_path}/cache", f"data_dir={SHARED_DATA}", f"tracking.uri={uri}",
                    f"tracking.artifact_root={tmp_path}/a"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    c = MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])}
    ppl = "ppl_token_wikitext2_w128_rand16"  # named by the cap, however many windows a point scored
    fp32, int8 = runs["fp32@cpu"].data, runs["int8@cpu"].data
    assert fp32.metrics[f"{ppl}_windows"] == 16 and f"{ppl}_adaptive_cap" not in fp32.metrics
    assert fp32.metrics["fid/identical"] == 1.0
    assert fp32.tags["probe.perplexity.stop"] == "identical to the reference: its 16 windows are the reference's"
    [ref_file] = (tmp_path / "cache" / "reference_nll").glob("*.safetensors")
    ref = load_file(ref_file)["value"]
    assert tracker(c.tracking_uri).items(runs["fp32@cpu"].info.run_id)[ppl] == [round(float(x), 5) for x in ref.ravel()]
    assert (proc.stdout + proc.stderr).count("computing the reference model's reference_nll") == 1
    assert int8.metrics[f"{ppl}_windows"] < 16 and int8.metrics[f"{ppl}_adaptive_cap"] == 16
    assert int8.tags["probe.perplexity.stop"].startswith("decided at")
    int8_items = tracker(c.tracking_uri).items(runs["int8@cpu"].info.run_id)
    assert len(int8_items[ppl]) == int8.metrics[f"{ppl}_windows"] * 127
    assert len(int8_items[f"articles/{ppl}"]) == int8.metrics[f"{ppl}_windows"]  # the prefix it scored
    assert len(list((tmp_path / "cache" / "reference_nll").glob("*.safetensors"))) == 1
    assert f"Decision rule: loss on `{ppl}`" in proc.stdout and "anytime-valid over" in proc.stdout
    assert "Adaptive perplexity" in proc.stdout and "int8@cpu: decided at" in proc.stdout


@needs_data
def test_adaptive_lm_eval_stops_a_clear_point_and_the_report_bounds_it_over_its_looks(tmp_path):
    """fp32 (identical to the reference) takes the reference's 200 documents
    (the cap, scored once on its own engine to fill the cache); int8 on
    the tiny model (the reference's answers, nearly all) stops at a look once
    the (generous, for a test) budget is decided; the report bounds it over
    its looks and says why each point stopped."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["-m", "model=tiny", "scheme/weights=fp32,int8", "probe=smoke", "probe.cache.enabled=false",
                    "probe.accuracy.enabled=true", "probe.accuracy.tasks=[arc_easy_local]", "probe.accuracy.limit=200",
                    "probe.accuracy.adaptive=true", "probe.accuracy.adaptive_chunk=25",
                    "probe.accuracy.adaptive_budgets=[0.5]", "decision.budgets=[0.5]", "probe.latency.repeats=1",
                    "probe.latency.new_tokens=4", f"cache_dir={tmp_path}/cache", f"data_dir={SHARED_DATA}",
                    f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    c = MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])}
    acc = "acc/arc_easy_local"
    fp32, int8 = runs["fp32@cpu"].data, runs["int8@cpu"].data
    assert fp32.metrics[f"{acc}_documents"] == 200 and f"{acc}_adaptive_cap" not in fp32.metrics
    assert fp32.tags["probe.accuracy.stop"] == \
        "arc_easy_local: identical to the reference: its 200 documents are the reference's"
    [ref_file] = (tmp_path / "cache" / "reference_docs").glob("*.json")
    ref_docs = json.loads(ref_file.read_text())["arc_easy_local"]["acc"]
    fp32_items = tracker(c.tracking_uri).items(runs["fp32@cpu"].info.run_id)
    assert fp32_items[acc] == [ref_docs[str(int(d))] for d in fp32_items["doc_ids/arc_easy_local"]]
    assert int8.metrics[f"{acc}_documents"] < 200 and int8.metrics[f"{acc}_adaptive_cap"] == 200
    assert int8.tags["probe.accuracy.stop"].startswith("arc_easy_local: decided at")
    items = tracker(c.tracking_uri).items(runs["int8@cpu"].info.run_id)
    assert len(items[acc]) == len(items["doc_ids/arc_easy_local"]) == int8.metrics[f"{acc}_documents"]
    assert len(list((tmp_path / "cache" / "reference_docs").glob("*.json"))) == 1
    assert "Adaptive lm-eval" in proc.stdout and "int8@cpu: arc_easy_local: decided at" in proc.stdout
    assert "Decision rule: loss on `acc_norm/arc_easy_local`" in proc.stdout and "anytime-valid over" in proc.stdout


# per-dtype tolerance (nats, a request's summed log-likelihood): fp32 to rounding; 16-bit and quantized
# points 5x below the 2.5e-3 a bf16 row moved by with its batch's padded width before rows were bucketed
BATCH_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-4, "fp16": 5e-4, "int8": 5e-4, "int4-g64": 5e-4}


@pytest.mark.parametrize("scheme", list(BATCH_TOLERANCE))
@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 150), st.integers(1, 12)), min_size=2, max_size=24),
       batch_size=st.sampled_from([2, 4, 16]))
def test_a_documents_loglikelihood_is_the_same_alone_and_in_a_batch(tiny_points, scheme, lengths, batch_size):
    """Per-document scores do not depend on the batch a request is padded
    into (the adaptive looks, the fixed design and the reference batch
    documents differently)."""
    from quantlab.probes.lm_adapter import EngineLM

    engine, tok = tiny_points[scheme]
    g = torch.Generator().manual_seed(len(lengths) * 1000 + batch_size)
    reqs = [(None, torch.randint(3, 250, (c,), generator=g).tolist(), torch.randint(3, 250, (n,), generator=g).tolist())
            for c, n in lengths]
    together = EngineLM(engine, tok, batch_size=batch_size, max_length=128)._loglikelihood_tokens(reqs)
    alone = EngineLM(engine, tok, batch_size=1, max_length=128)
    for r, (ll, greedy) in zip(reqs, together):
        ll1, greedy1 = alone._loglikelihood_tokens([r])[0]
        assert abs(ll - ll1) <= BATCH_TOLERANCE[scheme] and greedy == greedy1


@pytest.fixture(scope="module")
def tiny_points():
    import copy

    from quantlab import hardware
    from quantlab.schemes.registry import ApplyContext, weights_handler
    from tests.conftest import compose_cfg

    base, tok = models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()
    out = {}
    for scheme in BATCH_TOLERANCE:
        m = copy.deepcopy(base)
        w = compose_cfg([f"scheme/weights={scheme}", "model=tiny"]).scheme.weights
        weights_handler(w).apply(m, w, ApplyContext(hw=hardware.cpu(), tokenizer=tok))
        out[scheme] = TorchEngine(m), tok
    return out


# a window's NLLs scored inside a batch of windows against alone: fp32 to rounding; 16-bit and quantized
# points at the per-token share of the per-document tolerance above
WINDOW_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-4, "fp16": 1e-4, "int8": 1e-4, "int4-g64": 1e-4}


@pytest.mark.parametrize("scheme", list(WINDOW_TOLERANCE))
@settings(max_examples=4, deadline=None)
@given(window=st.sampled_from([32, 64, 128, 512]), n=st.integers(1, 9), seed=st.integers(0, 99))
def test_a_windows_nll_is_the_same_alone_and_in_a_batch(tiny_points, scheme, window, n, seed):
    """The perplexity probe scores ``batch_rows(window)`` windows a forward;
    a window's token NLLs are what it scores alone (the adaptive looks, the
    fixed design and the cached reference cut the same windows differently
    when a look is not a multiple of the batch)."""
    engine, _ = tiny_points[scheme]
    wins = torch.randint(3, 250, (n, window), generator=torch.Generator().manual_seed(seed))
    together = perplexity.token_nll(engine, wins)
    assert together.shape == (n, window - 1) and perplexity.batch_rows(window) == max(1, 512 // window)
    alone = [-engine.token_logprobs(w[None])[0][0].numpy() for w in wins]
    assert max(float(abs(a - b).max()) for a, b in zip(together, alone)) <= WINDOW_TOLERANCE[scheme]
