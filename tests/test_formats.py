"""The block-scaled formats (NVFP4, MXFP4, MXFP8, FP8 blocks, W4A8) against
compressed-tensors, the library that writes and reads their checkpoints:
codes and scales bit for bit, on random and edge tensors; the export
decompressed by compressed-tensors equal to the point's weights; MXFP4 GGUF
blocks read back by gguf-py equal to them too."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressed_tensors.compressors.mx_utils import compress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
from compressed_tensors.quantization.quant_scheme import FP8_BLOCK, MXFP4A16, MXFP8A16, NVFP4, W4AFP8
from compressed_tensors.quantization.utils.helpers import (calculate_qparams, compute_dynamic_scales_and_zp,
                                                           generate_gparam)

from quantlab.schemes import fpquant as fq

EDGES = [0.0, -0.0, 1e-45, -1e-45, 1e-39, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, -1e30,
         448.0, 449.0, -0.26, 0.7499, 2 ** -126, 1.75 * 2 ** -3, 1.7499 * 2 ** 5]


def _tensor(seed: int, n: int, k: int, spread: float, edges: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(spread * torch.randn(n, 1, generator=g))
    if edges:
        flat = w.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: len(EDGES)]
        flat[idx] = torch.tensor(EDGES[: len(idx)])
        w[0, :16] = 0.0  # an all-zero group
    return w


shapes = st.tuples(st.integers(0, 2**31 - 1), st.sampled_from([1, 3, 16]), st.sampled_from([32, 64, 96, 576]),
                   st.sampled_from([0.0, 2.0, 8.0]), st.booleans())


def _groups(w: torch.Tensor, g: int):
    x = w.unflatten(-1, (w.shape[-1] // g, g))
    return x.amin(-1), x.amax(-1)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_nvfp4_codes_and_scales_equal_compressed_tensors(case):
    w = _tensor(*case)
    codes, scale, gs = fq.nvfp4_quantize(w)
    args = QuantizationArgs(**NVFP4["weights"].model_dump())
    ref_gs = generate_gparam(w.min(), w.max())
    lo, hi = _groups(w, 16)
    ref_scale, zp = calculate_qparams(lo, hi, args, global_scale=ref_gs)
    ref_values = quantize(w, ref_scale, zp, args, global_scale=ref_gs)
    assert torch.equal(gs, ref_gs)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(fq.pack_nibbles(codes), pack_fp4_to_uint8(ref_values))
    assert torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)  # stored as E4M3 without loss


@pytest.mark.parametrize("elem, preset", [("fp4", MXFP4A16), ("fp8", MXFP8A16)])
@settings(max_examples=30, deadline=None)
@given(case=shapes)
def test_mx_codes_and_exponents_equal_compressed_tensors(elem, preset, case):
    w = _tensor(*case)
    elements, e = fq.mx_quantize(w, elem)
    args = QuantizationArgs(**preset["weights"].model_dump())
    lo, hi = _groups(w, 32)
    ref_scale, zp = calculate_qparams(lo, hi, args)
    assert torch.equal(e, compress_mx_scale(ref_scale, torch.uint8))
    assert torch.equal(fq.mx_scale(e), ref_scale)
    ref_values = quantize(w, ref_scale, zp, args)
    if elem == "fp4":
        assert torch.equal(fq.pack_nibbles(elements), pack_fp4_to_uint8(ref_values))
    else:
        assert torch.equal(elements.view(torch.uint8), ref_values.to(torch.float8_e4m3fn).view(torch.uint8))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(128, 128), (200, 576), (1, 300), (576, 1536)]),
       st.booleans())
def test_fp8_block_equal_compressed_tensors_including_partial_blocks(seed, shape, edges):
    w = _tensor(seed, *shape, 2.0, edges)
    q, scale = fq.fp8_block_quantize(w)
    args = QuantizationArgs(**FP8_BLOCK["weights"].model_dump())
    b = fq._blocks(w, (128, 128))
    ref_scale, zp = calculate_qparams(b.amin((-1, -2)), b.amax((-1, -2)), args)
    ref = quantize(w, ref_scale, zp, args, dtype=torch.float8_e4m3fn)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(fq.fp8_block_dequantize(q, scale), fake_quantize(w, ref_scale, zp, args))


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_w4a8_int4_groups_equal_compressed_tensors(case):
    w = _tensor(*case)
    q, scale = fq.int4_sym_quantize(w, 32)
    args = QuantizationArgs(**{**W4AFP8["weights"].model_dump(), "group_size": 32})
    lo, hi = _groups(w, 32)
    ref_scale, zp = calculate_qparams(lo, hi, args)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.float(), quantize(w, ref_scale, zp, args))


def _act(preset_args, x, module=None, global_scale=None):
    args = QuantizationArgs(**preset_args.model_dump())
    scale, zp = compute_dynamic_scales_and_zp(x, args, module, global_scale=global_scale)
    if args.strategy == "group" or args.strategy == "tensor_group":
        return fake_quantize(x, scale, zp, args, global_scale=global_scale)
    return fake_quantize(x, scale, zp, args)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 7]), st.booleans())
def test_dynamic_activations_equal_compressed_tensors(seed, tokens, edges):
    x = _tensor(seed, tokens, 256, 3.0, edges)[None]  # [batch, tokens, hidden], as activations come
    assert torch.equal(fq.fp8_tokens(x), _act(W4AFP8["input_activations"], x))
    assert torch.equal(fq.fp8_tokens(x, 128), _act(FP8_BLOCK["input_activations"], x))
    from compressed_tensors.quantization.quant_scheme import MXFP4, MXFP8

    assert torch.equal(fq.mx_tokens(x, "fp4"), _act(MXFP4["input_activations"], x))
    assert torch.equal(fq.mx_tokens(x, "fp8"), _act(MXFP8["input_activations"], x))
    gs = fq.nvfp4_global_scale(x.abs().amax() * 0.5)  # a calibrated scale smaller than this input needs
    assert torch.equal(fq.nvfp4_tokens(x, gs), _act(NVFP4["input_activations"], x, global_scale=gs))


def test_e2m1_rounds_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 100.0, -0.2, -0.0, 0.0])
    assert fq.e2m1_decode(fq.e2m1_round(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, 0.0, 0.0]
    assert fq.e2m1_codes(torch.tensor([-0.2, -0.0])).tolist() == [8, 0]  # a negative rounded to zero keeps its sign


def test_mx_scale_rounds_a_significand_of_one_point_seven_five_up():
    """The reference's choice (not the OCP spec's floor): 1.75 * 2**3 scales by
    2**(4-2), so it lands on 3.5 -> 4 rather than saturating 14 -> 6."""
    w = torch.zeros(1, 32)
    w[0, 0] = 1.75 * 8
    e = fq.mx_exponents(w, "fp4")
    assert int(e) - 127 == 2
    w[0, 0] = 1.7 * 8
    assert int(fq.mx_exponents(w, "fp4")) - 127 == 1


def test_bits_per_weight_count_the_scales():
    from quantlab.probes.size import weight_stats
    from quantlab.schemes.fplinear import FP8BlockLinear, MXLinear, NVFP4Linear, W4A8Linear

    w = torch.randn(256, 512)
    cases = [(NVFP4Linear.quantize(w, None, torch.bfloat16), 4 + 8 / 16 + 32 / w.numel()),
             (MXLinear.quantize(w, None, torch.bfloat16, "fp4"), 4.25),
             (MXLinear.quantize(w, None, torch.bfloat16, "fp8"), 8.25),
             (FP8BlockLinear(w, None, torch.bfloat16, 128), 8 + 32 / 128 ** 2),
             (W4A8Linear(w, None, torch.bfloat16, 64), 4 + 32 / 64)]
    for mod, bits in cases:
        assert weight_stats(mod, w.numel())["size/bits_per_weight"] == pytest.approx(bits, rel=1e-9), type(mod)


@pytest.mark.parametrize("preset", ["nvfp4", "nvfp4-a16", "mxfp4", "mxfp4-a16", "mxfp8", "fp8-block",
                                    "fp8-block-a16", "w4a8-g64"])
def test_layer_output_is_the_emulated_product(preset):
    """The layer multiplies the rounded input by the dequantized weight in fp32."""
    from quantlab.schemes.fplinear import FormatLinear

    from tests.test_formats_export import quantized_tiny

    model, _ = quantized_tiny(preset)
    mods = [m for m in model.modules() if isinstance(m, FormatLinear)]
    assert mods and all(m.activations != "none" for m in mods) == (not preset.endswith("a16"))
    mod = mods[0]
    x = torch.randn(2, 5, mod.in_features).to(torch.bfloat16)
    xq = mod.quantize_input(x.reshape(-1, mod.in_features).float())
    want = (xq @ mod.dequantize().T).to(torch.bfloat16).reshape(2, 5, -1)
    assert torch.equal(mod(x), want)
    if mod.activations != "none":
        assert not torch.equal(xq, x.reshape(-1, mod.in_features).float())
    assert math.isfinite(float(mod(x).float().abs().sum()))


def test_mxfp4_gguf_blocks_hold_the_points_codes():
    """quantlab's MXFP4 GGUF blocks, read back by gguf-py, are the point's
    weights exactly; llama.cpp's own rule (gguf-py's MXFP4 quantizer, the twin
    of ggml's ``quantize_row_mxfp4_ref``) gives the same weights wherever the
    two scale rules agree (a group whose largest significand is below 1.75;
    its nearest-code search writes a negative zero as +0, the same value) and
    other ones everywhere else (its ``floor`` exponent saturates that group's
    largest values at 6 steps)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from quantlab.export.gguf import dequantize, pack_mxfp4

    w = _tensor(3, 64, 256, 2.0, False)
    elements, e = fq.mx_quantize(w, "fp4")
    blocks = pack_mxfp4(elements, e)
    ours = dequantize(blocks, "MXFP4", tuple(w.shape))
    assert torch.equal(ours, fq.mx_dequantize(elements, e))
    theirs = dequantize(quantize(w.numpy(), GGMLQuantizationType.MXFP4), "MXFP4", tuple(w.shape))
    amax = w.unflatten(-1, (8, 32)).abs().amax(-1)
    agree = amax / torch.exp2(torch.floor(torch.log2(amax))) < 1.75
    same = (ours.unflatten(-1, (8, 32)) == theirs.unflatten(-1, (8, 32))).all(-1)
    assert 0.5 < agree.float().mean() < 1
    assert same[agree].all() and not same[~agree].any()


