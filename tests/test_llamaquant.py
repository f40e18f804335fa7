"""llama.cpp's own quant menu (scheme/weights=gguf-*): the importance matrix
against its definition and against llama.cpp's quantizer, the files made and
read back with gguf-py, a menu sweep end to end, and bad input as one line."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from quantlab import model_files, models, point
from quantlab.export import gguf as gguf_export
from quantlab.schemes.configs import LlamaQuantScheme
from quantlab.schemes.llamaquant import importance
from quantlab.digest import sha256_file
from tests.conftest import REPO, compose_cfg, run_cli, tracker

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'quantlab[llamacpp]')")
# rows of 256 and 512: llama.cpp's K-quant super-blocks (256) divide every matrix, so no fallback type
WIDE = ["model=tiny", "model.tiny.hidden_size=256", "model.tiny.intermediate_size=512"]


def _model():
    cfg = compose_cfg(WIDE)
    return models.load(cfg.model, cfg.cache_dir)


def _dequantized(path, name: str) -> torch.Tensor:
    import gguf

    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    n, k = int(t.shape[1]), int(t.shape[0])
    return gguf_export.dequantize(np.asarray(t.data), t.tensor_type.name, (n, k))


def test_bad_gguf_types_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"gguf quant 'Q4_K_X'.*valid: Q8_0, Q6_K, Q5_K_M"):
        LlamaQuantScheme(quant="Q4_K_X")
    with pytest.raises(ValueError, match="gguf quant IQ2_XXS needs an importance matrix .* set imatrix=true"):
        LlamaQuantScheme(quant="IQ2_XXS")
    assert LlamaQuantScheme(quant="IQ2_XXS", imatrix=True).short_name() == "gguf-iq2_xxs-imat"


def test_importance_is_each_linears_mean_squared_input():
    """Layer 0's q_proj reads the first RMSNorm of the embeddings: its
    importance is that input's mean square per column, over every token."""
    model, _ = _model()
    ids = torch.randint(0, model.config.vocab_size, (3, 40))
    imp = importance(model, ids, batch=2)
    layer = model.model.layers[0]
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(ids)).reshape(-1, model.config.hidden_size)
    torch.testing.assert_close(imp["model.layers.0.self_attn.q_proj"], (x * x).mean(0), rtol=1e-5, atol=1e-7)
    assert imp["model.layers.0.self_attn.q_proj"].shape == (model.config.hidden_size,)
    assert imp["model.layers.0.mlp.down_proj"].shape == (model.config.intermediate_size,)
    assert "lm_head" in imp


def test_llama_cpps_quantizer_takes_the_importance_matrix(tmp_path):
    """The same F16 file quantized to Q4_K_M with an importance matrix that
    puts all weight on the even columns of every matrix keeps those columns
    closer to the float weights than without one (each block of 32 fits its
    scale and minimum to them): the matrix reaches llama.cpp through the C
    array quantlab builds."""
    model, tok = _model()
    model.half()
    src = tmp_path / "f16.gguf"
    gguf_export.write(model, tok, src)
    names = gguf_export.matrix_names(model)
    mods = dict(model.named_modules())
    emphasis = {}
    for module, gname in names.items():
        v = np.full(mods[module].in_features, 1e-4, np.float32)
        v[::2] = 1.0
        emphasis[gname] = v
    gguf_export.quantize(src, tmp_path / "plain.gguf", "Q4_K_M")
    gguf_export.quantize(src, tmp_path / "imat.gguf", "Q4_K_M", emphasis)
    w = model.model.layers[0].mlp.gate_proj.weight.detach().float()
    plain, imat = (_dequantized(tmp_path / f, "blk.0.ffn_gate.weight") for f in ("plain.gguf", "imat.gguf"))
    even, odd = (lambda d: float(((d - w)[:, ::2] ** 2).mean())), (lambda d: float(((d - w)[:, 1::2] ** 2).mean()))
    assert even(imat) < 0.9 * even(plain) and odd(imat) > odd(plain), (even(imat), even(plain), odd(imat), odd(plain))
    assert model_files.gguf_type_mix(str(tmp_path / "plain.gguf")).keys() <= {"Q4_K", "Q6_K"}


