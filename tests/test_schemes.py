"""Numerics of every weight scheme against the float layer, and size accounting."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from quantlab import hardware, models
from quantlab.config import ModelConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab.errors import UserError
from quantlab.hardware import Hardware
from quantlab.probes import size
from quantlab.schemes import layers
from quantlab.schemes.bnb4 import BnB4Scheme
from quantlab.schemes.float import FloatScheme
from quantlab.schemes.fp8 import FP8Scheme
from quantlab.schemes.gptq import GPTQScheme
from quantlab.schemes.int4 import Int4Scheme
from quantlab.schemes.int8 import Int8Scheme
from quantlab.schemes.qlinear import FP8Linear, Int4Linear, Int8Linear, rtn_int4
from quantlab.schemes.registry import ApplyContext, weights_handler

CPU = hardware.cpu()


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _linear(n=256, k=512, seed=0, bias=False):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    nn.init.normal_(lin.weight, std=0.02)
    return lin


def _x(k=512, rows=8, seed=1):
    torch.manual_seed(seed)
    return torch.randn(rows, k)


# Theory for Gaussian weights: int8 per-channel ~ 6.02*8 - 10 dB; 4-bit ~ 20 dB; e4m3 ~ 31 dB.
@pytest.mark.parametrize("make,bound", [
    (lambda l: Int8Linear.from_linear(l, torch.float32), 38.0),
    (lambda l: Int8Linear.from_linear(l, torch.bfloat16), 35.0),
    (lambda l: Int4Linear.from_linear(l, 32, False, torch.float32), 19.0),
    (lambda l: Int4Linear.from_linear(l, 128, False, torch.float32), 16.0),
    (lambda l: Int4Linear.from_linear(l, 64, True, torch.float32), 16.0),
    (lambda l: FP8Linear(l.weight, None, torch.float8_e4m3fn, torch.float32), 28.0),
    (lambda l: FP8Linear(l.weight, None, torch.float8_e5m2, torch.float32), 22.0),
    (lambda l: FP8Linear(l.weight, None, torch.float8_e4m3fn, torch.float32, True), 24.0),
], ids=["int8-fp32", "int8-bf16", "int4-g32", "int4-g128", "int4-g64-sym", "fp8-e4m3",
        "fp8-e5m2", "fp8-w8a8"])
def test_quantized_linear_sqnr(make, bound):
    lin = _linear()
    x = _x()
    with torch.no_grad():
        out = make(lin)(x)
        assert sqnr_db(lin(x), out) > bound


def test_finer_groups_are_more_accurate():
    lin, x = _linear(), _x()
    with torch.no_grad():
        s = {g: sqnr_db(lin(x), Int4Linear.from_linear(lin, g, False, torch.float32)(x)) for g in (32, 64, 128)}
    assert s[32] > s[64] > s[128]


@settings(max_examples=20, deadline=None)
@given(n=st.sampled_from([16, 48, 100, 200]), groups=st.integers(1, 4),
       g=st.sampled_from([32, 64]), sym=st.booleans(), seed=st.integers(0, 100))
def test_int4_kernel_matches_dequantized_weights(n, groups, g, sym, seed):
    """The packed kernel computes exactly x @ dequant(q)^T (within bf16-free fp32 rounding),
    for any N (padded to 16 inside) and any K that is a multiple of the group."""
    torch.manual_seed(seed)
    w = torch.randn(n, groups * g)
    q, scale, zero = rtn_int4(w, g, sym)
    mod = Int4Linear(q, scale, zero, g, None, torch.float32)
    deq = ((q.float() - 8).reshape(n, groups, g) * scale[..., None] + zero[..., None]).reshape(n, -1)
    assert torch.allclose(mod.dequantize(), deq, atol=1e-5)
    x = torch.randn(3, groups * g)
    assert torch.allclose(mod(x), x @ deq.T, atol=1e-3, rtol=1e-4)
    assert (q >= 0).all() and (q <= 15).all()
    if sym:
        assert torch.all(zero == 0)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 300), kind=st.sampled_from(["int8", "int4-g32", "int4-g64-sym"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), n=st.sampled_from([16, 100, 256]),
       seed=st.integers(0, 50))
def test_dequantized_gemm_path_computes_what_the_packed_kernel_does(rows, kind, dtype, n, seed):
    """Where the packed kernel is slow for the activation dtype, calls of at
    least DENSE_MIN_TOKENS rows take the dequantized-fp32 GEMM: the same
    layer's output within the compute dtype's own rounding of the kernel's
    (>= 60 dB: bf16 rounds at ~50 dB against float, fp32 well above)."""
    from quantlab.schemes import qlinear

    lin = _linear(n=n, k=256, seed=seed)
    mod = Int8Linear.from_linear(lin, dtype) if kind == "int8" else \
        Int4Linear.from_linear(lin, int(kind[6:8]), kind.endswith("sym"), dtype)
    x = _x(k=256, rows=rows, seed=seed + 1).to(dtype)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(qlinear, "DENSE_MIN_TOKENS", 10**9)
        kernel = mod(x)
        mp.setattr(qlinear, "DENSE_MIN_TOKENS", 1)
        mp.setattr(qlinear, "kernel_fast", lambda d: False)
        dense = mod(x)
    assert dense.dtype == kernel.dtype == dtype and dense.shape == kernel.shape == (rows, n)
    assert sqnr_db(kernel, dense) > 60.0


def test_the_int4_codes_are_read_back_exactly_from_the_kernel_layout():
    """codes() unpacks the ISA-dependent packed layout (learnt from the packing
    function) to the very integers quantized; dequantize() equals the kernel
    multiplying an identity, up to the kernel's rounding of its output."""
    for n, k, g in ((1536, 576, 64), (200, 576, 32), (576, 1536, 128)):
        w = _linear(n=n, k=k).weight.detach()
        q, scale, zero = rtn_int4(w, g, False)
        mod = Int4Linear(q, scale, zero, g, None, torch.bfloat16)
        assert torch.equal(mod.codes().int(), q.int())
        eye = torch.eye(k, dtype=torch.bfloat16)
        through_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, mod.packed, g, mod.scales_and_zeros)
        assert torch.allclose(mod.dequantize(), through_kernel[:, :n].T.float(), rtol=2 ** -8, atol=1e-6)