def test_checkpoint_mappings_name_compressed_tensors_formats():
    from quantlab.export import formats
    from quantlab.schemes.configs import FP8BlockScheme, MXScheme, NVFP4Scheme, W4A8Scheme

    got = {c.short_name(): formats.mapping("checkpoint", c)["format"] for c in
           (NVFP4Scheme(), NVFP4Scheme(activations="none"), MXScheme(), MXScheme(elem="fp8"), FP8BlockScheme(),
            W4A8Scheme(group_size=64))}
    assert got == {"nvfp4": "nvfp4-pack-quantized", "nvfp4-a16": "nvfp4-pack-quantized",
                   "mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized", "fp8-block": "float-quantized",
                   "w4a8-g64": "pack-quantized"}
    assert formats.mapping("gguf", MXScheme(activations="none")) == {"type": "MXFP4"}
    with pytest.raises(Exception, match="mxfp4-a16"):
        formats.mapping("gguf", MXScheme())
    json.dumps(formats.mapping("checkpoint", NVFP4Scheme()))  # plain data: logged as a manifest


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_gptq_onto_the_float_grids_beats_round_to_nearest(fmt):
    """GPTQ minimizes ||XW^T - XQ^T||: on strongly correlated inputs it must
    beat the format's own round to nearest, with codes and scales the format
    can hold (NVFP4's group scales E4M3 values, MX's exponents bytes)."""
    from quantlab.schemes import fpgptq
    from quantlab.schemes.fplinear import MXLinear, NVFP4Linear
    from quantlab.schemes.gptq_solver import HessianAccumulator

    torch.manual_seed(0)
    k, n = 256, 128
    x = torch.randn(2048, 16) @ torch.randn(16, k) + 0.05 * torch.randn(2048, k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = torch.randn(n, k) * 0.02
    acc = HessianAccumulator(k)
    acc.add(x)
    if fmt == "nvfp4":
        g = fpgptq.nvfp4_layer(lin, acc.value(), 0.01, torch.float32, "none", None)
        r = NVFP4Linear.quantize(lin.weight.float(), None, torch.float32)
        assert torch.equal(g.weight_global_scale, r.weight_global_scale)  # fixed from the whole weight first
    else:
        g = fpgptq.mx_layer(lin, acc.value(), 0.01, torch.float32, fmt[2:], "none")
        r = MXLinear.quantize(lin.weight.float(), None, torch.float32, fmt[2:])
    ref = x @ lin.weight.T
    err_gptq = (x @ g.dequantize().T - ref).pow(2).mean()
    err_rtn = (x @ r.dequantize().T - ref).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    assert not torch.equal(g.dequantize(), r.dequantize())
