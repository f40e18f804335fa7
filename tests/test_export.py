"""Export: checkpoints transformers reloads, round trip enforced, atomic, no overwrite, registry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file, save_file

from quantlab import models, point
from quantlab import export_run as run
from quantlab.export import checkpoint, formats, roundtrip
from quantlab.errors import UserError
from quantlab.pipeline import run_point
from tests.conftest import REPO, compose_cfg, tracker


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("exp")
    uri = f"sqlite:///{d}/m.db"
    ids = {}
    recipe = d / "recipe.yaml"
    recipe.write_text(MIXED_RECIPE)
    for scheme in ("int8", "int4-g32", "int4-g32-sym", "fp8-e4m3", "fp8-w8a8", "bf16", "awq-g32", "w8a8-sq",
                   f"mixed scheme.weights.recipe={recipe}"):
        cfg = compose_cfg(["model=tiny", *f"scheme/weights={scheme}".split(), f"tracking.uri={uri}",
                           f"tracking.artifact_root={d}/a", "probe.latency.repeats=1", "probe.latency.stages=false",
                           "probe.cache.enabled=false"])
        ids[scheme.split()[0]] = run_point(cfg).run_id
    return MlflowClient(uri), ids, d


# int4-g64 by default; one layer int8, one int4-g32, one kept in bf16
MIXED_RECIPE = """name: t
default: int4-g64
layers:
  model.layers.0.mlp.down_proj: int8
  model.layers.0.self_attn.q_proj: int4-g32
  model.layers.1.mlp.up_proj: bf16
"""


@pytest.mark.parametrize("scheme,fmt", [("int8", "compressed-tensors/pack-quantized"),
                                        ("int4-g32", "compressed-tensors/pack-quantized"),
                                        ("int4-g32-sym", "compressed-tensors/pack-quantized"),
                                        ("awq-g32", "compressed-tensors/pack-quantized"),
                                        ("w8a8-sq", "compressed-tensors/int-quantized"),
                                        ("mixed", "compressed-tensors/pack-quantized"),
                                        ("fp8-e4m3", "compressed-tensors/float-quantized"),
                                        ("fp8-w8a8", "compressed-tensors/float-quantized"),
                                        ("bf16", "hf-bfloat16")])
def test_export_reloads_with_same_greedy_text(store, scheme, fmt, tmp_path):
    client, ids, _ = store
    out = tmp_path / scheme
    manifest = run.export_run(tracker(client.tracking_uri).run(ids[scheme]), out)
    assert manifest["format"] == fmt
    rt = manifest["round_trip"]
    assert rt["passed"] and rt["kl_mean"] < 1e-4
    # The greedy text is compared for information: the tiny random model's near-tied logits can flip
    # between the packed kernel and the dense reload (awq-g32 here; SmolLM2's exports all match).
    assert rt["greedy_match"] or scheme == "awq-g32"
    written = json.loads((out / "quantlab.json").read_text())
    assert written["source_run_id"] == ids[scheme]
    assert set(written["files_sha256"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not list(tmp_path.glob(".*tmp*"))
    tags = client.get_run(ids[scheme]).data.tags
    assert tags["export.round_trip"] == "passed" and tags["export.format"] == fmt
    if fmt.startswith("compressed"):
        group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
        acts = group["input_activations"]
        if scheme in ("fp8-w8a8", "w8a8-sq"):  # its activation quantization travels with it
            kind = "float" if scheme == "fp8-w8a8" else "int"
            assert (acts["type"], acts["num_bits"], acts["strategy"], acts["dynamic"]) == (kind, 8, "token", True)
        else:
            assert acts is None


def test_mixed_export_has_a_group_per_candidate(store, tmp_path):
    """Each candidate's layers, and only those, in a config group of that
    candidate's format; the bf16 layer stays dense; the reload computes the
    point's own function (KL to the dense twin < 1e-4)."""
    client, ids, _ = store
    out = tmp_path / "mixed"
    manifest = run.export_run(tracker(client.tracking_uri).run(ids["mixed"]), out)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "pack-quantized"  # int8 and int4 groups share compressed-tensors' format
    groups = {(g["format"], g["weights"]["num_bits"], g["weights"].get("block_structure") and
               g["weights"]["block_structure"][1]): set(g["targets"]) for g in qcfg["config_groups"].values()}
    assert groups[("pack-quantized", 8, None)] == {"model.layers.0.mlp.down_proj"}
    assert groups[("pack-quantized", 4, 32)] == {"model.layers.0.self_attn.q_proj"}
    g64 = groups[("pack-quantized", 4, 64)]
    assert len(groups) == 3 and "model.layers.1.mlp.down_proj" in g64
    assert not any("model.layers.1.mlp.up_proj" in t for t in groups.values())
    tensors = load_file(out / "model.safetensors")
    assert _unpacked(tensors, "model.layers.0.mlp.down_proj", 8).dtype == torch.int8
    assert tensors["model.layers.1.mlp.up_proj.weight"].is_floating_point()
    assert manifest["round_trip"]["passed"] and manifest["round_trip"]["kl_mean"] < 1e-4