def test_prefill_path_is_tagged_per_host(monkeypatch):
    from quantlab.schemes import qlinear

    monkeypatch.setattr(qlinear, "kernel_fast", lambda d: False)
    assert "dequantized fp32 GEMM from 4 tokens" in qlinear.prefill_tags(torch.bfloat16)["kernel.prefill"]
    assert qlinear.dense_path(4, torch.bfloat16) and not qlinear.dense_path(1, torch.bfloat16)
    monkeypatch.setattr(qlinear, "kernel_fast", lambda d: True)
    assert qlinear.prefill_tags(torch.bfloat16) == {"kernel.prefill": "packed kernel"}
    assert not qlinear.dense_path(4096, torch.bfloat16)


def test_the_kernel_is_fast_for_bf16_on_atens_avx_builds_only(monkeypatch):
    """Keyed on the ATen CPU build dispatched to, not on oneDNN's bf16 matmul:
    with oneDNN capped at AVX2 (no bf16 matmul) the AVX2 kernels took 6.4 ms
    for int8 at 512 tokens, the generic ones 176 (benchmarks/prefill_path.py)."""
    from quantlab.schemes import qlinear

    for isa, fast in (("AVX512", True), ("AVX2", True), ("DEFAULT", False), ("SVE256", False)):
        monkeypatch.setattr(hardware, "cpu_vector_isa", lambda isa=isa: isa)
        assert qlinear.kernel_fast(torch.bfloat16) is fast
        assert not qlinear.kernel_fast(torch.float16) and not qlinear.kernel_fast(torch.float32)
        assert qlinear.dense_path(8, torch.bfloat16) is not fast