def test_a_gguf_menu_sweep_end_to_end(tmp_path, store):
    """Q6_K and Q4_K_M, with an importance matrix, made by llama.cpp, measured
    on its kernels: each point names its type mix, its bits per weight come
    from the file, the file decodes (gguf-py) close to the point's weights,
    and Q6_K loses less than Q4_K_M; the same scheme on target=cpu is a
    skipped point with the reason."""
    proc = run_cli(["-m", *WIDE, "target=llamacpp", "probe=smoke", "probe.latency.enabled=false",
                    "scheme/weights=gguf-q4_k_m-imat", "scheme.weights.quant=Q6_K,Q4_K_M",
                    "scheme.weights.calibration=builtin",
                    "scheme.weights.n_samples=4", "scheme.weights.seq_len=64", f"cache_dir={tmp_path}/c", *store],
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "llama.cpp's tensor types" in proc.stdout and "- gguf-q6_k-imat@llamacpp: Q6_K 100%" in proc.stdout
    t = tracker(store[0].split("=", 1)[1])
    runs = {r.info.run_name: r for r in t.client.search_runs([t.experiment_id])
            if r.data.tags.get(point.ROLE_TAG) != point.ROLE_SWEEP}
    q6, q4 = runs["gguf-q6_k-imat@llamacpp"], runs["gguf-q4_k_m-imat@llamacpp"]
    for r in (q6, q4):
        assert r.data.tags[point.OUTCOME_TAG] == "finished" and r.data.tags["emulated"] == "false"
    assert q6.data.tags["gguf.types"] == "Q6_K 100%"
    assert q4.data.tags["gguf.types"].startswith("Q4_K ") and "Q6_K" in q4.data.tags["gguf.types"]
    assert q4.data.tags["imatrix"] == "yes" and q4.data.tags["calibration"] == "builtin"
    assert 6.5 < q6.data.metrics["size/bits_per_weight"] < 7.5
    assert 4.5 < q4.data.metrics["size/bits_per_weight"] < 5.5
    assert q6.data.metrics["fid/kl_mean"] < q4.data.metrics["fid/kl_mean"]
    made = sorted((tmp_path / "c" / "gguf").glob("*.gguf"), key=lambda p: p.stat().st_size)
    model, _ = _model()
    w = model.model.layers[0].mlp.down_proj.weight.float()
    for path, floor_db in ((made[0], 15.0), (made[1], 25.0)):  # Q4_K_M, then Q6_K (the F16 file is largest)
        d = _dequantized(path, "blk.0.ffn_down.weight")
        sqnr = 10 * torch.log10((w ** 2).sum() / ((d - w) ** 2).sum())
        assert sqnr > floor_db, (path.name, float(sqnr))
    uri = store[0].split("=", 1)[1]
    export = [sys.executable, "-m", "quantlab.export", "--tracking-uri", uri, "--run", q4.info.run_id]
    shipped = subprocess.run([*export, "--format", "gguf", "--out", str(tmp_path / "q4.gguf")], capture_output=True,
                             text=True, cwd=REPO, timeout=600)
    assert shipped.returncode == 0, shipped.stderr[-2000:]
    assert sha256_file(tmp_path / "q4.gguf") == q4.data.tags["gguf.sha256"]  # the file the point measured
    assert json.loads((tmp_path / "q4.gguf.quantlab.json").read_text())["format"] == "gguf/Q4_K_M"
    refused = subprocess.run([*export, "--out", str(tmp_path / "ckpt")], capture_output=True, text=True, cwd=REPO,
                             timeout=600)
    assert refused.returncode != 0 and "gguf-q4_k_m-imat has no checkpoint representation" in refused.stderr
    skipped = run_cli([*WIDE, "target=cpu", "probe=smoke", "scheme/weights=gguf-q4_k_m", f"cache_dir={tmp_path}/c",
                       *store])
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    cpu = next(r for r in t.client.search_runs([t.experiment_id]) if r.info.run_name == "gguf-q4_k_m@cpu")
    assert cpu.data.tags[point.OUTCOME_TAG] == "skipped"
    assert "a llama.cpp quant type, made and run by llama.cpp (target=llamacpp)" in cpu.data.tags[point.REASON_TAG]


@pytest.mark.slow
@pytest.mark.network
def test_kl_agrees_with_llama_perplexity(tmp_path, llama_tools):
    """quantlab's KL and same-top-token rate of a Q4_K_M against its F16, on
    llama-perplexity's chunks of the same text, equal what
    ``llama-perplexity --kl-divergence`` prints, within its printed ±."""
    from benchmarks.llamacpp_peers import ours_kld, theirs_kld
    from quantlab import corpus
    from tests.conftest import SHARED_DATA

    model, tok = _model()
    model.half()
    base, quant = tmp_path / "f16.gguf", tmp_path / "q4_k_m.gguf"
    gguf_export.write(model, tok, base)
    gguf_export.quantize(base, quant, "Q4_K_M")
    text = corpus.text("auto", str(SHARED_DATA) if SHARED_DATA.is_dir() else None)[:6000]
    (tmp_path / "t.txt").write_text(text)
    ours = ours_kld(base, quant, text, 256, model.config.vocab_size, 2)
    theirs = theirs_kld(llama_tools, base, quant, tmp_path / "t.txt", 256, 2)
    assert ours["tokens"] >= 1000
    assert ours["kld"] == pytest.approx(theirs["kld"], abs=theirs["kld_se"]), (ours, theirs)
    assert ours["same_top"] == pytest.approx(theirs["same_top"], abs=theirs["same_top_se"]), (ours, theirs)
    assert ours["kld_se"] == pytest.approx(theirs["kld_se"], rel=0.2)
