"""Accuracy probes: parity with lm-eval run directly, perplexity vs an independent
computation, local task data, recovery. Uses ../shared/data (QUANTLAB_DATA_DIR)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from quantlab import models, report, tracking
from quantlab.config import AccuracyProbeConfig, ModelConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.errors import UserError
from quantlab.probes import accuracy, perplexity
from tests.conftest import SHARED_DATA, run_cli

needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data not present")


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
    ours, _ = accuracy.evaluate(TorchEngine(model), tok, cfg, str(SHARED_DATA), str(tmp_path), seed=3)
    include, counts = accuracy.prepare_tasks(cfg.tasks, str(SHARED_DATA), str(tmp_path))
    samples = {t: accuracy.sample_indices(counts[t], 24, 3, t) for t in cfg.tasks}
    direct = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=1),
                             tasks=cfg.tasks, samples=samples, bootstrap_iters=0,
                             task_manager=TaskManager(include_path=str(include)))
    for t in cfg.tasks:
        for m in ("acc", "acc_norm"):
            assert ours[f"{m}/{t}"] == direct["results"][t][f"{m},none"]
    assert len(samples["arc_easy_local"]) == 24


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
    wins = perplexity.windows(ids, 64, None)
    assert wins.shape == (4, 64)
    ours = perplexity.token_perplexity(TorchEngine(model), wins)["ppl_token_wikitext2_w64"]
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in wins]
    assert ours == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-4)
    assert perplexity.windows(ids, 64, 2).shape == (2, 64)
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity.windows(ids[:10], 64, None)


def _run(name, bits, metrics, outcome="finished"):
    return SimpleNamespace(info=SimpleNamespace(run_name=name, run_id=name),
                           data=SimpleNamespace(metrics={"size/bits_per_weight": bits, **metrics},
                                                tags={tracking.OUTCOME_TAG: outcome, "scheme": name}))


def test_recovery_orientation_and_baseline():
    runs = [_run("bf16", 16, {"acc/a": 0.5, "ppl_token_wikitext2_w2048": 10.0}),
            _run("int4", 4.5, {"acc/a": 0.45, "ppl_token_wikitext2_w2048": 12.5}),
            _run("fp32", 32, {"acc/a": 0.5}, outcome="failed")]
    base = report.baseline_run(runs)
    assert base.info.run_name == "bf16"  # fp32 failed: next-highest precision
    rec = report.recovery(runs[1].data.metrics, base.data.metrics)
    assert rec == {"recovery/acc/a": pytest.approx(0.9),
                   "recovery/ppl_token_wikitext2_w2048": pytest.approx(0.8)}
    assert report.baseline_run(runs, "int4").info.run_name == "int4"
    assert report.baseline_run(runs, "nope") is None


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
    assert "acc/arc_easy_local" in m and "ppl_token_wikitext2_w256" in m
    assert m["recovery/ppl_token_wikitext2_w256"] == pytest.approx(
        runs["fp32@cpu"].data.metrics["ppl_token_wikitext2_w256"] / m["ppl_token_wikitext2_w256"])
    assert runs["fp32@cpu"].data.metrics["recovery/acc/arc_easy_local"] == 1.0
    assert "lm_eval_results.json" in {a.path for a in c.list_artifacts(runs["int8@cpu"].info.run_id)}


def test_missing_data_dir_skips_accuracy_but_logs_the_rest(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["model=tiny", "probe=quick", "probe.fidelity.corpus=builtin", f"data_dir={tmp_path}/nowhere",
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
    ours, _ = accuracy.evaluate(TorchEngine(model), tok, cfg, str(SHARED_DATA), str(tmp_path), seed=0)
    include, counts = accuracy.prepare_tasks(cfg.tasks, str(SHARED_DATA), str(tmp_path))
    samples = {"wikitext2_local": accuracy.sample_indices(counts["wikitext2_local"], 2, 0, "wikitext2_local")}
    direct = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=1, max_length=256),
                             tasks=cfg.tasks, samples=samples, bootstrap_iters=0,
                             task_manager=TaskManager(include_path=str(include)))
    want = direct["results"]["wikitext2_local"]["word_perplexity,none"]
    assert ours["word_perplexity/wikitext2_local"] == pytest.approx(want, rel=1e-5)
