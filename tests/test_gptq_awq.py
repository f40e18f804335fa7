"""GPTQ and AWQ checkpoints measured as themselves (scheme/weights=as-is),
read without GPTQModel or AutoAWQ: artifacts in their layouts written by
benchmarks/gptq_artifact.py (from the layouts' description, not quantlab's
reader), read back from their metadata and tensors, rebuilt on the int4
kernel from their own integers. vLLM's own loaders reading the same
folders (the independent check of the layouts) are in
tests/test_artifacts.py's vLLM test."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import gptq_artifact
from quantlab import artifacts, gptq_awq, hardware, model_files, models, point
from quantlab.cli import to_point
from quantlab.probes import perplexity
from quantlab.schemes.qlinear import Int4Linear, dequantized
from quantlab.schemes.registry import weights_handler
from tests.conftest import SHARED_DATA, compose_cfg, run_cli, tracker
from tests.test_artifacts import _as_is

EXPECTED = {  # family, label, kernel
    "gptq-g32": ("gptq", "gptq-w4-g32", "int4"), "gptq-g64": ("gptq", "gptq-w4-g64", "int4"),
    "gptq-g32-asym": ("gptq", "gptq-w4-g32-asym", "int4"), "gptq-g32-v2": ("gptq", "gptq-w4-g32", "int4"),
    "gptq-g32-act-order": ("gptq", "gptq-w4-g32-act-order", "int4"),
    "gptq-w8-g32": ("gptq", "gptq-w8-g32", "dequantized"),
    "awq-g32": ("awq", "awq-w4-g32", "int4"), "awq-g64": ("awq", "awq-w4-g64", "int4"),
}


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """``{kind: directory}`` for every kind above, plus ``float``: the tiny
    model they were made from."""
    root = tmp_path_factory.mktemp("gptq")
    model, tok = models.load(compose_cfg(["model=tiny"]).model, "~/.cache/quantlab")
    model.save_pretrained(root / "float")
    tok.save_pretrained(root / "float")
    return {"float": root / "float", **{k: gptq_artifact.write(model, tok, k, root / k) for k in EXPECTED}}


def _hf(path):
    return compose_cfg(["model=hf", f"model.path={path}"]).model


def _expected_weights(art, kind):
    """``{linear: fp32 weight}`` the writer's integers stand for, computed
    from the float model as the writer rounds it: ``(q - zero) * scale``."""
    method, bits, g, sym, act_order, _ = gptq_artifact.KINDS[kind]
    model = models.load(_hf(art["float"]), "~")[0]
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, lin in model.named_modules():
        if not isinstance(lin, torch.nn.Linear) or name == "lm_head":
            continue
        k = lin.in_features
        order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        group = torch.empty(k, dtype=torch.long)
        group[order] = torch.arange(k) // g
        q, zero, scale = gptq_artifact._rtn(lin.weight.detach().float(), group, k // g, bits, sym)
        out[name] = ((q.float() - zero.float()[group]) * scale.half().float()[group]).t()
    return out


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), axis=st.sampled_from([0, 1]), rows=st.integers(1, 5), cols=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_words_unpack_to_the_values_packed(bits, axis, rows, cols, seed):
    """The reader's unpacking inverts the writer's packing for any shape
    and value: 32 / bits values a word, along rows or columns."""
    per = 32 // bits
    shape = (rows * per, cols) if axis == 0 else (rows, cols * per)
    values = np.random.default_rng(seed).integers(0, 2 ** bits, size=shape)
    words = torch.from_numpy(gptq_artifact._pack(values, bits, axis))
    assert torch.equal(gptq_awq._unpack(words, bits, axis), torch.from_numpy(values).int())


def test_metadata_names_each_artifact(art):
    for kind, (family, label, kernel) in EXPECTED.items():
        a = artifacts.read(_hf(art[kind]))
        assert (a.family, a.label, a.kernel, a.unsupported) == (family, label, kernel, ""), kind
    assert artifacts.read(_hf(art["gptq-g32-act-order"])).description == \
        "GPTQ 4-bit, groups of 32, activation order"
    assert artifacts.read(_hf(art["awq-g32"])).description == "AWQ 4-bit, groups of 32, zero points"


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_loaded_weights_are_what_the_integers_stand_for(art, kind):
    """The model as loaded holds each packed Linear dequantized, exactly
    the writer's ``(q - zero) * scale`` (fp32: bit-equal), whatever the
    layout (v1's zero - 1, v2, AWQ's column order, 8 bits, activation order)."""
    model, _ = models.load(_hf(art[kind]), "~")
    want = _expected_weights(art, kind)
    got = {n: m.weight for n, m in model.named_modules() if n in want}
    assert len(got) == 14
    for name, w in want.items():
        torch.testing.assert_close(got[name].float(), w, rtol=0, atol=0, msg=f"{kind} {name}")
    plain = models.load(_hf(art["float"]), "~")[0]
    torch.testing.assert_close(model.lm_head.weight, plain.lm_head.weight, rtol=0, atol=0)


def test_weights_counted_unpacked(art):
    n_float = model_files.parameters(_hf(art["float"]))
    for kind in EXPECTED:
        assert model_files.parameters(_hf(art[kind])) == n_float, kind
    bits = model_files.safetensors_size(art["awq-g32"])["size/bits_per_weight"]
    float_share = sum(p.numel() for n, p in models.load(_hf(art["float"]), "~")[0].named_parameters()
                      if "proj" not in n) / n_float
    # fp32 embeddings/head/norms; 4 bits + an fp16 scale and a 4-bit zero per 32 for the projections
    assert bits == pytest.approx(32 * float_share + (4 + (16 + 4) / 32) * (1 - float_share), rel=1e-6)


@pytest.mark.parametrize("kind", ["gptq-g32", "gptq-g32-asym", "gptq-g32-v2", "awq-g64"])
def test_as_is_layers_run_the_checkpoints_integers_on_the_int4_kernel(art, kind):
    cfg, model, dense, applied = _as_is(art[kind], art["float"], "float32")
    rebuilt = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(rebuilt) == 14 and not applied.emulated
    assert applied.backend == "aten._weight_int4pack_mm_for_cpu" and applied.tags["artifact.dequantized_layers"] == "0"
    for name, mod in rebuilt.items():
        torch.testing.assert_close(dequantized(mod), dense[name].float(), rtol=0, atol=1e-6)
    assert cfg.scheme.weights.short_name() == f"as-is-{EXPECTED[kind][1]}"
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    plain = models.load(_hf(art[kind]), "~")[0]
    with torch.no_grad():
        a, b = model(ids).logits.log_softmax(-1), plain(ids).logits.log_softmax(-1)
    assert torch.nn.functional.kl_div(a, b, log_target=True, reduction="batchmean").item() < 1e-6


def test_layers_in_activation_order_stay_dequantized_and_the_point_says_so(art):
    """A GPTQ layer whose groups are not contiguous (activation order)
    keeps its dequantized weight, and the point is emulated, saying how many
    layers; 8-bit GPTQ groups have no quantlab kernel: emulated from launch."""
    _, model, _, applied = _as_is(art["gptq-g32-act-order"], art["float"], "float32")
    assert applied.emulated and not any(isinstance(m, Int4Linear) for m in model.modules())
    assert applied.backend.endswith("(14 layers dequantized)") and applied.tags["artifact.dequantized_layers"] == "14"
    cfg, model, _, applied = _as_is(art["gptq-w8-g32"], art["float"], "float32")
    assert applied.emulated and not any(isinstance(m, Int4Linear) for m in model.modules())
    assert weights_handler(cfg.scheme.weights).support(cfg.scheme.weights, hardware.cpu()).status == "emulated"


def test_unreadable_layouts_are_refused_in_one_line(art, tmp_path):
    def refused(path, ref=art["float"]):
        with pytest.raises(Exception) as e:
            to_point(compose_cfg(["model=hf", f"model.path={path}", "scheme/weights=as-is",
                                  f"reference.path={ref}"], to_object=False))
        assert "\n" not in str(e.value)
        return str(e.value)

    for i, (kind, change, words) in enumerate((
            ("gptq-g32", {"bits": 3}, "a 3-bit GPTQ checkpoint: quantlab reads 4- and 8-bit"),
            ("gptq-g32", {"checkpoint_format": "marlin"}, "a GPTQ checkpoint in the 'marlin' layout"),
            ("awq-g32", {"version": "gemv"}, "an AWQ checkpoint packed for 'gemv'"),
            ("awq-g32", {"quant_method": "hqq"}, "a hqq checkpoint: quantlab reads compressed-tensors"))):
        bad = shutil.copytree(art[kind], tmp_path / str(i))
        config = json.loads((bad / "config.json").read_text())
        config["quantization_config"].update(change)
        (bad / "config.json").write_text(json.dumps(config))
        assert words in refused(bad)
    assert "is quantized too (AWQ 4-bit, groups of 32, zero points)" in refused(art["gptq-g32"], art["awq-g32"])


def test_zero_biases_some_writers_save_are_dropped_and_others_refused(art, tmp_path):
    """A zero bias beside a packed Linear that has none loads (as AutoGPTQ
    checkpoints carry them); a nonzero one does not fit the architecture."""
    from safetensors.torch import load_file, save_file

    for fill, loads in ((0.0, True), (0.5, False)):
        folder = shutil.copytree(art["gptq-g32"], tmp_path / str(fill))
        state = load_file(folder / "model.safetensors")
        state["model.layers.0.self_attn.q_proj.bias"] = torch.full((state["model.layers.0.self_attn.q_proj.scales"]
                                                                    .shape[1],), fill, dtype=torch.float16)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if loads:
            assert models.load(_hf(folder), "~")[0].model.layers[0].self_attn.q_proj.bias is None
        else:
            with pytest.raises(Exception, match="unexpected .'model.layers.0.self_attn.q_proj.bias'"):
                models.load(_hf(folder), "~")


def test_a_checkpoint_for_another_architecture_is_one_line(art, tmp_path):
    bad = shutil.copytree(art["gptq-g32"], tmp_path / "wide")
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as e:
        models.load(_hf(bad), "~")
    assert "\n" not in str(e.value) and "not this model's checkpoint" in str(e.value)


def test_gptq_and_awq_beside_their_original_in_one_sweep(art, store):
    """Both artifacts as points against the float original: real int4
    points named by their layout, sizes from their files, and perplexity
    equal to plain transformers' on the weights the integers stand for
    (within a tenth of the printed se)."""
    if not (SHARED_DATA / "wikitext-2-raw").is_dir():
        pytest.skip("needs the WikiText-2 data (QUANTLAB_DATA_DIR)")
    r = run_cli(["-m", "model=hf", f"model.path={art['gptq-g32']},{art['awq-g32']}", "scheme/weights=as-is",
                 f"reference.path={art['float']}", "probe=smoke", "scheme.weights.compute_dtype=float32",
                 "probe.perplexity.enabled=true", "probe.perplexity.window=128", "probe.perplexity.max_windows=16",
                 "probe.perplexity.adaptive=false", "probe.latency.enabled=false",
                 f"data_dir={SHARED_DATA}", "sweep_name=gptq", *store])
    assert r.returncode == 0, r.stderr[-3000:]
    t = tracker(store[0].split("=", 1)[1])
    runs = {r.info.run_name: r for r in t.client.search_runs([t.experiment_id])
            if r.data.tags.get(point.ROLE_TAG) != point.ROLE_SWEEP}
    assert sorted(runs) == ["as-is-awq-w4-g32@cpu", "as-is-gptq-w4-g32@cpu"]
    name = "ppl_token_wikitext2_w128_rand16"
    for run_name, kind in (("as-is-gptq-w4-g32@cpu", "gptq-g32"), ("as-is-awq-w4-g32@cpu", "awq-g32")):
        tags, m = runs[run_name].data.tags, runs[run_name].data.metrics
        assert tags[point.OUTCOME_TAG] == "finished" and tags["emulated"] == "false" and tags["artifact"] == \
            EXPECTED[kind][1]
        assert 4 < m["size/bits_per_weight"] < 32 and m["fid/kl_mean"] > 1e-5
        plain = models.load(_hf(art["float"]), "~")[0]
        for n, w in _expected_weights(art, kind).items():
            plain.get_submodule(n).weight.data = w
        tok = models.load(_hf(art["float"]), "~")[1]
        wins, _, _ = perplexity.sample(tok, perplexity.wikitext2_text(str(SHARED_DATA)), 128, 16,
                                       int(runs[run_name].data.params["eval_seed"]))
        with torch.no_grad():
            logp = plain(wins).logits[:, :-1].log_softmax(-1)
        theirs = math.exp(-logp.gather(-1, wins[:, 1:, None]).double().mean().item())
        assert abs(math.log(m[name]) - math.log(theirs)) < m[f"{name}_ln_stderr"] / 10, (kind, m[name], theirs)
