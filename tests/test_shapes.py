"""Named shapes (model=shape): real architectures with random weights, for
latency at the sizes users ship; accuracy probes refused at compose time; the
report's cost-by-size section."""
from __future__ import annotations

import os

import pytest
import torch
from mlflow import MlflowClient
from transformers import AutoModelForCausalLM

from quantlab import models, shapes
from quantlab.config import ModelConfig, ShapeModelConfig
from tests.conftest import run_cli
from tests.test_vllm import REAL  # vLLM's venv, resolved before the tests' own cache directory is set

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_each_shape_builds_the_published_architecture(name):
    """At full size on the meta device (no memory): transformers' model of the
    shape has the published parameter count, which count_params also gives."""
    s = shapes.SHAPES[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(models.shape_config(s))
    assert sum(p.numel() for p in model.parameters()) == s.params == shapes.count_params(s)
    cfg = model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.tie_word_embeddings) == \
        (s.vocab_size, s.num_hidden_layers, s.num_key_value_heads, s.tie_word_embeddings)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[s.arch]


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_each_shape_at_tiny_width_runs_with_real_looking_weights(name):
    cfg = ModelConfig(name=f"{name}-random", source="shape", shape=ShapeModelConfig(name=name, **TINY))
    model, tok = models.load(cfg, "/nonexistent")
    s = shapes.SHAPES[name]
    assert model.config.vocab_size == s.vocab_size == len(tok)  # the real vocabulary: embedding and head at size
    assert model.config.hidden_size == 64 and model.config.rope_parameters["rope_theta"] == s.rope_theta
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == shapes.resolve(name, TINY).params
    w = model.model.layers[0].mlp.down_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025 and w.mean().abs().item() < 2e-3  # trained checkpoints' scale, not zeros
    again, _ = models.load(cfg, "/nonexistent")
    assert torch.equal(again.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)
    ids = tok("héllo, world", return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[0]) == "héllo, world" and int(ids.max()) < 256
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3) and int(out.max()) < s.vocab_size


def test_an_override_changes_the_count_and_unknown_names_list_the_valid():
    base = shapes.SHAPES["llama-3-8b"]
    two = shapes.resolve("llama-3-8b", {"num_hidden_layers": 2})
    assert two.params == base.params - 30 * (base.params - shapes.count_params(
        shapes.resolve("llama-3-8b", {"num_hidden_layers": 31})))
    out = run_cli(["model=shape", "model.shape.name=llama-9b", "probe=latency"])
    assert out.returncode == 2
    assert "model.shape.name='llama-9b': valid: smollm2-135m, smollm2-360m" in out.stderr