def test_the_vector_isa_follows_atens_cap():
    """What a point reads is the build ATen dispatches to, lowered by ATEN_CPU_CAPABILITY."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", "from quantlab import hardware; print(hardware.cpu_vector_isa())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "DEFAULT"


def test_a_lowered_kernel_isa_is_another_host(monkeypatch):
    """Timings taken with ATen or oneDNN capped below the CPU are not the
    CPU's own: the fingerprint (and so host.id, which guards reuse of
    timings) names both."""
    from quantlab import provenance

    native = provenance.host()
    assert f"ATen {hardware.cpu_vector_isa()}" in native
    monkeypatch.setattr(hardware, "cpu_vector_isa", lambda: "DEFAULT")
    capped = provenance.host()
    assert "ATen DEFAULT" in capped and provenance.host_id(capped) != provenance.host_id(native)
    monkeypatch.setattr(hardware, "cpu_native_matmul", lambda d: True)
    with_bf16 = provenance.host()
    monkeypatch.setattr(hardware, "cpu_native_matmul", lambda d: d == torch.float32)
    assert "oneDNN bf16 yes" in with_bf16 and "oneDNN bf16 no" in provenance.host()
    assert provenance.host_id(with_bf16) != provenance.host_id()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linears_widen_only_where_the_cpu_has_no_native_matmul(monkeypatch, tiny, dtype):
    """A model in a half dtype this CPU cannot multiply natively: its plain
    Linears multiply in fp32 from DENSE_MIN_TOKENS tokens (the same sums the
    fallback does, so the same output up to its rounding), keep their
    parameters and state dict, and one token a sequence takes the half path."""
    from quantlab.schemes import qlinear

    model, _ = tiny
    layers.cast_parameters(model, dtype)
    keys = set(model.state_dict())
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        before = model(ids).logits.float()
        monkeypatch.setattr(hardware, "cpu_native_matmul", lambda d: d == torch.float32)
        n = qlinear.widen(model, dtype)
        after = model(ids).logits.float()
    assert n == sum(isinstance(m, nn.Linear) for m in model.modules()) > 0
    assert all(isinstance(m, qlinear.WidenedLinear) for m in model.modules() if isinstance(m, nn.Linear))
    assert set(model.state_dict()) == keys
    assert sqnr_db(before, after) > 30.0  # half rounding of activations, not of the sums
    assert "multiply in fp32 from 4 tokens" in qlinear.widened_tags(n, dtype)["kernel.half_linear"]
    lin = next(m for m in model.modules() if isinstance(m, qlinear.WidenedLinear))
    x = torch.randn(1, 1, lin.in_features).to(dtype)
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))  # decode: the half path itself
    monkeypatch.setattr(hardware, "cpu_native_matmul", lambda d: True)
    assert qlinear.widen(models.tiny_model(ModelConfig(name="tiny", source="tiny")), dtype) == 0


def test_int8_round_trip_error_bound():
    lin = _linear()
    mod = Int8Linear.from_linear(lin, torch.float32)
    err = (mod.dequantize() - lin.weight).abs()
    half_step = lin.weight.abs().amax(1, keepdim=True) / 127 / 2
    assert torch.all(err <= half_step + 1e-7)
    assert mod.qweight.dtype == torch.int8


def test_packed_bytes_match_bit_width():
    lin = _linear(n=256, k=512)
    n = 256 * 512
    i8 = Int8Linear.from_linear(lin, torch.bfloat16)
    assert size.tensor_bytes(i8.qweight) == n and size.tensor_bytes(i8.scale) == 256 * 2
    i4 = Int4Linear.from_linear(lin, 64, False, torch.bfloat16)
    assert size.tensor_bytes(i4.packed) == n // 2
    assert size.tensor_bytes(i4.scales_and_zeros) == (512 // 64) * 256 * 2 * 2
    f8 = FP8Linear(lin.weight, None, torch.float8_e4m3fn, torch.bfloat16)
    assert size.tensor_bytes(f8.weight_fp8) == n


@pytest.fixture
def tiny():
    return models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()


def _apply(model, cfg, tok=None, **ctx):
    return weights_handler(cfg).apply(model, cfg, ApplyContext(hw=CPU, tokenizer=tok, **ctx))


@pytest.mark.parametrize("cfg,bpw_max", [
    (Int8Scheme(skip=["lm_head"]), 9.0), (Int4Scheme(group_size=32, skip=[]), 5.1),
    (FP8Scheme(skip=["lm_head"]), 9.0), (BnB4Scheme(skip=["lm_head"]), 4.6),
])
def test_scheme_on_tiny_model_bits_and_generation(tiny, cfg, bpw_max):
    """Bits per weight of the quantized Linears, and the model still generates."""
    model, tok = tiny
    lin_names = [n for n, _ in layers.select(model, cfg.skip)]
    n_lin = sum(model.get_submodule(n).weight.numel() for n in lin_names)
    before = sum(size.tensor_bytes(t) for n in lin_names for t in
                 [*model.get_submodule(n).parameters(), *model.get_submodule(n).buffers()])
    _apply(model, cfg)
    after = sum(size.tensor_bytes(t) for n in lin_names for t in
                [*model.get_submodule(n).parameters(), *model.get_submodule(n).buffers()])
    assert before == 4 * n_lin
    assert 8 * after / n_lin <= bpw_max
    out = model.generate(tok("The harbour", return_tensors="pt")["input_ids"], max_new_tokens=4,
                         do_sample=False, min_new_tokens=4)
    assert out.shape[1] == len("The harbour") + 4


def test_skip_list_keeps_lm_head_in_high_precision(tiny):
    model, _ = tiny
    _apply(model, Int4Scheme(group_size=32))
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)


def test_non_dividing_group_size_is_a_clear_error(tiny):
    model, _ = tiny  # hidden 64: 128 does not divide the attention/MLP inputs
    with pytest.raises(UserError, match=r"group_size 128 does not divide in_features \[64\].*fit every layer: 32, 64"):
        _apply(model, Int4Scheme(group_size=128))


def test_unknown_group_size_rejected():
    with pytest.raises(ValueError, match="valid: 32, 64, 128, 256"):
        Int4Scheme(group_size=48)


def test_gptq_beats_rtn_on_correlated_inputs():
    """Reconstruction error ||XW^T - XQ^T|| is what GPTQ minimizes: with strongly
    correlated inputs it must beat round-to-nearest at the same group size."""
    from quantlab.schemes.gptq_solver import HessianAccumulator, gptq_int4

    torch.manual_seed(0)
    k, n = 256, 128
    basis = torch.randn(16, k)
    x = torch.randn(2048, 16) @ basis + 0.05 * torch.randn(2048, k)  # low-rank + noise
    w = torch.randn(n, k) * 0.02
    acc = HessianAccumulator(k)
    acc.add(x)
    ref = x @ w.T
    for act_order in (False, True):
        q, s, z = gptq_int4(w, acc.value(), 64, symmetric=False, act_order=act_order)
        g = Int4Linear(q, s, z, 64, None, torch.float32)
        rq, rs, rz = rtn_int4(w, 64, False)
        r = Int4Linear(rq, rs, rz, 64, None, torch.float32)
        err_gptq = (x @ g.dequantize().T - ref).pow(2).mean()
        err_rtn = (x @ r.dequantize().T - ref).pow(2).mean()
        assert err_gptq < 0.7 * err_rtn, (act_order, err_gptq, err_rtn)


def test_gptq_accumulates_one_hessian_per_distinct_input(tiny):
    """q/k/v share their input and so do gate/up: one accumulator each,
    holding exactly the sums a Linear's own accumulator would."""
    from quantlab.schemes.gptq import SharedInputs
    from quantlab.schemes.gptq_solver import HessianAccumulator

    model, _ = tiny
    layer = model.model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    shared, own = SharedInputs(), {n: HessianAccumulator(m.in_features) for n, m in linears.items()}
    hooks = [m.register_forward_hook(shared.hook(n)) for n, m in linears.items()]
    hooks += [m.register_forward_hook(lambda _m, a, _o, acc=own[n]: acc.add(a[0])) for n, m in linears.items()]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(3):
            model(input_ids=torch.randint(0, 256, (1, 24), generator=g), use_cache=False)
            shared.next_sample()
    for h in hooks:
        h.remove()
    groups = {}
    for n, acc in shared.of.items():
        groups.setdefault(id(acc), []).append(n.split(".")[-1])
    assert sorted(map(sorted, groups.values())) == [["down_proj"], ["gate_proj", "up_proj"], ["k_proj", "q_proj", "v_proj"],
                                                    ["o_proj"]]
    hessians = shared.hessians()
    for n in linears:
        assert shared.of[n].n == own[n].n == 72 and torch.equal(hessians[n], own[n].value())