def _unpacked(tensors: dict, module: str, bits: int) -> torch.Tensor:
    """The integers of a ``pack-quantized`` module (``weight_packed``, int32)."""
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    packed = tensors[f"{module}.weight_packed"]
    assert packed.dtype == torch.int32
    return unpack_from_int32(packed, bits, torch.Size(tensors[f"{module}.weight_shape"].tolist()))


def test_export_holds_the_same_integers(store, tmp_path):
    """The int8 checkpoint (pack-quantized, four to an int32) stores exactly
    the integers the point computed with."""
    from quantlab.compose import config_from_dict
    from quantlab.export_run import rebuild
    import yaml

    client, ids, d = store
    out = tmp_path / "int8"
    run.export_run(tracker(client.tracking_uri).run(ids["int8"]), out)
    stored = _unpacked(load_file(out / "model.safetensors"), "model.layers.0.mlp.down_proj", 8)
    cfg = config_from_dict(yaml.safe_load(Path(client.download_artifacts(ids["int8"], "config.yaml", str(tmp_path))).read_text()))
    model, _, _ = rebuild(cfg, *models.load(cfg.model, cfg.cache_dir))
    assert torch.equal(stored, model.model.layers[0].mlp.down_proj.qweight)


def test_w8a8_reload_quantizes_its_activations(store, tmp_path, monkeypatch):
    """transformers applies the exported dynamic per-token FP8 input
    quantization: once per quantized linear per forward."""
    import compressed_tensors.quantization.lifecycle.forward as ct_forward
    from transformers import AutoModelForCausalLM

    client, ids, _ = store
    run.export_run(tracker(client.tracking_uri).run(ids["fp8-w8a8"]), tmp_path / "w8a8")
    calls = []
    real = ct_forward.forward_quantize

    def spy(module, value, base_name, args):
        calls.append((base_name, args.strategy, args.dynamic))
        return real(module, value, base_name, args)

    monkeypatch.setattr(ct_forward, "forward_quantize", spy)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "w8a8")
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]))
    linears = 7 * model.config.num_hidden_layers
    assert calls.count(("input", "token", True)) == linears