def test_accuracy_probes_on_random_weights_are_refused_in_one_line(tmp_path):
    out = run_cli(["model=shape", "probe=quick", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "quantlab: invalid config: model.source=shape has random weights: probe.fidelity, probe.perplexity, "
        "probe.accuracy, probe.cache would measure nothing; use probe=latency (or set probe.<name>.enabled=false)")
    assert not (tmp_path / "m.db").exists()  # refused before any store was opened


def run_sweep(tmp_path, args: list[str], timeout: float = 900):
    """Runs a sweep into ``tmp_path``'s store: (client, parent run, point runs by
    name); fails with the command's stderr when it does not exit 0."""
    out = run_cli(args, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("quantlab.role") == "sweep")
    return client, parent, {r.info.run_name: r for r in runs if r is not parent}


def report_text(client, parent, tmp_path) -> str:
    client.download_artifacts(parent.info.run_id, "report.md", str(tmp_path))
    return (tmp_path / "report.md").read_text()


def test_a_scaling_sweep_at_tiny_widths_reports_cost_by_size(tmp_path):
    """+sweep=scaling at tiny widths of two shapes, two schemes, torch CPU and
    llama.cpp (a GGUF of the random weights with the shape's padded vocabulary):
    run names carry the model, no pick by loss, a cost-by-size table and plot."""
    pytest.importorskip("llama_cpp")
    args = ["+sweep=scaling", "model.shape.name=smollm2-135m,qwen2.5-0.5b", "scheme/weights=bf16,int8",
            "target=cpu,llamacpp", "probe.latency.repeats=2", "probe.latency.grid_prompt_tokens=[32,64]",
            "probe.latency.prompt_tokens=32", "probe.latency.new_tokens=8",
            f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/art",
            *(f"model.shape.{k}={v}" for k, v in TINY.items())]
    client, parent, points = run_sweep(tmp_path, args)
    assert set(points) == {f"{m}-random:{s}@{t}" for m in ("smollm2-135m", "qwen2.5-0.5b")
                           for s in ("bf16", "int8") for t in ("cpu", "llamacpp")}
    for r in points.values():
        assert r.data.tags["quantlab.outcome"] == "finished" and r.data.tags["model.random_weights"] == "true"
        assert "fid/kl_mean" not in r.data.metrics and r.data.metrics["lat/tpot_ms_p50"] > 0
        assert "cell/b1_p64/ttft_ms_p50" in r.data.metrics and "bw/util" in r.data.metrics
    qwen = points["qwen2.5-0.5b-random:bf16@cpu"].data.metrics
    assert qwen["size/params"] == shapes.resolve("qwen2.5-0.5b", TINY).params  # 151936-token embedding, tied
    text = report_text(client, parent, tmp_path)
    assert "no point is picked by loss" in text and "Within 1% loss" not in text
    assert "Cost by size" in text and "| llamacpp | int8 | 2 |" in text and "| cpu | bf16 | 2 |" in text
    assert "scaling.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]


@pytest.mark.parametrize("name,scheme,kind", [("llama-3.2-1b", "int8", "Q8_0"), ("qwen2.5-0.5b", "int8", "Q8_0"),
                                              ("qwen2.5-0.5b", "int4-g32-sym", "Q4_0"),
                                              ("qwen2.5-0.5b", "bf16", "BF16")])
def test_a_shape_point_exports_a_gguf_llamacpp_reproduces(tmp_path, name, scheme, kind):
    """Both architectures' GGUFs (qwen2: q/k/v biases, no Q/K row permutation)
    give llama.cpp's logits of the point, with weights scaled up and biases
    set so that a wrong layout would show (peaked next-token distributions)."""
    pytest.importorskip("llama_cpp")
    from quantlab.engines.llamacpp import LlamaCppEngine
    from quantlab.export import gguf as gguf_export
    from quantlab.export import roundtrip
    from quantlab.hardware import cpu
    from quantlab.schemes.registry import ApplyContext, weights_handler
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["model=shape", f"model.shape.name={name}", "probe=latency", f"scheme/weights={scheme}",
                       *(f"model.shape.{k}={v}" for k, v in TINY.items())])
    model, tok = models.load(cfg.model, cfg.cache_dir)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.mul_(8)
                if mod.bias is not None:
                    mod.bias.normal_(0, 0.5)
        model.get_output_embeddings().weight.mul_(5)  # logits of std ~6: top-1 decided, not a coin toss
    w = cfg.scheme.weights
    weights_handler(w).apply(model, w, ApplyContext(hw=cpu(), tokenizer=tok, cache_dir=cfg.cache_dir))
    gguf_export.write(model, tok, tmp_path / "m.gguf")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    engine = LlamaCppEngine(tmp_path / "m.gguf", "F16", model.config.vocab_size, n_ctx=64)
    try:
        check = roundtrip.gguf_check(tmp_path / "m.gguf", engine, model, ids, kind)
    finally:
        engine.close()
    ref = torch.log_softmax(models_logits(model, ids), -1)
    assert float(-(ref.exp() * ref).sum(-1).mean()) < 0.7 * float(torch.log(torch.tensor(model.config.vocab_size)))
    assert check["passed"] and check["top1_agree"] > 0.9, check


def models_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits[0].float()


