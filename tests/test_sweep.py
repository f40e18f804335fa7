"""End to end: the CLI runs a sweep on the tiny model into a temp MLflow store."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from quantlab import tracking
from tests.conftest import run_cli, tracker


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{d}/mlflow.db"
    proc = run_cli(["+sweep=smoke", "model=tiny", f"tracking.uri={uri}", f"tracking.artifact_root={d}/art"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("quantlab")
    runs = client.search_runs([exp.experiment_id])
    return proc, client, runs


def test_one_parent_and_one_child_per_point(smoke_sweep):
    _, client, runs = smoke_sweep
    parents = [r for r in runs if r.data.tags.get("quantlab.role") == "sweep"]
    children = [r for r in runs if tracking.PARENT_TAG in r.data.tags]
    assert len(parents) == 1 and len(runs) == 4
    assert {r.data.tags[tracking.PARENT_TAG] for r in children} == {parents[0].info.run_id}
    assert sorted(r.info.run_name for r in children) == ["bf16@cpu", "fp16@cpu", "fp32@cpu"]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert parents[0].data.metrics["points_finished"] == 3


def test_children_carry_params_tags_metrics_and_config(smoke_sweep):
    _, client, runs = smoke_sweep
    child = next(r for r in runs if r.info.run_name == "bf16@cpu")
    p, t, m = child.data.params, child.data.tags, child.data.metrics
    assert p["scheme.weights.dtype"] == "bfloat16" and p["scheme.weights.type"] == "FloatScheme"
    assert p["model.source"] == "tiny" and p["target.name"] == "cpu"
    assert t["scheme"] == "bf16" and t["target"] == "cpu" and t["model"] == "tiny"
    assert t["emulated"] == "false" and t[tracking.SWEEP_TAG] == "smoke"
    assert t["version.torch"].startswith("2.") and t["host.cpu"] and t["git_commit"]
    assert len(t["point_hash"]) == 16
    # what the UI's compare charts plot: the scheme and bits as params, the decision loss as a metric
    assert p["scheme"] == "bf16" and p["bits_per_weight"] == "16.00" and "model.tiny.hidden_size" in p
    assert m["decision/loss"] == pytest.approx(1 - m["fid/top1_agree"]) and m["decision/loss_upper"] >= m["decision/loss"]
    assert t["decision.metric"] == "fid/top1_agree"
    for key in ("fid/kl_mean", "fid/top1_agree", "lat/ttft_ms_p50", "lat/prefill_ms_p50",
                "lat/tpot_ms_p50", "lat/tpot_ms_p99", "tput/decode_tok_s", "mem/peak_rss_mb",
                "size/weight_bytes"):
        assert key in m, key
    assert m["lat/tpot_ms_count"] == 2 * 15  # repeats x (new_tokens - 1)
    assert m["lat/ttft_ms_p50"] >= m["lat/prefill_ms_p50"]
    artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert "config.yaml" in artifacts


def test_fidelity_exact_for_fp32_small_for_half(smoke_sweep):
    _, _, runs = smoke_sweep
    m = {r.info.run_name: r.data.metrics for r in runs}
    assert m["fp32@cpu"]["fid/kl_mean"] == 0.0 and m["fp32@cpu"]["fid/top1_agree"] == 1.0
    for half in ("bf16@cpu", "fp16@cpu"):
        assert 0.0 < m[half]["fid/kl_mean"] < 1e-2
    # bf16 has 8 mantissa bits, fp16 11: bf16 must be further from fp32.
    assert m["bf16@cpu"]["fid/kl_mean"] > m["fp16@cpu"]["fid/kl_mean"]
    assert m["fp32@cpu"]["size/weight_bytes"] == 2 * m["bf16@cpu"]["size/weight_bytes"]


def test_summary_table_printed_and_logged(smoke_sweep):
    proc, client, runs = smoke_sweep
    assert "| fp32@cpu (baseline)" in proc.stdout and "TPOT p50 ms" in proc.stdout
    assert "Decision rule: loss on `fid/top1_agree`" in proc.stdout  # no data: agreement, with its bound
    parent_id = next(r.info.run_id for r in runs if r.data.tags.get("quantlab.role") == "sweep")
    assert "python -m quantlab.export --sweep smoke --budget 0.05 --out exports/smoke-0.05" in proc.stdout
    assert f"as artifacts of the parent run {parent_id}" in proc.stdout and "Runs: fp32@cpu " in proc.stdout
    child = next(r for r in runs if r.info.run_name == "bf16@cpu")
    assert tracker(client.tracking_uri).items(child.info.run_id) == {}  # smoke logs no per-item values
    parent = next(r for r in runs if r.data.tags.get("quantlab.role") == "sweep")
    assert {"report.md", "pareto.png", "pareto.html", "capabilities.md"} <= \
        {a.path for a in client.list_artifacts(parent.info.run_id)}


def test_each_point_says_where_its_time_went(smoke_sweep):
    """time/<stage>_s per point, no stage longer than the point, and the
    report's table sums them over the sweep."""
    proc, _, runs = smoke_sweep
    children = [r for r in runs if tracking.PARENT_TAG in r.data.tags]
    for r in children:
        m = {k[len("time/"):-2]: v for k, v in r.data.metrics.items() if k.startswith("time/")}
        assert {"model", "apply", "fidelity", "latency", "point"} <= set(m), sorted(m)
        assert all(v >= 0 for v in m.values())
        assert sum(v for k, v in m.items() if k != "point") <= m["point"]
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| sum (measured here)"))
    total = float(row.strip("| ").split("|")[-1])
    assert total == pytest.approx(sum(r.data.metrics["time/point_s"] for r in children), abs=0.2)
    assert "Where the time went" in proc.stdout