def test_gptq_on_tiny_model_beats_rtn_in_kl(tiny, tmp_path):
    """End to end on the tiny model with the built-in calibration text."""
    from quantlab import corpus
    from quantlab.probes import fidelity

    model, tok = tiny
    ids = corpus.token_ids(tok, "builtin", 256)
    ref = fidelity.logprobs(TorchEngine(model), ids)
    rtn = models.tiny_model(ModelConfig(name="tiny", source="tiny"))
    _apply(rtn, Int4Scheme(group_size=32, symmetric=True))
    _apply(model, GPTQScheme(group_size=32, symmetric=True, calibration="builtin", n_samples=16,
                             seq_len=128), tok, cache_dir=str(tmp_path))
    assert isinstance(model.model.layers[1].self_attn.o_proj, Int4Linear)
    kl_gptq = fidelity.compare(ref, fidelity.logprobs(TorchEngine(model), ids))["fid/kl_mean"]
    kl_rtn = fidelity.compare(ref, fidelity.logprobs(TorchEngine(rtn), ids))["fid/kl_mean"]
    assert kl_gptq < kl_rtn


def test_gptq_without_its_data_calibrates_on_builtin_text_and_says_so(tmp_path, caplog):
    """A newcomer without the data directory gets a GPTQ point, not a failure;
    the run's tags and the log say which text it was calibrated on and why."""
    model, tok = models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()
    cfg = GPTQScheme(group_size=32, calibration="wiki", n_samples=4, seq_len=64)
    with caplog.at_level("WARNING", logger="quantlab"):
        applied = _apply(model, cfg, tok, cache_dir=str(tmp_path), data_dir=str(tmp_path / "nowhere"))
    assert applied.tags["calibration"] == "builtin"
    assert "calibration set 'wiki'" in applied.tags["calibration.fallback"]
    assert "built-in text" in caplog.text
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    present = _apply(models.tiny_model(ModelConfig(name="tiny", source="tiny")),
                     GPTQScheme(group_size=32, calibration="builtin", n_samples=4, seq_len=64), tok,
                     cache_dir=str(tmp_path))
    assert {k: v for k, v in present.tags.items() if k != "kernel.prefill"} == {"calibration": "builtin"}


