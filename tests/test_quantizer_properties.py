"""Property tests (hypothesis) of fake_quantize and the quantizers.

Inputs are drawn as (shape, seed, spread) and materialised with torch, which
keeps each example cheap; values are Gaussian with a per-row magnitude of
2^U(-spread, spread), plus exact zeros and a zero row, so blocks see varied
amaxes, ties and empty blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_snip.numerics import (
    E4M3,
    E5M2,
    FORMATS,
    fake_quantize,
    inverse_random_hadamard_transform,
    quantize_fp8_block,
    quantize_fp8_tensorwise,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    random_hadamard_transform,
    random_signs,
    round_e2m1_stochastic,
)

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def make_tensor(shape, seed, spread, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if x.dim() >= 1:
        rows = x.reshape(-1, shape[-1])
        rows.mul_(torch.exp2(torch.empty(rows.shape[0], 1).uniform_(-spread, spread, generator=gen)))
        rows[torch.rand(rows.shape, generator=gen) < 0.05] = 0.0
        if rows.shape[0] > 2:
            rows[0] = 0.0
    return x.to(dtype)


shapes = st.lists(st.integers(1, 48), min_size=1, max_size=3).map(tuple)
seeds = st.integers(0, 2**31 - 1)
spreads = st.integers(0, 4)  # dynamic range across rows: up to 2^8


# ---------------------------------------------------------------------------
# Shape / dtype contract
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("role", ["activation", "weight"])
def test_keeps_shape_and_dtype(fmt, dtype, role):
    for shape in [(37,), (3, 5, 48), (2, 1, 3, 33)]:
        x = make_tensor(shape, 0, 2, dtype)
        y = fake_quantize(x, fmt, role=role)
        assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_leading_dims_are_independent_rows(fmt):
    """1-D blocks: (A, B, C) quantizes like (A*B, C); for fp8 per-tensor/nvfp4 the tensor amax is shared anyway."""
    x = make_tensor((4, 6, 96), 1, 3)
    assert torch.equal(fake_quantize(x, fmt), fake_quantize(x.reshape(24, 96), fmt).reshape(4, 6, 96))


# ---------------------------------------------------------------------------
# Idempotence
# ---------------------------------------------------------------------------

# Power-of-two scales (and bf16) re-derive the same scale from the dequantized
# tensor, so quantization is exactly idempotent. The fp32-scale formats
# re-derive scale = max / amax' from amax' = max * (1/scale): fl(a / fl(a / s))
# equals s only ~63% of the time, so the second pass may use a scale one or
# two fp32 ulps away. The element codes are still identical (a perturbation of
# ~2^-22 relative cannot cross an FP8/FP4 rounding midpoint from a grid
# point), and values agree within that relative 2^-21.
EXACTLY_IDEMPOTENT = {"bf16", "fp8_block", "mxfp8", "mxfp4"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("role", ["activation", "weight"])
@SETTINGS
@given(shape=shapes, seed=seeds, spread=spreads)
def test_idempotent(fmt, role, shape, seed, spread):
    x = make_tensor(shape, seed, spread)
    once = fake_quantize(x, fmt, role=role)
    twice = fake_quantize(once, fmt, role=role)
    if fmt in EXACTLY_IDEMPOTENT:
        assert torch.equal(twice, once)
    else:
        torch.testing.assert_close(twice, once, rtol=2**-21, atol=0)


@SETTINGS
@given(shape=shapes, seed=seeds, spread=spreads, weight=st.booleans())
def test_element_codes_idempotent(shape, seed, spread, weight):
    """For the fp32-scale formats the re-quantized elements and block scales are bit-identical."""
    x = make_tensor(shape, seed, spread)
    for fmt in (E4M3, E5M2):
        first = quantize_fp8_tensorwise(x, fmt)
        assert torch.equal(quantize_fp8_tensorwise(first.dequantized, fmt).elements, first.elements)
    block = (16, 16) if weight else (1, 16)
    first = quantize_nvfp4(x, block=block)
    second = quantize_nvfp4(first.dequantized, block=block)
    assert torch.equal(second.elements, first.elements)
    assert torch.equal(second.block_scales, first.block_scales)


# ---------------------------------------------------------------------------
# Error bounds, per element, in terms of the amax of its scaling group
# ---------------------------------------------------------------------------


def group_amax(x: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """amax of each element's scaling group (None: whole tensor), broadcast to x's shape (2-D x)."""
    if block is None:
        return x.abs().amax().expand_as(x)
    br, bc = block
    r, c = x.shape
    padded = torch.nn.functional.pad(x.abs(), (0, -c % bc, 0, -r % br))
    grid = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3), keepdim=True)
    return grid.expand(-1, br, -1, bc).reshape(padded.shape)[:r, :c]


def fp8_bound(x, amax, fmt, scale_headroom):
    """RNE to a float format with m mantissa bits, group scale s >= max / (amax * headroom), no saturation:
    |err| <= half an ulp = 2^-(m+1) |x| in the normal range, 2^(emin-m-1) / s in the subnormal range."""
    m, emin = fmt.mant_bits, fmt.emin
    return 2.0 ** -(m + 1) * x.abs() + 2.0 ** (emin - m - 1) * amax * scale_headroom / fmt.max


def bound_for(fmt: str, x: torch.Tensor, weight: bool) -> torch.Tensor:
    if fmt == "bf16":  # 8 significant bits: half ulp <= 2^-8 |x|
        return 2.0**-8 * x.abs()
    if fmt in ("fp8_e4m3", "fp8_e5m2"):  # scale = max / amax exactly (up to fp32 rounding)
        return fp8_bound(x, group_amax(x, None), E4M3 if fmt == "fp8_e4m3" else E5M2, 1.0)
    if fmt == "fp8_block":  # power-of-two scale rounded down: s >= max / (2 amax)
        return fp8_bound(x, group_amax(x, (128, 128) if weight else (1, 128)), E4M3, 2.0)
    if fmt == "mxfp8":  # TE ceil rule: X < 2 amax / 448, i.e. the same headroom of 2
        return fp8_bound(x, group_amax(x, (1, 32)), E4M3, 2.0)
    if fmt == "mxfp4":
        # OCP: X = 2^(floor(log2 amax) - 2), so amax / X is in [4, 8) and X in (amax/8, amax/4].
        # Rounding: half an ulp is at most 1 unit (binade [4, 6]), i.e. <= X <= amax/4.
        # Saturation: v X with v in (6, 8) becomes 6 X, an error (v - 6) X <= amax - 6 X < amax/4.
        return group_amax(x, (1, 32)) / 4
    # nvfp4: s_b = E4M3(s_raw) with s_raw = amax_b S_enc / 6 and |s_b - s_raw| <= d = max(2^-4 s_raw, 2^-10).
    # Elements: half an ulp <= 1 unit = s_b / S_enc; saturation when s_b < s_raw costs
    # <= 6 (s_raw - s_b) / S_enc. Hence |err| <= (s_raw + 6 d) / S_enc
    #   = amax_b / 6 + max(amax_b / 16, 6 * 2^-10 / S_enc), with 1 / S_enc = amax / 2688.
    amax_b = group_amax(x, (16, 16) if weight else (1, 16))
    inv_s_enc = x.abs().amax() / (448 * 6)
    return amax_b / 6 + torch.maximum(amax_b / 16, 6 * 2.0**-10 * inv_s_enc)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("role", ["activation", "weight"])
@SETTINGS
@given(rows=st.integers(1, 150), cols=st.integers(1, 150), seed=seeds, spread=spreads)
def test_error_bound(fmt, role, rows, cols, seed, spread):
    x = make_tensor((rows, cols), seed, spread)
    err = (fake_quantize(x, fmt, role=role) - x).abs()
    slack = 2.0**-20 * x.abs()  # fp32 rounding of scales and products
    bound = bound_for(fmt, x, role == "weight")
    assert (err <= bound + slack).all(), (err - bound - slack).max()


@SETTINGS
@given(cols=st.integers(1, 100), seed=seeds)
def test_mx_scaled_amax_ranges(cols, seed):
    """TE's ceil rule puts the scaled block amax in (224, 448]; OCP's floor rule for E2M1 in [4, 8)."""
    x = make_tensor((8, cols), seed, 4)
    x[:, 0] = torch.exp2(torch.randn(8, generator=torch.Generator().manual_seed(seed)) * 10)  # wide amax range
    te = quantize_mxfp8(x)
    scaled = group_amax(x, (1, 32)) / te.scales.repeat_interleave(32, dim=-1)[:, :cols]
    nonzero = group_amax(x, (1, 32)) > 0
    assert ((scaled > 224) & (scaled <= 448))[nonzero].all()
    ocp = quantize_mxfp4(x)
    scaled = group_amax(x, (1, 32)) / ocp.scales.repeat_interleave(32, dim=-1)[:, :cols]
    assert ((scaled >= 4) & (scaled < 8))[nonzero].all()


# ---------------------------------------------------------------------------
# 2-D weight blocks: rowwise and columnwise copies agree
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block"])
@SETTINGS
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), seed=seeds, spread=spreads)
def test_weight_blocks_transpose(fmt, rows, cols, seed, spread):
    w = make_tensor((rows, cols), seed, spread)
    assert torch.equal(fake_quantize(w.T, fmt, role="weight"), fake_quantize(w, fmt, role="weight").T)


def test_weight_block_scales_transpose():
    w = make_tensor((40, 70), 5, 3)
    a, b = quantize_nvfp4(w, block=(16, 16)), quantize_nvfp4(w.T, block=(16, 16))
    assert torch.equal(a.block_scales.T, b.block_scales)
    a, b = quantize_fp8_block(w, block=(128, 128)), quantize_fp8_block(w.T, block=(128, 128))
    assert torch.equal(a.scales.T, b.scales)


# ---------------------------------------------------------------------------
# Hadamard: orthogonal, and the wgrad product is unchanged
# ---------------------------------------------------------------------------


@SETTINGS
@given(blocks=st.integers(1, 8), n_out=st.integers(1, 20), n_in=st.integers(1, 20), seed=seeds)
def test_hadamard_preserves_wgrad_product(blocks, n_out, n_in, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = 16 * blocks
    dy = torch.randn(tokens, n_out, dtype=torch.float64, generator=gen)
    x = torch.randn(tokens, n_in, dtype=torch.float64, generator=gen)
    signs = random_signs(generator=gen)
    hdy, hx = random_hadamard_transform(dy, signs, dim=0), random_hadamard_transform(x, signs, dim=0)
    # fp64: each output is a sum of `tokens` products; rounding error ~ tokens * 2^-53 * sum|a b|
    scale = dy.abs().T @ x.abs()
    assert ((hdy.T @ hx - dy.T @ x).abs() <= 64 * tokens * 2.0**-53 * scale).all()
    # orthogonality of the whole transform: it preserves norms and inverts exactly (up to fp64 rounding)
    torch.testing.assert_close(hx.norm(), x.norm(), rtol=1e-13, atol=0)
    torch.testing.assert_close(inverse_random_hadamard_transform(hx, signs, dim=0), x, rtol=0, atol=1e-13)
    # along another dimension
    xt = random_hadamard_transform(x.T.contiguous(), signs, dim=1)
    torch.testing.assert_close(xt, hx.T, rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------
# Stochastic rounding is unbiased
# ---------------------------------------------------------------------------

SAMPLES = 4096


def assert_unbiased(samples: torch.Tensor, target: torch.Tensor, spacing: torch.Tensor):
    """samples: (SAMPLES, n) SR outcomes of ``target`` (n,), each the lower or upper neighbour at ``spacing``.

    Per element, an outcome is lo + spacing * Bernoulli(p), p = (target - lo) / spacing, so the
    sample mean has standard deviation sigma = spacing * sqrt(p (1 - p) / SAMPLES) <= spacing / 128.
    We accept |mean - target| <= 6 sigma + 2^-20 |target| (fp rounding); with a fixed seed the
    test is deterministic, and a 6-sigma miss among ~1000 unbiased elements has probability ~2e-6.
    """
    mean = samples.double().mean(dim=0)
    lo = torch.floor(target.double() / spacing) * spacing
    p = (target.double() - lo) / spacing
    sigma = spacing * torch.sqrt(p * (1 - p) / samples.shape[0])
    assert ((mean - target.double()).abs() <= 6 * sigma + 2.0**-20 * target.abs().double()).all()
    varies = (samples != samples[0]).any(dim=0)
    assert not varies[p == 0].any()  # grid values are never moved
    assert varies[(p > 0.01) & (p < 0.99)].all()  # P(no variation in 4096 draws) < 0.99^4096 ~ 1e-18


def e2m1_spacing(a: torch.Tensor) -> torch.Tensor:
    a = a.abs().double()
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def test_sr_e2m1_unbiased():
    gen = torch.Generator().manual_seed(0)
    x = torch.empty(512).uniform_(0, 6, generator=gen)
    x[:16] = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.999])
    samples = round_e2m1_stochastic(x.expand(SAMPLES, -1), gen)
    assert_unbiased(samples, x, e2m1_spacing(x))


def test_sr_mxfp4_unbiased():
    # Every 32-block holds +-6 * 2^k, so X = 2^k exactly and the scaled block amax is 6: no saturation.
    gen = torch.Generator().manual_seed(1)
    k = torch.randint(-3, 4, (16, 1), generator=gen).float()
    x = (torch.empty(16, 32).uniform_(-6, 6, generator=gen) * torch.exp2(k))
    x[:, 0] = 6 * torch.exp2(k[:, 0])
    x = x.flatten()
    samples = fake_quantize(x.expand(SAMPLES, -1), "mxfp4", stochastic=True, generator=gen)
    scale = torch.exp2(k).expand(16, 32).flatten().double()
    assert_unbiased(samples, x, e2m1_spacing(x / scale) * scale)


def test_sr_nvfp4_unbiased():
    # Every 16-block holds the global amax G, so every block scale is 448 and x maps to 6 x / G
    # (up to an fp32 ulp): no saturation, and SR acts on the elements only.
    gen = torch.Generator().manual_seed(2)
    x = torch.empty(64, 16).uniform_(-1.5, 1.5, generator=gen)
    x[:, 0] = 1.5
    x = x.flatten()
    samples = fake_quantize(x.expand(SAMPLES, -1), "nvfp4", stochastic=True, generator=gen)
    unit = 1.5 / 6
    assert_unbiased(samples, x, e2m1_spacing(x / unit) * unit)
