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
from quantlab.export import formats, run
from quantlab.pipeline import run_point
from quantlab.schemes.fplinear import FormatLinear
from tests.conftest import compose_cfg, tracker

PRESETS = ("nvfp4", "nvfp4-a16", "mxfp4", "mxfp4-a16", "mxfp8", "fp8-block", "fp8-block64", "fp8-block-a16",
           "w4a8-g64")
EXPORTED = tuple(p for p in PRESETS if p != "fp8-block")  # the tiny model is 64 wide: see the refusal test
FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized",
          "fp8-block": "float-quantized", "fp8-block64": "float-quantized", "w4a8-g64": "pack-quantized"}


def quantized_tiny(preset: str):
    """``(point model, config)`` of ``preset`` on the tiny model, built as export rebuilds it."""
    cfg = compose_cfg(["model=tiny", f"scheme/weights={preset}"])
    model, _ = run.rebuild(cfg, *models.load(cfg.model, cfg.cache_dir))
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
    fmt = FORMAT[preset.removesuffix("-a16")]
    assert manifest["format"] == f"compressed-tensors/{fmt}"
    assert manifest["round_trip"]["passed"], manifest["round_trip"]
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qcfg["config_groups"]["group_0"]
    assert qcfg["format"] == fmt
    assert (group["input_activations"] is None) == preset.endswith("a16")

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