# --- what each target can run (the sweep asks this before loading anything) ---
H100 = Hardware(device="cuda", name="H100", cuda_capability=(9, 0))
A100 = Hardware(device="cuda", name="A100", cuda_capability=(8, 0))


@pytest.mark.parametrize("cfg,hw,status", [
    (FloatScheme("float32"), CPU, "real"),
    (Int8Scheme(), CPU, "real"),
    (Int4Scheme(), CPU, "real"),
    (FP8Scheme(), CPU, "emulated"),
    (FP8Scheme(activations="dynamic"), CPU, "emulated"),
    (FP8Scheme(activations="dynamic"), H100, "real"),
    (FP8Scheme(activations="dynamic"), A100, "emulated"),
    (FP8Scheme(format="e5m2", activations="dynamic"), H100, "unsupported"),
    (Int4Scheme(symmetric=True), H100, "unsupported"),
    (GPTQScheme(), CPU, "real"),
    (GPTQScheme(bits=3), CPU, "unsupported"),
    (GPTQScheme(), H100, "unsupported"),
])
def test_support_matrix(cfg, hw, status):
    verdict = weights_handler(cfg).support(cfg, hw)
    assert verdict.status == status
    assert (verdict.reason != "") == (status != "real") or status == "real"


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 8), groups=st.integers(1, 3), seed=st.integers(0, 1000))
def test_symmetric_int4_uses_all_16_levels_like_q4_0(n, groups, seed):
    """Each group's largest-magnitude weight is reproduced exactly on level 0
    (llama.cpp's Q4_0 rule), and the grid is finer than amax / 7 over 15 levels."""
    w = torch.randn(n, groups * 32, generator=torch.Generator().manual_seed(seed))
    q, scale, zero = rtn_int4(w, 32, True)
    g = w.reshape(n, groups, 32)
    extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    deq = ((q.float() - 8).reshape(n, groups, 32) * scale[..., None]).reshape(n, -1)
    torch.testing.assert_close(deq.reshape(n, groups, 32).gather(
        -1, g.abs().argmax(-1, keepdim=True)).squeeze(-1), extreme)
    assert (q.reshape(n, groups, 32).amin(-1) == 0).all() and torch.all(zero == 0)
    assert (scale.abs() < g.abs().amax(-1) / 7).all()


@pytest.mark.parametrize("cfg", [FloatScheme("bfloat16"), FloatScheme("float16"), Int8Scheme(),
                                 Int4Scheme(group_size=32)], ids=["bf16", "fp16", "int8", "int4"])
def test_every_scheme_keeps_rope_in_fp32(tiny, cfg):
    """Baselines on the same footing: a float cast rounds the weights like any
    scheme does, but not RoPE's inv_freq (rounding it in bf16 moves 0.3162 to
    0.3164 and shifts every position's angle for the baseline alone)."""
    model, _ = tiny
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert before
    _apply(model, cfg)
    after = dict(model.named_buffers())
    for n, b in before.items():
        assert after[n].dtype == torch.float32 and torch.equal(after[n], b), n
    assert model.model.embed_tokens.weight.dtype == getattr(torch, getattr(cfg, "dtype", "bfloat16"))