@pytest.mark.vllm
def test_shape_points_serve_on_vllm_at_tiny_widths(tmp_path):
    """The scaling sweep's vLLM route at tiny widths (head_dim 32, which vLLM's
    CPU attention needs): qwen2 (q/k/v biases, 151,936-token vocabulary) in
    bf16 and llama in int4; each point is quantlab's compressed-tensors export
    of the random weights served by vLLM, timed, on the report's cost-by-size
    table; int4 is skipped with its reason on a CPU without AVX512-BF16."""
    from quantlab import hardware

    if not os.access(REAL, os.X_OK):
        pytest.skip(f"no vLLM venv at {REAL} (bash scripts/build_vllm_venv.sh builds it)")
    width = {**TINY, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
    args = ["-m", "+sweep=scaling", "model.shape.name=qwen2.5-0.5b,smollm2-135m", "scheme/weights=bf16,int4-g32-sym",
            "target=vllm", f"target.python={REAL}", "target.max_model_len=512", "probe.latency.repeats=2",
            "probe.latency.grid_prompt_tokens=[32,64]", "probe.latency.prompt_tokens=32",
            "probe.latency.new_tokens=8", f"tracking.uri=sqlite:///{tmp_path}/m.db",
            f"tracking.artifact_root={tmp_path}/art", f"cache_dir={tmp_path}/c",
            *(f"model.shape.{k}={v}" for k, v in width.items())]
    client, parent, runs = run_sweep(tmp_path, args, timeout=1500)
    points = {name: r.data for name, r in runs.items()}
    assert len(points) == 4
    int4_runs = "avx512_bf16" in hardware.cpu_flags()
    for name, r in points.items():
        if "int4" in name and not int4_runs:
            assert r.tags["quantlab.outcome"] == "skipped" and "AVX512_BF16" in r.tags["quantlab.reason"]
            continue
        assert r.tags["quantlab.outcome"] == "finished", (name, r.tags.get("quantlab.reason"))
        assert r.tags["model.random_weights"] == "true" and r.metrics["lat/tpot_ms_p50"] > 0
        assert r.metrics["vllm/ready_s"] > 0 and "fid/kl_mean" not in r.metrics
    assert "| vllm | bf16 | 2 |" in report_text(client, parent, tmp_path)  # the cost-by-size fit over both shapes


def _run(name: str, metrics: dict[str, float]):
    from quantlab import tracking
    from quantlab.records import PointRecord

    tags = {tracking.OUTCOME_TAG: "finished", "model": "m", "scheme": "bf16", "target.variant": "cpu"}
    return PointRecord(name, name, metrics=metrics, tags=tags)


def test_cost_by_context_splits_the_tpot_rise_into_cache_bytes_and_the_rest(tmp_path):
    """TPOT rises 4 ms from a 128- to a 2,048-token prompt while the cache grows
    by 60 MiB; at the host's measured 30 GB/s, 60 MiB take 2.10 ms."""
    from quantlab.metric_names import SectionView
    from quantlab.probes import roofline_report

    def context_section(runs, out):
        return roofline_report.by_context(SectionView(runs, out, "t", lambda r, name: None))
    m = {"lat/batch_size": 1.0, "lat/prompt_tokens": 128.0, "lat/ttft_ms_p50": 100.0, "lat/tpot_ms_p50": 20.0,
         "mem/kv_mb": 4.0, "cell/b1_p2048/ttft_ms_p50": 2000.0, "cell/b1_p2048/tpot_ms_p50": 24.0,
         "cell/b1_p2048/kv_mb": 64.0, "size/weight_bytes": 3e8, "bw/achieved_gb_s": 15.0, "bw/util": 0.5,
         "bw/peak_gb_s": 30.0}
    text, files = context_section([_run("a", m)], tmp_path)
    assert files == ["context.png"] and (tmp_path / "context.png").stat().st_size > 0
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert row == f"| a | cpu | 100.0 | 20.0 | 2000.0 | 24.0 | 4.00 | {60 * 2**20 / 30e9 * 1e3:.2f} | 64 |"
    served = {k: (0.0 if k.endswith("kv_mb") else v) for k, v in m.items()}  # vLLM's server: no cache size
    row = next(line for line in context_section([_run("v", served)], tmp_path)[0].splitlines()
               if line.startswith("| v |"))
    assert row.endswith("| 4.00 | - | - |")
    one = dict(m)
    for k in [k for k in one if k.startswith("cell/")]:
        del one[k]
    assert context_section([_run("b", one)], tmp_path) == ("", [])  # one prompt length: no section


def test_a_prompt_longer_than_the_shape_holds_is_refused_in_one_line(tmp_path):
    out = run_cli(["model=shape", "model.shape.name=smollm2-135m", "probe=latency",
                   "probe.latency.grid_prompt_tokens=[128,8192]", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "quantlab: invalid config: probe.latency (prompt_tokens + new_tokens) needs 8224 tokens of context; "
        "model.shape.name=smollm2-135m holds 8192 (its max_position_embeddings): shorten the probe or pick a "
        "longer shape")


def test_the_context_sweep_at_tiny_widths_reports_cost_by_context(tmp_path):
    """+sweep=context's four points (bf16 and int4 on torch CPU and llama.cpp)
    at tiny widths and short prompts: TPOT per prompt length in each run, the
    report's cost-by-context table and plot on the parent."""
    pytest.importorskip("llama_cpp")
    args = ["-m", "+sweep=context", "probe.latency.grid_prompt_tokens=[16,64]", "probe.latency.prompt_tokens=16",
            "probe.latency.new_tokens=4", "probe.latency.repeats=1",
            f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/art",
            *(f"model.shape.{k}={v}" for k, v in TINY.items())]
    client, parent, points = run_sweep(tmp_path, args)
    assert set(points) == {f"qwen2.5-0.5b-random:{s}@{t}" for s in ("bf16", "int4-g32-sym")
                           for t in ("cpu", "llamacpp")}
    for r in points.values():
        assert r.data.tags["quantlab.outcome"] == "finished", r.data.tags
        assert r.data.metrics["cell/b1_p64/tpot_ms_p50"] > 0 and r.data.metrics["cell/b1_p64/kv_mb"] > \
            r.data.metrics["mem/kv_mb"] > 0
    text = report_text(client, parent, tmp_path)
    assert "Cost by context" in text and "| qwen2.5-0.5b-random:int4-g32-sym@llamacpp | llamacpp |" in text
    assert "context.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