def test_asymmetric_int4_is_packed_with_the_points_own_integers(store, tmp_path):
    """Four bits a weight on disk (eight to an int32), and the very integers and
    zero points the point's kernel computes with; the zero points packed too
    (``group``, the layout vLLM reads); a plain ``from_pretrained(path)`` in
    a fresh process reads it (``dequantize: true`` in the checkpoint's own
    config: transformers' compressed path cannot read packed zero points)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from quantlab.compose import config_from_dict
    from quantlab.export_run import rebuild
    import yaml

    client, ids, _ = store
    out = tmp_path / "int4"
    run.export_run(tracker(client.tracking_uri).run(ids["int4-g32"]), out)
    t = load_file(out / "model.safetensors")
    packed, zp = t["model.layers.0.mlp.down_proj.weight_packed"], t["model.layers.0.mlp.down_proj.weight_zero_point"]
    cfg = config_from_dict(yaml.safe_load(Path(client.download_artifacts(ids["int4-g32"], "config.yaml",
                                                                         str(tmp_path))).read_text()))
    model, _, _ = rebuild(cfg, *models.load(cfg.model, cfg.cache_dir))
    q, scale, zero_point = model.model.layers[0].mlp.down_proj.int_weights()
    assert packed.dtype == torch.int32 and packed.numel() * 8 == q.numel()
    assert torch.equal(unpack_from_int32(packed, 4, q.shape).to(torch.int32), (q - 8).to(torch.int32))
    assert zp.dtype == torch.int32 and zp.numel() * 8 == zero_point.numel()
    assert torch.equal(unpack_from_int32(zp, 4, zero_point.shape, packed_dim=0).to(torch.int32),
                       (zero_point - 8).to(torch.int32))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["strategy"] == "group"
    manifest = json.loads((out / "quantlab.json").read_text())
    assert manifest["transformers_load"]["quantization_config"] == {"dequantize": True}
    assert json.loads((out / "config.json").read_text())["quantization_config"]["dequantize"] is True
    assert manifest["round_trip"]["passed"]  # reloaded plainly, in a fresh process
    plain = subprocess.run([sys.executable, "-c", "import sys; from transformers import AutoModelForCausalLM; "
                            "AutoModelForCausalLM.from_pretrained(sys.argv[1])", str(out)],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert t["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.bfloat16
    assert torch.equal(t["model.layers.0.mlp.down_proj.weight_scale"].float(), scale)


def test_corrupted_tensor_fails_round_trip_and_writes_nothing(store, tmp_path, monkeypatch):
    client, ids, _ = store
    real = checkpoint.write

    def corrupt(model, tok, spec, dense, dest, kv=None):
        fmt = real(model, tok, spec, dense, dest, kv)
        f = dest / "model.safetensors"
        t = load_file(f)
        for key in [k for k in t if k.endswith("weight_scale")]:  # a sign-flipped, inflated scale
            t[key] = t[key] * -8
        save_file(t, f, metadata={"format": "pt"})
        return fmt

    monkeypatch.setattr(checkpoint, "write", corrupt)
    with pytest.raises(UserError, match="round trip failed: reload vs the point.s dequantized weights: KL"):
        run.export_run(tracker(client.tracking_uri).run(ids["int4-g32"]), tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.tmp-*"))
    assert client.get_run(ids["int4-g32"]).data.tags["export.round_trip"] == "failed"


def test_interrupted_export_leaves_no_half_directory(store, tmp_path, monkeypatch):
    client, ids, _ = store

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(roundtrip, "verify_in_fresh_process", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.export_run(tracker(client.tracking_uri).run(ids["int8"]), tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_without_force(store, tmp_path):
    client, ids, _ = store
    out = tmp_path / "keep"
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    with pytest.raises(UserError, match="exists; pass --force"):
        run.export_run(tracker(client.tracking_uri).run(ids["int8"]), out)
    assert (out / "mine.txt").read_text() == "precious"
    run.export_run(tracker(client.tracking_uri).run(ids["int8"]), out, force=True)
    assert not (out / "mine.txt").exists() and (out / "quantlab.json").is_file()


def test_registry_entry_created_with_metric_tags(store, tmp_path):
    client, ids, _ = store
    run.export_run(tracker(client.tracking_uri).run(ids["int4-g32"]), tmp_path / "reg", register="quantlab-tiny")
    (mv,) = client.search_model_versions("name='quantlab-tiny'")
    assert mv.run_id == ids["int4-g32"] and mv.tags["scheme"] == "int4-g32"
    assert "fid/kl_mean" in mv.tags and mv.tags["format"] == "compressed-tensors/pack-quantized"
    assert "export/quantlab.json" in {a.path for a in client.list_artifacts(ids["int4-g32"], "export")}


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quantlab.export", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    return proc, time.perf_counter() - t0


def test_bad_export_input_fails_in_one_line_within_two_seconds(store, tmp_path):
    """Each refusal: exit 2, one line on stderr, in under 2 s (before torch,
    MLflow or a model load), and nothing written."""
    client, ids, d = store
    uri = client.tracking_uri
    (tmp_path / "taken").mkdir()
    nf4 = client.get_run(ids["int8"])  # a point whose scheme has no checkpoint format, as nf4 records it
    client.set_tag(nf4.info.run_id, point.exportable_tag("checkpoint"), "no: nf4 has no checkpoint representation")
    try:
        cases = {
            ("--run", "0" * 32): f"no run '{'0' * 32}' in this store",
            ("--sweep", "nope"): "no sweep 'nope' in this store",
            ("--run", ids["int8"], "--out", str(tmp_path / "taken")): "taken exists; pass --force to replace it",
            ("--run", ids["int8"]): "--out DIR is required",
            ("--run", ids["int8"], "--format", "checkpoint"): "checkpoint export of int8 is not supported (nf4 has",
            ("--run", ids["fp8-e4m3"], "--format", "gguf"): "gguf export of fp8-e4m3 is not supported (fp8-e4m3 has "
                                                             "no GGUF type",
        }
        for args, message in cases.items():
            argv = [*args, "--tracking-uri", uri] + ([] if "--out" in args or "required" in message
                                                       else ["--out", str(tmp_path / "o")])
            proc, seconds = _cli(*argv)
            err = proc.stderr.strip()
            assert proc.returncode == 2 and len(err.splitlines()) == 1, (args, proc.stderr[-1500:])
            assert err.startswith("quantlab.export: ") and message in err, (args, err)
            assert seconds < 2.0, (args, seconds)
        assert not (tmp_path / "o").exists()
    finally:
        client.set_tag(nf4.info.run_id, point.exportable_tag("checkpoint"), "compressed-tensors/int-quantized")


def test_points_record_what_they_export_as(store):
    client, ids, _ = store
    tags = {s: client.get_run(ids[s]).data.tags for s in ids}
    assert tags["int4-g32"]["exportable.checkpoint"] == "compressed-tensors/pack-quantized"
    assert tags["int8"]["exportable.gguf"] == "gguf/Q8_0"
    assert tags["bf16"]["exportable.checkpoint"] == "hf-bfloat16"
    assert tags["int4-g32"]["exportable.gguf"] == "gguf/Q4_1"
    assert tags["fp8-e4m3"]["exportable.gguf"].startswith("no: fp8-e4m3 has no GGUF type")
    from quantlab.schemes.fp8 import FP8Scheme

    e5m2 = formats.exportable_tags(FP8Scheme(format="e5m2"))["exportable.checkpoint"]
    assert e5m2.startswith("no: compressed-tensors FP8 is E4M3 only")
    from quantlab.schemes.bnb4 import BnB4Scheme

    nf4 = formats.exportable_tags(BnB4Scheme())["exportable.checkpoint"]
    assert nf4.startswith("no: nf4 checkpoints are not built yet")


def test_export_copies_into_artifacts_only_when_registering(store, tmp_path, monkeypatch):
    client, ids, _ = store
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    run.export_run(tracker(client.tracking_uri).run(ids["int8"]), tmp_path / "plain")
    assert not client.list_artifacts(ids["int8"], "export")
    assert list(scratch.iterdir()) == []  # no temp file left behind


def test_export_by_sweep_and_budget_after_reuse(tmp_path):
    """The second sweep reuses the float points of the first; its recommendation
    is stored as a run id and `--sweep NAME --budget B` exports the run that
    measured it. A budget with no recommendation lists those that have one."""
    from tests.conftest import run_cli

    uri = f"sqlite:///{tmp_path}/m.db"
    store = [f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a", "probe.latency.repeats=1",
             "probe.cache.enabled=false", "model=tiny", "eval_seed=0"]  # one draw: the second reuses the first's
    assert run_cli(["-m", "scheme/weights=fp32,bf16", "sweep_name=first", *store]).returncode == 0
    second = run_cli(["-m", "scheme/weights=fp32,bf16,int8", "sweep_name=second", *store])
    assert second.returncode == 0 and second.stdout.count("| reused") == 2
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("quantlab").experiment_id
    parent = client.search_runs([exp], "tags.`quantlab.sweep` = 'second' and tags.`quantlab.role` = 'sweep'")[0]
    chosen = client.get_run(parent.data.tags["recommended.0.05.run_id"])
    assert chosen.info.run_name == parent.data.tags["recommended.0.05"]
    cmd = [sys.executable, "-m", "quantlab.export", "--tracking-uri", uri, "--sweep", "second"]
    ok = subprocess.run([*cmd, "--budget", "0.05", "--out", str(tmp_path / "best")], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    manifest = json.loads((tmp_path / "best" / "quantlab.json").read_text())
    measured = chosen.data.tags.get("quantlab.reused_from", chosen.info.run_id)
    assert manifest["source_run_id"] == measured
    bad = subprocess.run([*cmd, "--budget", "0.02", "--out", str(tmp_path / "x")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    # fp32 loses exactly 0 against itself (fid/identical), so every declared budget has a pick
    assert bad.returncode == 2 and "budgets with one: 0.01, 0.05" in bad.stderr.strip().splitlines()[-1]


def test_an_export_that_lost_its_quantization_fails_the_round_trip(store, tmp_path, monkeypatch):
    """Weights replaced by the float model's: the reload no longer equals the
    point's dequantized weights, and nothing is written."""
    client, ids, _ = store

    def float_instead(model, tok, spec, dense, dest, kv=None):  # dense: the float model, before quantization
        dense.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
        tok.save_pretrained(dest)
        return "hf-bfloat16"

    monkeypatch.setattr(checkpoint, "write", float_instead)
    # int4 (the tiny random model's int8 error is below the 1e-4 tolerance: there a
    # float reload is as faithful as any)
    with pytest.raises(UserError, match="round trip failed"):
        run.export_run(tracker(client.tracking_uri).run(ids["int4-g32"]), tmp_path / "lost")
    assert not (tmp_path / "lost").exists()


