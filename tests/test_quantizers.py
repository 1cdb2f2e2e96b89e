"""Exact-value tests of the element formats and quantizers in megatron_snip.precision.

Expected values are derived by hand (arithmetic in the comments) or from an
oracle that enumerates a format's codes from its bit-field definition and
picks the nearest value, ties to the even code; neither uses the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_snip.numerics import (
    E2M1,
    E4M3,
    E5M2,
    FORMATS,
    FP8DelayedScaling,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    element_bits,
    encode_e2m1,
    encode_e4m3,
    encode_e5m2,
    encode_e8m0,
    fake_quantize,
    hadamard_matrix,
    inverse_random_hadamard_transform,
    is_fp4,
    quantize_fp8_block,
    quantize_fp8_tensorwise,
    quantize_mx,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    random_hadamard_transform,
    random_signs,
    round_e2m1_stochastic,
    round_to_format,
    to_elements,
)

NAN = float("nan")
INF = float("inf")


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (NaN == NaN, and -0 != +0)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---------------------------------------------------------------------------
# Oracle: a format's grid from its bit fields, nearest value with ties to even.
# ---------------------------------------------------------------------------

ORACLE_FIELDS = {  # exponent bits, mantissa bits, bias, code of the largest finite magnitude
    "e4m3": (4, 3, 7, 0x7E),  # 0x7F is NaN
    "e5m2": (5, 2, 15, 0x7B),  # 0x7C.. are Inf/NaN
    "e2m1": (2, 1, 1, 0x7),
}


def oracle_magnitudes(name: str) -> torch.Tensor:
    """Non-negative finite values of the format, indexed by magnitude code (increasing)."""
    exp_bits, mant_bits, bias, top = ORACLE_FIELDS[name]
    values = []
    for code in range(top + 1):
        e, m = code >> mant_bits, code & ((1 << mant_bits) - 1)
        if e == 0:
            values.append(m / 2**mant_bits * 2.0 ** (1 - bias))
        else:
            values.append((1 + m / 2**mant_bits) * 2.0 ** (e - bias))
    return torch.tensor(values, dtype=torch.float64)


def oracle_round(x: torch.Tensor, name: str) -> torch.Tensor:
    grid = oracle_magnitudes(name)
    a = x.double().abs().clamp(max=grid[-1].item())
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    out = torch.where(pick_hi, grid[hi], grid[lo]).float()
    return out.copysign(x)


def oracle_sample(name: str) -> torch.Tensor:
    """Grid points, midpoints, midpoints +- one fp32 ulp, random values over all binades, out of range."""
    grid = oracle_magnitudes(name).float()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.full_like(mids, INF), torch.full_like(mids, -INF)
    gen = torch.Generator().manual_seed(0)
    top = math.log2(grid[-1].item())
    rand = torch.exp2(torch.empty(20000).uniform_(math.log2(grid[1].item()) - 3, top + 1, generator=gen))
    pts = torch.cat([grid, mids, mids.nextafter(up), mids.nextafter(down), rand, grid[-1:] * 1.01, t([1e30])])
    return torch.cat([pts, -pts])


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_rounding_matches_oracle(fmt):
    x = oracle_sample(fmt.name)
    assert same(round_to_format(x, fmt), oracle_round(x, fmt.name))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_elements_are_the_oracle_rounding_in_the_fp8_dtype(fmt):
    """``to_elements`` (the FP8 GEMM's bytes, no fp32 round trip) rounds as the oracle does,
    saturation, NaN and signed zeros included."""
    x = torch.cat([oracle_sample(fmt.name), t([0.0, -0.0, float("nan"), INF, -INF])])
    elements = to_elements(x, fmt)
    assert elements.dtype == fmt.torch_dtype
    expected = torch.cat([oracle_round(x[:-5], fmt.name), t([0.0, -0.0, NAN, fmt.max, -fmt.max])])
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(elements.float()), nan)  # NaN stays NaN (its payload is the cast's)
    assert same(elements.float()[~nan], expected[~nan])
    with pytest.raises(ValueError, match="no torch dtype"):
        to_elements(x, E2M1)


def test_e2m1_grid_and_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = t([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert same(decode_e2m1(codes), expected)
    assert torch.equal(encode_e2m1(expected), codes)
    assert same(round_to_format(expected, E2M1), expected)


def test_format_maxima_and_saturation():
    assert round_to_format(t([448.0, 449.0, 480.0, 1e30, INF, -INF]), E4M3).tolist() == [448, 448, 448, 448, 448, -448]
    assert round_to_format(t([57344.0, 61440.0, 1e30, INF, -INF]), E5M2).tolist() == [57344] * 4 + [-57344]
    assert round_to_format(t([6.0, 7.0, 100.0, INF, -7.0]), E2M1).tolist() == [6, 6, 6, 6, -6]
    assert encode_e4m3(t([448.0, -448.0])).tolist() == [0x7E, 0xFE]  # S.1111.110
    assert encode_e5m2(t([57344.0])).tolist() == [0x7B]  # S.11110.11


def test_smallest_subnormals_and_ties_below():
    # E4M3: min subnormal 2^-9 = code 0x01; half of it is a tie between 0 (even) and 2^-9 -> 0.
    assert round_to_format(t([2.0**-9, 2.0**-10, 2.0**-10 * 1.0001, 3 * 2.0**-10]), E4M3).tolist() == [
        2.0**-9,
        0.0,
        2.0**-9,
        2.0**-8,  # 3 * 2^-10 is half way between 2^-9 (code 1) and 2^-8 (code 2, even)
    ]
    assert encode_e4m3(t([2.0**-9, 2.0**-6])).tolist() == [0x01, 0x08]  # min subnormal, min normal
    # E5M2: min subnormal 2^-16; 2^-17 ties to 0; 3 * 2^-17 ties up to 2^-15.
    assert round_to_format(t([2.0**-16, 2.0**-17, 3 * 2.0**-17]), E5M2).tolist() == [2.0**-16, 0.0, 2.0**-15]
    assert encode_e5m2(t([2.0**-16])).tolist() == [0x01]
    # E2M1: min subnormal 0.5; 0.25 ties to 0.
    assert round_to_format(t([0.5, 0.25, -0.25]), E2M1).tolist() == [0.5, 0.0, -0.0]
    assert encode_e2m1(t([-0.25])).tolist() == [0x8]  # negative zero keeps its sign


def test_ties_to_even():
    # E4M3 binade [1, 2) has ulp 1/8: 1.0625 ties to 1.0 (mantissa 0); 1.1875 to 1.25 (mantissa 2).
    # Top binade [256, 448] has ulp 32: 400 -> 384 (m=4), 432 -> 448 (m=6).
    assert round_to_format(t([1.0625, 1.1875, 400.0, 432.0, -1.0625]), E4M3).tolist() == [1.0, 1.25, 384, 448, -1.0]
    # E5M2 binade [1, 2) has ulp 1/4: 1.125 -> 1.0, 1.375 -> 1.5.
    assert round_to_format(t([1.125, 1.375]), E5M2).tolist() == [1.0, 1.5]
    # E2M1 midpoints: 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    assert round_to_format(t([0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0]), E2M1).tolist() == [1, 1, 2, 2, 4, 4, -4]


def test_nan_propagates_through_element_rounding():
    for fmt in (E4M3, E5M2, E2M1):
        assert torch.isnan(round_to_format(t([NAN]), fmt)).all()
    assert torch.isnan(round_e2m1_stochastic(t([NAN]))).all()
    assert encode_e4m3(t([NAN])).item() & 0x7F == 0x7F
    with pytest.raises(ValueError, match="no NaN"):
        encode_e2m1(t([NAN]))


def test_e8m0_codec():
    scales = t([2.0**-127, 2.0**-126, 0.25, 1.0, 2.0**127, NAN])
    codes = torch.tensor([0, 1, 125, 127, 254, 255], dtype=torch.uint8)
    assert torch.equal(encode_e8m0(scales), codes)
    assert same(decode_e8m0(codes), scales)
    assert decode_e4m3(torch.tensor([0x7E, 0x01], dtype=torch.uint8)).tolist() == [448.0, 2.0**-9]


# ---------------------------------------------------------------------------
# Stochastic rounding (exact parts; unbiasedness is in test_quantizer_properties.py)
# ---------------------------------------------------------------------------


def test_stochastic_rounding_stays_on_neighbours():
    gen = torch.Generator().manual_seed(1)
    x = t([2.4] * 1000 + [-0.1] * 1000 + [3.0] * 10 + [9.0] * 10)
    q = round_e2m1_stochastic(x, gen)
    assert set(q[:1000].tolist()) == {2.0, 3.0}
    assert set(q[1000:2000].tolist()) == {-0.0, -0.5}
    assert q[2000:2010].tolist() == [3.0] * 10  # grid values are exact
    assert q[2010:].tolist() == [6.0] * 10  # beyond the max: saturates
    again = round_e2m1_stochastic(x, torch.Generator().manual_seed(1))
    assert torch.equal(q, again)  # reproducible from the generator


# ---------------------------------------------------------------------------
# FP8 per-tensor scaling
# ---------------------------------------------------------------------------


def test_fp8_current_scaling_values():
    # amax 3.5 -> scale = 448 / 3.5 = 128 exactly; 0.1 * 128 = 12.8 -> E4M3 ulp 1 in [8, 16) -> 13.
    q = quantize_fp8_tensorwise(t([1.0, -2.0, 3.5, 0.1]))
    assert q.scale.item() == 128.0 and q.scale_inv.item() == 1 / 128
    assert q.elements.tolist() == [128.0, -256.0, 448.0, 13.0]
    assert q.dequantized.tolist() == [1.0, -2.0, 3.5, 13 / 128]


def test_fp8_scale_options():
    x = t([3.0, -1.0])
    assert quantize_fp8_tensorwise(x).scale.item() == torch.tensor(448 / 3.0).item()
    assert quantize_fp8_tensorwise(x, pow2_scale=True).scale.item() == 128.0  # 149.3 -> 2^7
    assert quantize_fp8_tensorwise(x, pow2_scale=True, margin=1).scale.item() == 64.0  # 74.7 -> 2^6
    assert quantize_fp8_tensorwise(x, amax=7.0).scale.item() == 64.0  # override: 448 / 7
    assert quantize_fp8_tensorwise(x * 1000, E5M2).scale.item() == torch.tensor(57344 / 3000.0).item()


def test_fp8_scale_edge_cases():
    zero = quantize_fp8_tensorwise(torch.zeros(5))
    assert zero.scale.item() == 1.0 and torch.equal(zero.dequantized, torch.zeros(5))
    tiny = quantize_fp8_tensorwise(t([1e-45]))  # 448 / 1e-45 overflows fp32
    assert tiny.scale.item() == torch.finfo(torch.float32).max
    assert torch.isfinite(tiny.dequantized).all()


def test_delayed_scaling_history():
    # history_len 2, "max": the scale used at step t comes from amaxes of steps < t.
    ds = FP8DelayedScaling(E4M3, history_len=2, algo="max")
    used = []
    for amax in (1.0, 4.0, 2.0, 0.5, 0.0):
        q = ds.quantize(t([amax, -amax / 2]))
        used.append(q.scale.item())
    # step 0: initial 1; then 448/1; 448/max(1,4); 448/max(4,2); 448/max(2,0.5)
    assert used == [1.0, 448.0, 112.0, 112.0, 224.0]
    # after step 4 (amax 0) the history is [0, 0.5] -> 448 / 0.5
    assert ds.scale.item() == 896.0
    # saturation at step 1: 4 * 448 is clipped to 448 -> dequantized 1.0
    ds2 = FP8DelayedScaling(E4M3, history_len=2)
    ds2.quantize(t([1.0]))
    assert ds2.quantize(t([4.0])).dequantized.item() == 1.0


def test_delayed_scaling_most_recent_and_margin():
    ds = FP8DelayedScaling(E5M2, history_len=4, algo="most_recent", margin=1)
    for amax in (8.0, 2.0):
        ds.quantize(t([amax]))
    assert ds.scale.item() == 57344 / 2.0 / 2  # newest amax only, one binade of margin
    ds.quantize(torch.zeros(3))  # amax 0 keeps the previous scale (TE)
    assert ds.scale.item() == 57344 / 2.0 / 2
    with pytest.raises(ValueError):
        FP8DelayedScaling(algo="mean")


# ---------------------------------------------------------------------------
# FP8 block scaling
# ---------------------------------------------------------------------------


def test_fp8_block_1d_scales_and_padding():
    x = torch.zeros(2, 200)
    x[0, 5], x[0, 150], x[1, 199] = 3.0, -0.3, 1000.0
    q = quantize_fp8_block(x)  # 1x128 blocks: 200 columns -> 2 blocks (second padded to 128)
    # pow2 scales: 448/3 = 149.3 -> 128 (decode 2^-7); 448/0.3 = 1493 -> 1024; zero block -> 1; 448/1000 -> 0.25
    assert q.scales.tolist() == [[2.0**-7, 2.0**-10], [1.0, 4.0]]
    assert q.dequantized.shape == x.shape and q.elements[0, 5].item() == 384.0  # 3 * 128
    exact = quantize_fp8_block(x, pow2_scale=False)
    assert exact.scales[0, 0].item() == torch.reciprocal(torch.tensor(448 / 3.0)).item()
    assert exact.elements[0, 5].item() == 448.0


def test_fp8_block_2d_weight_tiles():
    w = torch.randn(130, 260, generator=torch.Generator().manual_seed(0))
    q = quantize_fp8_block(w, block=(128, 128))
    assert q.scales.shape == (2, 3)  # ceil(130/128) x ceil(260/128)
    amax = w[:128, 128:256].abs().amax()
    assert q.scales[0, 1].item() == 2.0 ** -math.floor(math.log2(448 / amax.item()))


# ---------------------------------------------------------------------------
# MX formats
# ---------------------------------------------------------------------------


def test_mxfp8_te_scale_rule():
    # Block amax 1.9: TE rounds 1.9 * fl(1/448) = 0.00424 up to 2^-7 (E8M0 code 127 - 7 = 120),
    # so 1.9 * 2^7 = 243.2 -> E4M3 ulp 16 in [128, 256) -> 240: no saturation.
    # The OCP rule floor(log2 1.9) - 8 = -8 (code 119) would give 486.4 -> saturated to 448.
    x = torch.zeros(2, 32)
    x[0, 0] = 1.9
    x[1, :] = 448.0  # exactly the max: 448 * fl(1/448) == 1 in fp32 -> 2^0, code 127
    q = quantize_mxfp8(x)
    assert encode_e8m0(q.scales).tolist() == [[120], [127]]
    assert q.elements[0, 0].item() == 240.0 and q.elements[1, 0].item() == 448.0
    ocp = quantize_mxfp8(x, scale_rule="ocp")  # 448 = 1.75 * 2^8: floor(log2) - 8 = 0, also code 127
    assert encode_e8m0(ocp.scales).tolist() == [[119], [127]]
    assert ocp.elements[0, 0].item() == 448.0


def test_mxfp4_hand_block():
    # 32 values given as scaled values s, x = s / 8. amax = 7.6 / 8 = 0.95;
    # OCP: floor(log2 0.95) = -1, shared exponent -1 - emax(E2M1)=2 -> -3, X = 2^-3,
    # E8M0 byte = -3 + 127 = 124 = 0x7C. Elements = E2M1_rne(x / X) = E2M1_rne(s).
    s = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7.6,
         -0.25, -0.3, -0.75, -1.1, -1.3, -2.2, -2.75, -3.25, -4.4, -5.5, -7, 0.1, 0.6, 2.9, 4.6, 5.2]  # fmt: skip
    expected_elements = [0, 0, 0.5, 1, 1, 1, 1.5, 2, 2, 2, 3, 4, 4, 4, 6, 6,  # ties to even; 7.6 saturates
                         -0.0, -0.5, -1, -1, -1.5, -2, -3, -3, -4, -6, -6, 0, 0.5, 3, 4, 6]  # fmt: skip
    expected_codes = [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 7,
                      8, 9, 10, 10, 11, 12, 13, 13, 14, 15, 15, 0, 1, 5, 6, 7]  # fmt: skip
    x = t(s) / 8
    q = quantize_mxfp4(x)
    assert encode_e8m0(q.scales).tolist() == [0x7C]
    assert same(q.elements, t(expected_elements))
    assert encode_e2m1(q.elements).tolist() == expected_codes
    assert same(q.dequantized, t(expected_elements) / 8)


def test_mx_zero_block_and_partial_block():
    x = torch.zeros(40)
    x[35] = 3.0  # second block is partial (8 real elements, 24 zero padding)
    q = quantize_mxfp4(x)
    assert encode_e8m0(q.scales).tolist() == [0, 127 + 1 - 2]  # zero block -> code 0 (2^-127)
    assert q.dequantized.tolist() == x.tolist() and not torch.isnan(q.dequantized).any()


# ---------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------


def test_nvfp4_hand_block_with_global_amax():
    # Global amax override 10.5 (e.g. all-reduced): S_enc = 448 * 6 / 10.5 = 256 exactly, S_dec = 2^-8.
    # Block amax 1.0: s_b = E4M3(1.0 * 256 / 6 = 42.67); E4M3 spacing in [32, 64) is 4 -> 44
    #   = 1.375 * 2^5 -> byte 0.1100.011 = 0x63.
    # Block encode scale 1 / (44 * 2^-8) = 5.818..., i.e. x = s * 44/256 = s * 0.171875 maps to s.
    s = [0, 0.2, 0.3, -0.7, 0.8, 1.2, 1.3, -1.7, 1.8, 2.4, 2.6, -3.4, 3.6, 4.9, 5.1]
    x = torch.cat([t(s) * 0.171875, t([1.0])])  # last: 1.0 -> 5.818 -> 6
    expected_elements = [0, 0, 0.5, -0.5, 1, 1, 1.5, -1.5, 2, 2, 3, -3, 4, 4, 6, 6]
    expected_codes = [0, 0, 1, 9, 2, 2, 3, 11, 4, 4, 5, 13, 6, 6, 7, 7]
    q = quantize_nvfp4(x, amax=10.5)
    assert q.global_scale.item() == 256.0
    assert encode_e4m3(q.block_scales).tolist() == [0x63]
    assert q.elements.tolist() == expected_elements
    assert encode_e2m1(q.elements).tolist() == expected_codes
    # dequantized = element * 44 / 256 (exact here)
    assert q.dequantized.tolist() == (t(expected_elements) * 44 / 256).tolist()


def test_nvfp4_global_max_block_uses_full_e4m3_range():
    # Tensor amax 3: S_enc = 2688 / 3 = 896; s_b = 3 * fl(896 * fl(1/6)) = 448.00003 -> E4M3 448 (0x7E);
    # encode = 1 / (448 / 896) = 2: 3 -> 6, 1 -> 2, -0.5 -> -1.
    q = quantize_nvfp4(torch.cat([t([3.0, 1.0, -0.5]), torch.zeros(13)]))
    assert q.global_scale.item() == 896.0
    assert encode_e4m3(q.block_scales).tolist() == [0x7E]
    assert q.elements[:3].tolist() == [6.0, 2.0, -1.0]
    assert q.dequantized[:3].tolist() == [3.0, 1.0, -0.5]


def test_nvfp4_zero_tensor_and_zero_block():
    zero = quantize_nvfp4(torch.zeros(2, 32))
    assert zero.global_scale.item() == 1.0 and torch.equal(zero.dequantized, torch.zeros(2, 32))
    x = torch.zeros(32)
    x[3] = 5.0  # second block all zeros -> s_b = 0, dequantized 0
    q = quantize_nvfp4(x)
    assert q.block_scales.tolist() == [448.0, 0.0]
    assert not torch.isnan(q.dequantized).any() and q.dequantized[16:].abs().sum() == 0


# ---------------------------------------------------------------------------
# Block quantizers vs a scalar, block-by-block reference in numpy float32
# (each numpy float32 operation is one correctly rounded fp32 operation, so
# the reference spells out the order of operations of TE's kernels).
# ---------------------------------------------------------------------------

F32 = np.float32
F32_MAX = np.finfo(np.float32).max


def ref_round(v, name):
    return oracle_round(torch.from_numpy(np.asarray(v, dtype=np.float32)), name).numpy()


def ref_blocks(x: np.ndarray, br: int, bc: int):
    """Yield (row slice, col slice) of each block of a 2-D array; partial blocks are just smaller."""
    for r in range(0, x.shape[0], br):
        for c in range(0, x.shape[1], bc):
            yield slice(r, r + br), slice(c, c + bc)


def ref_nvfp4(x: np.ndarray, br: int):
    g = F32(np.abs(x).max())
    s_enc = F32(1) if g == 0 else min(F32(448 * 6) / g, F32_MAX)
    s_dec = F32(1) / s_enc
    mult = s_enc * F32(1 / 6)
    elements, scales = np.zeros_like(x), []
    for rs, cs in ref_blocks(x, br, 16):
        s_b = ref_round(F32(np.abs(x[rs, cs]).max()) * mult, "e4m3")
        enc = min(F32(1) / (s_b * s_dec), F32_MAX) if s_b != 0 else F32_MAX
        elements[rs, cs] = ref_round(x[rs, cs] * enc, "e2m1")
        scales.append(s_b)
    return elements, np.array(scales, dtype=np.float32), s_enc


def ref_e8m0_exponent(amax: np.float32, rule: str, elem_max: float, elem_emax: int) -> int:
    if amax == 0:
        return -127
    if rule == "ceil":  # smallest 2^k >= amax * fl(1/max)
        mant, exp = math.frexp(float(amax * F32(1 / elem_max)))
        k = exp - 1 if mant == 0.5 else exp
    else:  # floor(log2 amax) - emax
        k = math.frexp(float(amax))[1] - 1 - elem_emax
    return max(-127, min(127, k))


def ref_mx(x: np.ndarray, name: str, rule: str, elem_max: float, elem_emax: int):
    elements, scales = np.zeros_like(x), []
    for rs, cs in ref_blocks(x, 1, 32):
        k = ref_e8m0_exponent(F32(np.abs(x[rs, cs]).max()), rule, elem_max, elem_emax)
        elements[rs, cs] = ref_round(x[rs, cs] * F32(2.0**-k), name)
        scales.append(F32(2.0**k))
    return elements, np.array(scales, dtype=np.float32)


def ref_fp8_block(x: np.ndarray, br: int, pow2: bool):
    elements, scales = np.zeros_like(x), []
    for rs, cs in ref_blocks(x, br, 128):
        amax = F32(np.abs(x[rs, cs]).max())
        scale = F32(1) if amax == 0 else F32(448) / amax
        if pow2:
            scale = F32(2.0 ** (math.frexp(float(scale))[1] - 1))
        elements[rs, cs] = ref_round(x[rs, cs] * scale, "e4m3")
        scales.append(F32(1) / scale)
    return elements, np.array(scales, dtype=np.float32)


def reference_input(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 7, (shape[0], 1), generator=gen))
    x[0, : shape[1] // 2] = 0.0  # zero blocks
    return x


@pytest.mark.parametrize("shape", [(4, 64), (5, 70), (33, 47)])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_quantizers_match_scalar_reference(shape, seed):
    x = reference_input(shape, seed)
    xn = x.numpy()
    for br in (1, 16):
        q = quantize_nvfp4(x, block=(br, 16))
        elements, scales, s_enc = ref_nvfp4(xn, br)
        assert q.global_scale.item() == s_enc
        assert np.array_equal(q.elements.numpy(), elements)
        assert np.array_equal(q.block_scales.flatten().numpy(), scales)
    for quantize, name, rule, emax in ((quantize_mxfp8, "e4m3", "ceil", 8), (quantize_mxfp4, "e2m1", "ocp", 2)):
        q = quantize(x)
        elements, scales = ref_mx(xn, name, rule, {"e4m3": 448.0, "e2m1": 6.0}[name], emax)
        assert np.array_equal(q.elements.numpy(), elements)
        assert np.array_equal(q.scales.flatten().numpy(), scales)
    for br in (1, 128):
        for pow2 in (True, False):
            q = quantize_fp8_block(x, block=(br, 128), pow2_scale=pow2)
            elements, scales = ref_fp8_block(xn, br, pow2)
            assert np.array_equal(q.elements.numpy(), elements)
            assert np.array_equal(q.scales.flatten().numpy(), scales)


def nvfp4_midpoint_input(global_amax: float = 3.7) -> torch.Tensor:
    """Blocks built so that the last fp32 bit of the scale arithmetic decides the rounding.

    (a) block amaxes whose block scale amax * S_enc / 6 is (within fp32 ulps) an E4M3
        midpoint, so the order of operations decides which way s_b rounds;
    (b) blocks with an exactly representable s_b = g and elements that the block encode
        scale maps (within fp32 ulps) onto E2M1 midpoints, so the way enc_b is computed
        decides which way the elements round.
    Rows of 16; the first row holds the global amax.
    """
    s_enc = 448 * 6 / global_amax  # float64: only used to aim near the midpoints
    grid = oracle_magnitudes("e4m3")
    normal = grid[(grid >= 2.0**-6)]
    rows = [[global_amax] + [0.0] * 15]
    for mid in ((normal[1:] + normal[:-1]) / 2).tolist():
        amax = torch.tensor(mid * 6 / s_enc, dtype=torch.float32)
        for a in (amax.nextafter(torch.tensor(0.0)), amax, amax.nextafter(torch.tensor(1e9))):
            rows.append([a.item()] + [0.0] * 15)
    e2m1_mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for g in normal[normal <= 256].tolist()[::3]:
        x = (e2m1_mids * g / s_enc).float()
        vals = torch.cat([x, x.nextafter(torch.zeros_like(x)), x.nextafter(torch.full_like(x, 1e9))])
        amax = g * 6 / s_enc  # s_raw ~= g: s_b = g whichever way it is computed
        rows.append([amax] + vals[:15].tolist())
        rows.append([amax] + vals[15:].tolist() + [0.0] * 9)
    return torch.tensor(rows, dtype=torch.float32)


def test_nvfp4_order_of_operations_on_midpoints():
    x = nvfp4_midpoint_input()
    q = quantize_nvfp4(x)
    elements, scales, s_enc = ref_nvfp4(x.numpy(), 1)
    assert q.global_scale.item() == s_enc
    assert np.array_equal(q.block_scales.flatten().numpy(), scales)
    assert np.array_equal(q.elements.numpy(), elements)


# ---------------------------------------------------------------------------
# Non-finite inputs: a scaling group with a NaN/Inf amax dequantizes to NaN
# ---------------------------------------------------------------------------

# which elements turn NaN when element 5 of a (2, 256) tensor is non-finite
NONFINITE_REACH = {
    "bf16": "element",
    "fp8_e4m3": "tensor",
    "fp8_e5m2": "tensor",
    "fp8_rowwise": "block",  # the row
    "fp8_block": "block",  # 1x128
    "mxfp8": "block",  # 1x32
    "mxfp4": "block",
    "nvfp4": "tensor",  # the global amax is non-finite
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_inputs_propagate(fmt, bad):
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    x[0, 5] = bad
    y = fake_quantize(x, fmt)
    reach = NONFINITE_REACH[fmt]
    if reach == "element":
        assert torch.equal(torch.isfinite(y), torch.isfinite(x))
        if math.isnan(bad):
            assert math.isnan(y[0, 5].item())
        else:
            assert y[0, 5].item() == bad
        return
    block = {"fp8_rowwise": 256, "fp8_block": 128, "mxfp8": 32, "mxfp4": 32}.get(fmt)
    expect_nan = torch.zeros_like(x, dtype=torch.bool)
    if reach == "tensor":
        expect_nan[:] = True
    else:
        expect_nan[0, :block] = True
    assert torch.equal(torch.isnan(y), expect_nan)


# ---------------------------------------------------------------------------
# fake_quantize API
# ---------------------------------------------------------------------------


def test_format_helpers():
    assert FORMATS == ("bf16", "fp8_e4m3", "fp8_e5m2", "fp8_rowwise", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
    assert [f for f in FORMATS if element_bits(f) == 4] == ["mxfp4", "nvfp4"]
    assert [f for f in FORMATS if element_bits(f) == 8] == ["fp8_e4m3", "fp8_e5m2", "fp8_rowwise", "fp8_block",
                                                              "mxfp8"]
    assert element_bits("bf16") == 16
    with pytest.raises(ValueError, match="nvfp4"):
        element_bits("fp3")
    # Precision names (the registry's vocabulary) count toward the FP4 budget by their family.
    assert [p for p in ("bf16", "fp8", "mxfp4", "nvfp4") if is_fp4(p)] == ["mxfp4", "nvfp4"]


def test_unknown_format_or_role_lists_valid_names():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="fp8_e4m3.*mxfp4"):
        fake_quantize(x, "int8")
    with pytest.raises(ValueError, match="activation, weight, grad"):
        fake_quantize(x, "nvfp4", role="bias")


def test_fake_quantize_dispatch():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen)
    assert torch.equal(fake_quantize(x, "bf16"), x.to(torch.bfloat16).float())
    assert torch.equal(fake_quantize(x, "fp8_e5m2"), quantize_fp8_tensorwise(x, E5M2).dequantized)
    assert torch.equal(fake_quantize(x, "nvfp4", role="weight"), quantize_nvfp4(x, block=(16, 16)).dequantized)
    assert torch.equal(fake_quantize(x, "fp8_block", role="grad"), quantize_fp8_block(x).dequantized)
    # stochastic only changes E2M1 formats
    sr = fake_quantize(x, "mxfp4", stochastic=True, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(sr, fake_quantize(x, "mxfp4"))
    assert torch.equal(fake_quantize(x, "mxfp8", stochastic=True), fake_quantize(x, "mxfp8"))
    assert fake_quantize(torch.zeros(0, 16), "nvfp4").shape == (0, 16)
    # the lower-level quantizers are strict
    with pytest.raises(ValueError, match="E2M1"):
        quantize_mx(x, E4M3, scale_rule="ceil", stochastic=True)
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_mxfp4(x, scale_rule="round")


# ---------------------------------------------------------------------------
# Hadamard
# ---------------------------------------------------------------------------


def test_hadamard_matrix_exact():
    h = hadamard_matrix(16, dtype=torch.float64)
    assert set(h.flatten().tolist()) == {0.25, -0.25}
    assert torch.equal(h @ h.T, torch.eye(16, dtype=torch.float64))
    with pytest.raises(ValueError):
        hadamard_matrix(12)


def test_random_signs_and_inverse():
    signs = random_signs(seed=7)
    assert set(signs.tolist()) <= {1.0, -1.0} and torch.equal(signs, random_signs(seed=7))
    x = torch.randn(48, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = random_hadamard_transform(x, signs, dim=0)
    assert y.shape == x.shape and not torch.allclose(y, x)
    torch.testing.assert_close(inverse_random_hadamard_transform(y, signs, dim=0), x, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="divisible"):
        random_hadamard_transform(torch.ones(20, 3), signs, dim=0)


# ---------------------------------------------------------------------------
# Same bits on CUDA (runs only where a GPU is present)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("role", ["activation", "weight"])
def test_cuda_matches_cpu(fmt, role):
    x = torch.randn(96, 200, generator=torch.Generator().manual_seed(0)) * 3
    x[5, :40] = 0.0
    cpu = fake_quantize(x, fmt, role=role)
    gpu = fake_quantize(x.cuda(), fmt, role=role).cpu()
    assert same(gpu, cpu)
    gen = torch.Generator(device="cuda").manual_seed(0)
    assert fake_quantize(x.cuda(), fmt, role=role, stochastic=True, generator=gen).shape == x.shape
