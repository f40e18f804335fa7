"""The block-scaled formats end to end on the tiny model: a point per preset
(emulated, tagged, bits counted), its compressed-tensors export decompressed
by compressed-tensors to exactly the point's weights, reloaded by a plain
transformers ``from_pretrained`` (the round trip), and MXFP4 as a GGUF."""
from __future__ import annotations

import json

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from quantlab import models
from quantlab import export_run as run
from quantlab.export import formats
from quantlab.pipeline import run_point
from quantlab.schemes.fplinear import FormatLinear
from tests.conftest import compose_cfg, tracker

PRESETS = ("nvfp4", "nvfp4-a16", "nvfp4-a16-gptq", "mxfp4", "mxfp4-a16", "mxfp4-a16-gptq", "mxfp8", "fp8-block",
           "fp8-block64", "fp8-block-a16", "w4a8-g64")
EXPORTED = tuple(p for p in PRESETS if p != "fp8-block")  # the tiny model is 64 wide: see the refusal test
FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized",
          "fp8-block": "float-quantized", "fp8-block64": "float-quantized", "w4a8-g64": "pack-quantized"}


def quantized_tiny(preset: str):
    """``(point model, config)`` of ``preset`` on the tiny model, built as export rebuilds it."""
    cfg = compose_cfg(["model=tiny", f"scheme/weights={preset}"])
    model, _, _ = run.rebuild(cfg, *models.load(cfg.model, cfg.cache_dir))
    return model, cfg


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    d = tmp_path_factory.mktemp("fmt")
    uri = f"sqlite:///{d}/m.db"
    ids = {}
    for preset in PRESETS:
        cfg = compose_cfg(["model=tiny", f"scheme/weights={preset}", f"tracking.uri={uri}",
                           f"tracking.artifact_root={d}/a", "probe.latency.repeats=1", "probe.latency.stages=false",
                           "probe.cache.enabled=false"])
        ids[preset] = run_point(cfg).run_id
    return MlflowClient(uri), ids


@pytest.mark.parametrize("preset", PRESETS)
def test_point_is_emulated_and_counts_its_bits(points, preset):
    client, ids = points
    r = client.get_run(ids[preset])
    assert r.info.status == "FINISHED"
    assert r.data.tags["emulated"] == "true"
    assert r.data.tags["support"] == "emulated" and "GEMM" in r.data.tags["support.reason"]
    bits = r.data.metrics["size/bits_per_weight"]
    assert 4 < bits < 16  # embeddings (kept in bf16) and norms pull the whole model's figure above the format's
    assert r.data.metrics["fid/kl_mean"] > 0