def test_unknown_scheme_is_one_line_listing_valid_names(tmp_path):
    proc = run_cli(["scheme/weights=int3", "model=tiny", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["quantlab: unknown scheme/weights 'int3'; valid: bf16, fp16, fp32"] or \
        lines[-1].startswith("quantlab: unknown scheme/weights 'int3'; valid: ")
    assert "bf16" in lines[-1] and "fp32" in lines[-1]
    assert not (tmp_path / "m.db").exists()  # nothing was started


def test_unknown_model_is_one_line(tmp_path):
    proc = run_cli(["model=llama-9000"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("quantlab: unknown model 'llama-9000'; valid: ")
    assert "smollm2-135m" in proc.stderr and "tiny" in proc.stderr


def test_unavailable_target_is_skipped_with_reason(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["-m", "model=tiny", "target=cuda", f"tracking.uri={uri}",
                    f"tracking.artifact_root={tmp_path}/art"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id],
                              filter_string="tags.`quantlab.outcome` = 'skipped'")
    assert len(runs) == 1 and "no CUDA device" in runs[0].data.tags[tracking.REASON_TAG]
    assert "size/weight_bytes" not in runs[0].data.metrics  # nothing was loaded


def test_report_cli_reads_a_store_written_by_another_process(smoke_sweep, tmp_path, capsys):
    from quantlab import report_cli, store_read

    _, client, runs = smoke_sweep
    uri = client.tracking_uri
    light, full = store_read.open_store(uri, "quantlab"), tracker(uri)  # the store read with and without MLflow
    assert isinstance(light, store_read.SqliteStore) and light.top_level() == full.top_level()
    assert light.sweeps() == full.sweeps() and light.tags(runs[0].info.run_id) == full.tags(runs[0].info.run_id)
    assert report_cli.main(["--tracking-uri", uri, "--sweep", "smoke", "--out", str(tmp_path), "--no-log"]) == 0
    out = capsys.readouterr().out
    # fp32 scores the reference's own log-probabilities on every position: its loss is exactly 0 (shown by its
    # outputs), so it qualifies within 1 %, where a sampled bound at 512 positions could not have shown it
    assert "Fastest within 1% loss: **fp32@cpu**" in out and "identical log-probabilities to the reference" in out
    assert "Declared at launch: metric auto, budgets 0.01, 0.05, alpha 0.05 (50% to the loss half" in out
    assert "post hoc" not in out
    assert report_cli.main(["--tracking-uri", uri, "--sweep", "smoke", "--budgets", "0.02", "--no-log",
                            "--out", str(tmp_path / "late")]) == 0
    assert "within 2% loss (post hoc: budget not declared (0.01, 0.05))" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # argparse's one line, exit 2
        report_cli.main(["--tracking-uri", uri, "--budgets", "0.02,x"])
    assert e.value.code == 2 and "comma-separated numbers" in capsys.readouterr().err
    assert (tmp_path / "pareto.png").stat().st_size > 10_000 and (tmp_path / "pareto.html").is_file()
    assert report_cli.main(["--tracking-uri", uri, "--sweep", "nope"]) == 2
    assert "no sweep 'nope' in this store; sweeps: smoke" in capsys.readouterr().err


def test_recommended_point_tagged(smoke_sweep):
    _, client, runs = smoke_sweep
    parent = next(r for r in runs if r.data.tags.get("quantlab.role") == "sweep")
    tags = client.get_run(parent.info.run_id).data.tags
    chosen = tags["recommended.0.05"]
    child = next(r for r in runs if r.info.run_name == chosen)
    assert client.get_run(child.info.run_id).data.tags["quantlab.recommended.0.05"] == "true"
    # the decision declared at launch, recorded before any point ran; the sweep's own picks are not post hoc
    assert (tags["declared.metric"], tags["declared.budgets"], tags["declared.alpha"]) == ("auto", "0.01,0.05", "0.05")
    assert tags["recommended.0.05.post_hoc"] == "no"
    # the evaluation draws' seed, drawn for this sweep and the one every point drew its windows with
    assert tags["quantlab.eval_seed_from"] == "drawn"
    assert {client.get_run(r.info.run_id).data.params["eval_seed"] for r in runs if r.info.run_id !=
            parent.info.run_id} == {tags["quantlab.eval_seed"]}


def test_each_sweep_draws_its_own_evaluation_seed_unless_pinned_or_resumed():
    """Failing-before for "every sweep decides on the same 64 windows": an
    unpinned sweep draws a fresh seed, so two sweeps are two looks; a sweep
    run again after it did not finish (same overrides) keeps its seed, so its
    finished points are reused with their windows; a pinned one is kept."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from quantlab import sweep

    def last(status, seed="7", overrides="a=1"):
        return SimpleNamespace(info=SimpleNamespace(status=status, run_id="r1"),
                               data=SimpleNamespace(tags={"quantlab.eval_seed": seed}, params={"sweep.overrides": overrides}))

    class Store:
        def __init__(self, run):
            self.run = run

        def last_sweep(self, name):
            return self.run

    unpinned, pinned = OmegaConf.create({"eval_seed": None}), OmegaConf.create({"eval_seed": 3})
    assert sweep._eval_seed(Store(last("FINISHED")), pinned, "s", "a=1") == (3, "pinned")
    assert sweep._eval_seed(Store(last("KILLED")), unpinned, "s", "a=1") == (7, "resumed r1")
    assert sweep._eval_seed(Store(last("FAILED")), unpinned, "s", "a=1") == (7, "resumed r1")
    for store in (Store(None), Store(last("FINISHED")), Store(last("KILLED", overrides="a=2"))):
        seeds = {sweep._eval_seed(store, unpinned, "s", "a=1") for _ in range(3)}
        assert len(seeds) == 3 and {src for _, src in seeds} == {"drawn"}


def test_a_decision_declared_after_its_points_were_measured_is_post_hoc(smoke_sweep):
    """Failing-before for "re-declaring after seeing results is free": a
    second sweep that reuses the smoke sweep's points and declares another
    budget says, beside every pick, that it was declared after they were
    measured, and its parent's post hoc tags say so (export reads them)."""
    _, client, runs = smoke_sweep
    uri = client.tracking_uri
    seed = next(r for r in runs if r.data.tags.get("quantlab.role") == "sweep").data.tags["quantlab.eval_seed"]
    proc = run_cli(["+sweep=smoke", "model=tiny", "sweep_name=redeclared", "decision.budgets=[0.02]", f"eval_seed={seed}",
                    f"tracking.uri={uri}", f"tracking.artifact_root={uri.removeprefix('sqlite:///')[:-10]}/art"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 reused" in proc.stderr + proc.stdout
    assert "within 2% loss (post hoc: declared after " in proc.stdout and " were measured (reused from a sweep that " \
        "declared another decision, or none)" in proc.stdout
    parent = next(r for r in client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
                  if r.data.tags.get("quantlab.role") == "sweep" and r.data.tags.get("quantlab.sweep") == "redeclared")
    assert parent.data.tags["recommended.0.02.post_hoc"].startswith("declared after ")


def test_headline_sweep_without_data_dir_exits_0_with_every_family(tmp_path):
    """A newcomer's `+sweep=fp8_vs_int4` without a data directory: every point
    runs (GPTQ on the built-in text, tagged), accuracy and perplexity are
    skipped with a tag, fidelity falls back to the built-in text, and the
    report still decides (on top-1 agreement, with its bound)."""
    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["+sweep=fp8_vs_int4", "model=tiny", "data_dir=null", "probe.latency.repeats=1",
                    "probe.latency.new_tokens=4", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/art"],
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = MlflowClient(tracking_uri=uri)
    runs = {r.info.run_name: r for r in client.search_runs(
        [client.get_experiment_by_name("quantlab").experiment_id], filter_string="tags.`quantlab.sweep` = 'fp8_vs_int4'")
        if r.data.tags.get("quantlab.role") != "sweep"}
    assert len(runs) == 10 and "int4-g64+kv8@cpu" in runs and "gptq-g64@cpu" in runs
    assert all(r.data.tags[tracking.OUTCOME_TAG] == "finished" for r in runs.values())
    kv = runs["int4-g64+kv8@cpu"].data
    assert kv.tags["probe.fidelity.corpus"] == "builtin" and "kvfid/kl_mean" in kv.metrics
    assert "data_dir" in kv.tags["probe.accuracy.skipped"] and "data_dir" in kv.tags["probe.perplexity.skipped"]
    assert "calibration.fallback" in runs["gptq-g64@cpu"].data.tags
    assert "Decision rule: loss on `fid/top1_agree`" in proc.stdout and "the level its test used" in proc.stdout


def test_params_of_other_model_sources_are_not_logged():
    from quantlab.pipeline import identify
    from quantlab.provenance import run_params
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["model=smollm2-135m", "scheme/weights=gptq-g64"])
    params = run_params(cfg, *identify(cfg))
    assert not any(k.startswith("model.tiny.") for k in params)
    assert params["scheme"] == "gptq-g64" and params["scheme.weights.group_size"] == "64"


def test_close_points_get_stacked_labels():
    from quantlab.pareto import Point
    from quantlab.plots import OFFSETS, label_offsets

    pts = [Point("bf16", 256.6, 0.0), Point("fp16", 256.6, 0.0), Point("fp32", 513.1, 0.0),
           Point("int4-g64", 111.0, 0.30), Point("int4-g32", 117.3, 0.29)]
    offs = label_offsets(pts)
    assert offs[0] != offs[1] and offs[3] != offs[4] and offs[2] == OFFSETS[0]
