"""A bitsandbytes 4-bit checkpoint (what transformers saves after loading a
model with ``BitsAndBytesConfig(load_in_4bit=True)``, as many hub models
ship) measured as itself: read from its metadata, sized from its files,
run on bitsandbytes' own modules, logged as a point."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from quantlab import artifacts, hardware, model_files, models, point
from quantlab.cli import to_point
from quantlab.schemes.registry import ApplyContext, weights_handler
from tests.conftest import compose_cfg, run_cli, tracker

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def bnb_dirs(tmp_path_factory):
    """``float``, ``nf4`` and ``fp4-dq``: the tiny model and two 4-bit
    checkpoints transformers and bitsandbytes made from it."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    root = tmp_path_factory.mktemp("bnb")
    model, tok = models.load(compose_cfg(["model=tiny"]).model, "~/.cache/quantlab")
    model.save_pretrained(root / "float")
    tok.save_pretrained(root / "float")
    out = {"float": root / "float"}
    for name, kind, double in (("nf4", "nf4", False), ("fp4-dq", "fp4", True)):
        q = AutoModelForCausalLM.from_pretrained(
            root / "float", device_map="cpu", quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=double,
                bnb_4bit_compute_dtype=torch.float32))
        q.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def _hf(path):
    return compose_cfg(["model=hf", f"model.path={path}"]).model


def test_metadata_and_size(bnb_dirs):
    a = artifacts.read(_hf(bnb_dirs["nf4"]))
    assert (a.family, a.label, a.kernel, a.unsupported) == ("bitsandbytes", "bnb-nf4", "bnb4", "")
    assert artifacts.read(_hf(bnb_dirs["fp4-dq"])).label == "bnb-fp4-dq"
    n_float = model_files.parameters(_hf(bnb_dirs["float"]))
    assert model_files.parameters(_hf(bnb_dirs["nf4"])) == n_float  # a byte holds two weights
    float_share = sum(p.numel() for n, p in models.load(_hf(bnb_dirs["float"]), "~")[0].named_parameters()
                      if "proj" not in n) / n_float
    bits = model_files.safetensors_size(bnb_dirs["nf4"])["size/bits_per_weight"]
    # fp32 embeddings/head/norms; 4 bits + an fp32 absmax per 64 for the projections; per layer, its 16-entry
    # fp32 code map and its quant state (under 100 bytes of JSON)
    codes = 32 * float_share + (4 + 32 / 64) * (1 - float_share)
    assert codes + 14 * 8 * 64 / n_float < bits < codes + 14 * 8 * (64 + 100) / n_float


def test_as_is_runs_bitsandbytes_own_modules_as_transformers_loads_them(bnb_dirs):
    from transformers import AutoModelForCausalLM

    cfg = to_point(compose_cfg(["model=hf", f"model.path={bnb_dirs['nf4']}", "scheme/weights=as-is",
                                f"reference.path={bnb_dirs['float']}"], to_object=False))
    assert cfg.scheme.weights.short_name() == "as-is-bnb-nf4" and cfg.scheme.weights.compute_dtype == "float32"
    model, tok = models.load(cfg.model, cfg.cache_dir)
    applied = weights_handler(cfg.scheme.weights).apply(model, cfg.scheme.weights,
                                                         ApplyContext(hw=hardware.cpu(), tokenizer=tok))
    assert not applied.emulated and applied.backend == f"bitsandbytes-{bnb.__version__}"
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 14
    plain = AutoModelForCausalLM.from_pretrained(bnb_dirs["nf4"], device_map="cpu").eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_an_8bit_checkpoint_is_refused_in_one_line(bnb_dirs, tmp_path):
    bad = shutil.copytree(bnb_dirs["nf4"], tmp_path / "int8")
    config = json.loads((bad / "config.json").read_text())
    q = config["quantization_config"]
    q.update({"load_in_4bit": False, "_load_in_4bit": False, "load_in_8bit": True, "_load_in_8bit": True})
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as e:
        to_point(compose_cfg(["model=hf", f"model.path={bad}", "scheme/weights=as-is",
                              f"reference.path={bnb_dirs['float']}"], to_object=False))
    assert "\n" not in str(e.value) and "bitsandbytes 8-bit (LLM.int8) checkpoint: not read as-is yet" in str(e.value)


def test_a_bitsandbytes_point_is_logged_as_what_it_is(bnb_dirs, store):
    r = run_cli(["model=hf", f"model.path={bnb_dirs['nf4']}", "scheme/weights=as-is",
                 f"reference.path={bnb_dirs['float']}", "probe=smoke", "probe.latency.new_tokens=4",
                 "probe.latency.repeats=1", "probe.latency.stages=false", "sweep_name=bnb", *store])
    assert r.returncode == 0, r.stderr[-3000:]
    t = tracker(store[0].split("=", 1)[1])
    run = next(x for x in t.client.search_runs([t.experiment_id]) if x.data.tags.get(point.ROLE_TAG) != point.ROLE_SWEEP)
    tags, m = run.data.tags, run.data.metrics
    assert run.info.run_name == "as-is-bnb-nf4@cpu" and tags[point.OUTCOME_TAG] == "finished"
    assert tags["emulated"] == "false" and tags["artifact"] == "bnb-nf4"
    assert 4 < m["size/bits_per_weight"] < 32 and m["fid/kl_mean"] > 1e-6