@pytest.mark.parametrize("preset", EXPORTED)
def test_export_decompresses_to_the_points_weights_and_reloads(points, preset, tmp_path):
    """compressed-tensors' own decompressor reads back exactly the weights the
    point computed with; the fresh-process transformers reload passes the round trip."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    client, ids = points
    out = tmp_path / preset
    manifest = run.export_run(tracker(client.tracking_uri).run(ids[preset]), out)
    fmt = FORMAT[preset.removesuffix("-gptq").removesuffix("-a16")]
    assert manifest["format"] == f"compressed-tensors/{fmt}"
    assert manifest["round_trip"]["passed"], manifest["round_trip"]
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qcfg["config_groups"]["group_0"]
    assert qcfg["format"] == fmt
    assert (group["input_activations"] is None) == ("a16" in preset)

    point, _ = quantized_tiny(preset)
    tensors = load_file(out / "model.safetensors")
    scheme = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(fmt)  # compressed-tensors' own reader of the format
    for name, mod in point.named_modules():
        if isinstance(mod, FormatLinear):
            own = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(f"{name}.")}
            got = compressor.decompress(own, scheme)["weight"]  # in the decompressor's own dtype (NVFP4: bf16)
            assert torch.equal(got, mod.dequantize().to(got.dtype)), name
    layer = "model.layers.0.mlp.down_proj"
    if preset.startswith("nvfp4"):
        assert tensors[f"{layer}.weight_scale"].dtype == torch.float8_e4m3fn
        assert tensors[f"{layer}.weight_global_scale"].dtype == torch.float32
        assert (f"{layer}.input_global_scale" in tensors) == (preset == "nvfp4")
    if preset.startswith("mx"):
        assert tensors[f"{layer}.weight_scale"].dtype == torch.uint8


def test_export_refuses_activation_groups_wider_than_a_layer(points, tmp_path):
    """fp8-block's dynamic activation groups of 128 on the 64-wide tiny model
    (SmolLM2's 576 alike): one line before anything is written."""
    from quantlab.errors import UserError

    client, ids = points
    with pytest.raises(UserError, match=r"activation groups of 128 do not divide the input widths \[64\]"):
        run.export_run(tracker(client.tracking_uri).run(ids["fp8-block"]), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_nvfp4_input_scales_come_from_calibration():
    """W4A4's per-tensor activation scale is 448 * 6 over the largest input the
    layer saw on the calibration windows; NVFP4A16 has none."""
    model, _ = quantized_tiny("nvfp4")
    scales = [m.input_global_scale.item() for m in model.modules() if isinstance(m, FormatLinear)]
    assert len(set(scales)) > 1 and all(0 < s < float("inf") for s in scales)
    weight_only, _ = quantized_tiny("nvfp4-a16")
    assert not any(hasattr(m, "input_global_scale") for m in weight_only.modules() if isinstance(m, FormatLinear))


def test_mxfp4_gguf_holds_the_points_codes(tmp_path):
    from gguf import GGUFReader

    from quantlab.export import gguf

    model, _ = quantized_tiny("mxfp4-a16")
    tok = models.load(compose_cfg(["model=tiny"]).model, "~/.cache/quantlab")[1]
    counts = gguf.write(model, tok, tmp_path / "m.gguf")
    assert counts["MXFP4"] == 7 * model.config.num_hidden_layers
    reader = GGUFReader(str(tmp_path / "m.gguf"))
    t = {x.name: x for x in reader.tensors}["blk.0.ffn_down.weight"]
    mod = model.model.layers[0].mlp.down_proj
    got = gguf.dequantize(t.data, "MXFP4", (mod.out_features, mod.in_features))
    assert torch.equal(got, mod.dequantize())


def test_formats_refuse_widths_their_groups_do_not_divide():
    from quantlab.errors import UserError

    cfg = compose_cfg(["model=tiny", "model.tiny.hidden_size=48", "model.tiny.intermediate_size=80",
                       "scheme/weights=mxfp4"])
    with pytest.raises(UserError, match="group_size 32 does not divide"):
        run.rebuild(cfg, *models.load(cfg.model, cfg.cache_dir))


def test_capabilities_list_the_formats_as_emulated_on_cpu():
    from quantlab import hardware
    from quantlab.schemes import registry
    from quantlab.schemes.configs import FP8BlockScheme, MXScheme, NVFP4Scheme, W4A8Scheme

    for cfg in (NVFP4Scheme(), MXScheme(), FP8BlockScheme(), W4A8Scheme()):
        s = registry.weights_handler(cfg).support(cfg, hardware.cpu())
        assert s.status == "emulated" and "GEMM" in s.reason
    assert formats.exportable_tags(MXScheme(activations="none"))["exportable.gguf"] == "gguf/MXFP4"


def test_a_mixed_recipe_takes_block_scaled_candidates(tmp_path):
    """A recipe may give a layer NVFP4 / MXFP4 / MXFP8 / FP8-block weights:
    the point is emulated (said before loading), counts each layer's bits,
    and exports a config group per candidate in that format's own layout."""
    from quantlab import hardware
    from quantlab.export import checkpoint
    from quantlab.schemes import registry
    from quantlab.schemes.fplinear import MXLinear, NVFP4Linear

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: f\ndefault: int4-g64\nlayers:\n  model.layers.0.mlp.down_proj: nvfp4-a16\n"
                      "  model.layers.1.mlp.up_proj: mxfp4-a16\n")
    cfg = compose_cfg(["model=tiny", "scheme/weights=mixed", f"scheme.weights.recipe={recipe}"])
    w = cfg.scheme.weights
    assert registry.weights_handler(w).support(w, hardware.cpu()).status == "emulated"
    model, tok = models.load(cfg.model, cfg.cache_dir)
    dense, _ = models.load(cfg.model, cfg.cache_dir)
    applied = registry.weights_handler(w).apply(model, w, registry.ApplyContext(hw=hardware.cpu(), tokenizer=tok))
    assert applied.emulated
    assert isinstance(model.model.layers[0].mlp.down_proj, NVFP4Linear)
    assert isinstance(model.model.layers[1].mlp.up_proj, MXLinear)
    checkpoint.write(model, tok, formats.mapping("checkpoint", w), dense, tmp_path / "out")
    qcfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    by_format = {g["format"]: g["targets"] for g in qcfg["config_groups"].values()}
    assert by_format["nvfp4-pack-quantized"] == ["model.layers.0.mlp.down_proj"]
    assert by_format["mxfp4-pack-quantized"] == ["model.layers.1.mlp.up_proj"]
    assert qcfg["format"] == "mixed-precision"


def test_the_assumed_gpu_column_says_where_vllm_has_the_kernels():
    from quantlab.hardware import Hardware
    from quantlab.schemes import registry
    from quantlab.schemes.configs import FP8BlockScheme, NVFP4Scheme

    def reason(cfg, cc):
        return registry.weights_handler(cfg).support(cfg, Hardware(device="cuda", name="x", cuda_capability=cc))

    assert reason(NVFP4Scheme(), (9, 0)).status == "emulated"
    assert "need sm_100 or newer" in reason(NVFP4Scheme(), (9, 0)).reason
    assert "reaches sm_100" in reason(NVFP4Scheme(), (10, 0)).reason
    assert "reaches sm_89" in reason(FP8BlockScheme(), (9, 0)).reason


def test_per_head_fp8_kv_scales_are_calibrated_and_exported(tmp_path):
    """kvfp8-head: one E4M3 scale per KV head (keys and values apart), each the
    largest value that head writes over the calibration windows over 448;
    the cache saturates past it; the export carries compressed-tensors'
    ``attn_head`` scheme with ``[heads, 1, 1]`` scales and reloads."""
    from quantlab.schemes import kv as kvmod

    uri = f"sqlite:///{tmp_path}/m.db"
    cfg = compose_cfg(["model=tiny", "scheme/weights=bf16", "scheme/kv=fp8-head", "scheme.kv.n_samples=4",
                       "scheme.kv.seq_len=64", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a",
                       "probe=smoke", "probe.latency.enabled=false", f"cache_dir={tmp_path}/c"])
    assert cfg.scheme.kv.short_name() == "kvfp8-head" and cfg.scheme.kv.calibration_set() == "wiki"
    rid = run_point(cfg).run_id
    r = MlflowClient(uri).get_run(rid)
    assert r.data.tags["quantlab.outcome"] == "finished" and "per head" in r.data.tags["backend.kv"]
    manifest = run.export_run(tracker(uri).run(rid), tmp_path / "out")
    assert manifest["round_trip"]["passed"], manifest["round_trip"]
    qcfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"]["strategy"] == "attn_head"
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    heads = compose_cfg(["model=tiny"]).model.tiny.num_key_value_heads
    k = tensors["model.layers.0.self_attn.k_scale"]
    assert k.shape == (heads, 1, 1) and len(set(k.flatten().tolist())) == heads
    layer = kvmod.Fp8CalibratedLayer(k.view(1, -1, 1, 1), k.view(1, -1, 1, 1))
    big = torch.full((1, heads, 1, 8), 1e4)
    q, _ = layer._quantize(big, layer.k_scale)
    assert torch.isfinite(q.float()).all() and (q.float() == 448).all()  # saturated, not NaN


def test_nvfp4_kv_cache_stores_the_format_and_returns_its_values():
    """The NVFP4 cache holds packed codes, E4M3 scales per 16 of the head
    dimension and the prefill's per-tensor scale; what attention reads back is
    exactly NVFP4's rounding of every token under that scale (later tokens
    past it saturate), in 9/16 of a byte a value plus the two scales."""
    from quantlab.schemes import fpquant
    from quantlab.schemes.kv import NVFP4Layer, cache_bytes, cache_factory
    from quantlab.schemes.configs import NVFP4KV

    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(1, 2, 10, 64, generator=g), torch.randn(1, 2, 10, 64, generator=g)
    k1, v1 = 3 * torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
    layer = NVFP4Layer()
    layer.update(k0, v0)
    keys, _ = layer.update(k1, v1)
    gs = fpquant.nvfp4_global_scale(k0.abs().amax())
    want = fpquant.nvfp4_dequantize(*fpquant.nvfp4_quantize(torch.cat([k0, k1], -2), gs))
    assert torch.equal(keys, want)
    assert keys.shape == (1, 2, 11, 64)
    config = models.load(compose_cfg(["model=tiny"]).model, "~/.cache/quantlab")[0].config
    cache = cache_factory(NVFP4KV())(config=config)
    for layer_ in cache.layers:
        layer_.update(k0, v0)
    n = k0.numel()
    assert cache_bytes(cache) == len(cache.layers) * 2 * (n // 2 + n // 16 + 4)


def test_an_nvfp4_kv_point_runs_emulated(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    cfg = compose_cfg(["model=tiny", "scheme/weights=bf16", "scheme/kv=nvfp4", f"tracking.uri={uri}",
                       f"tracking.artifact_root={tmp_path}/a", "probe=smoke", "probe.latency.repeats=1",
                       f"cache_dir={tmp_path}/c"])
    r = MlflowClient(uri).get_run(run_point(cfg).run_id)
    assert r.data.tags["quantlab.outcome"] == "finished", r.data.tags.get("quantlab.reason")
    assert r.data.tags["emulated"] == "true" and r.info.run_name == "bf16+kvnvfp4@cpu"