def test_round_trip_verdict_needs_both_gates():
    ok = {"kl_mean": 1e-6, "max_abs_diff": 1e-3, "kl_from_float": 4e-3}
    assert roundtrip.round_trip_verdict(ok, point_from_float=4.4e-3)["passed"]
    # equal to the point within tolerance, but as close to float as a float reload would be
    lost = {**ok, "kl_from_float": 1e-5}
    v = roundtrip.round_trip_verdict(lost, point_from_float=4.4e-3)
    assert not v["passed"] and "is the float model" in v["why"]
    far = {**ok, "kl_mean": 2e-3}
    assert "dequantized weights" in roundtrip.round_trip_verdict(far, 4.4e-3)["why"]
    assert roundtrip.round_trip_verdict({**ok, "kl_from_float": 0.0}, point_from_float=0.0)["passed"]  # float point


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_calibrated_fp8_kv_scales_travel_in_the_export(tmp_path, weights):
    """An fp8-cal point's export holds ``kv_cache_scheme`` (static per-tensor
    FP8, symmetric) and one ``k_scale``/``v_scale`` per attention layer, each
    the largest key/value the point writes into its cache over the calibration
    windows, over 448 (E4M3's top): recomputed here from the keys and values a
    plain ``DynamicCache`` holds. A float checkpoint gets a compressed-tensors
    config with no weight groups; the quantized one keeps its group. The round
    trip (transformers' reload) passes."""
    from transformers.cache_utils import DynamicCache

    from quantlab import calibration, hardware
    from quantlab.schemes.registry import ApplyContext

    uri = f"sqlite:///{tmp_path}/m.db"
    cfg = compose_cfg(["model=tiny", f"scheme/weights={weights}", "scheme/kv=fp8-cal", "scheme.kv.n_samples=4",
                       "scheme.kv.seq_len=64", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a",
                       "probe=smoke", "probe.latency.enabled=false", f"cache_dir={tmp_path}/c"])
    rid = run_point(cfg).run_id
    out = tmp_path / "out"
    manifest = run.export_run(tracker(uri).run(rid), out)
    assert manifest["round_trip"]["passed"], manifest["round_trip"]
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                       "dynamic": False}
    assert bool(qcfg["config_groups"]) == (weights == "int8")
    tensors = load_file(out / "model.safetensors")
    float_model, tok = models.load(cfg.model, cfg.cache_dir)
    model, _, _ = run.rebuild(cfg, float_model, tok, kv=False)
    ctx = ApplyContext(hw=hardware.cpu(), tokenizer=tok, cache_dir=cfg.cache_dir, data_dir=cfg.data_dir,
                       seed=cfg.seed)
    ids, _ = calibration.batch_or_builtin("wiki", "kvfp8-cal", ctx, 4, 64)
    k_max = torch.zeros(2)
    v_max = torch.zeros(2)
    with torch.no_grad():
        for row in ids:
            cache = DynamicCache()
            model(input_ids=row[None], past_key_values=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                k_max[i] = max(k_max[i], layer.keys.float().abs().max())
                v_max[i] = max(v_max[i], layer.values.float().abs().max())
    for i in range(2):
        for what, top in (("k", k_max[i]), ("v", v_max[i])):
            scale = tensors[f"model.layers.{i}.self_attn.{what}_scale"]
            assert scale.dtype == torch.float32 and scale.shape == (1,)
            assert float(scale) == pytest.approx(float(top) / 448.0, rel=1e-6)


def test_kv_scales_go_into_a_sharded_checkpoints_index(tmp_path):
    """A sharded checkpoint gets the scales in their own file, named in its
    index, which transformers follows (and ignores the scales)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    kv = {"kv_cache_scheme": {"num_bits": 8}, "tensors": {"model.layers.0.self_attn.k_scale": torch.tensor([0.5])}}
    checkpoint.write_kv_scales(tmp_path, kv)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.0.self_attn.k_scale"] == "kv_scales.safetensors"
    assert load_file(tmp_path / "kv_scales.safetensors")["model.layers.0.self_attn.k_scale"].item() == 0.5
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == {
        "num_bits": 8}
    assert not list(tmp_path.glob("model.safetensors"))  # the shards were left as they were
