"""Per-tensor FP8 GEMMs through ``torch._scaled_mm`` (the FP8 tensor-core path) agree with the
emulated GEMMs up to fp32 accumulation order.

torch implements ``_scaled_mm`` on CPU too, so the path runs here on every machine; on a
GPU with FP8 tensor cores (compute capability >= 8.9) the same tests run on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.numerics.formats import E4M3, E5M2
from megatron_snip.numerics.fp8 import quantize_fp8_tensorwise
from megatron_snip.numerics.linear import QuantState, quantized_linear, scaled_mm_enabled
from megatron_snip.numerics.recipes import Precision, RecipeConfig

pytestmark = pytest.mark.cuda  # the same cases on the GPU's FP8 tensor cores where it has them
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) else [])


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Counts the calls that reach torch._scaled_mm (and lets them through)."""
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


def run_layer(x, w, dy, fp8_gemm, *, fp8_recipe="tensorwise", fp8_format="hybrid", steps=1, kernels="torch"):
    recipe = RecipeConfig(fp8_recipe=fp8_recipe, fp8_format=fp8_format, fp8_gemm=fp8_gemm, kernels=kernels)
    state = QuantState(seed=1)
    for _ in range(steps):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_linear(xr, wr, Precision.uniform("fp8"), recipe, state)
        y.backward(dy)
    return y.detach(), xr.grad, wr.grad


def unit_roundoff(device: str) -> float:
    """The accumulator's unit roundoff: fp32 (2^-24) on CPU; on a GPU the FP8 tensor cores'.
    Hopper's FP8 MMA keeps about 14 bits in its accumulator before cuBLAS promotes partial sums
    to fp32 (DeepSeek-V3 report, section 3.3.2); measured on an H200 (2026-11-25), the K=64 GEMMs
    here differed from fp32 by up to 8x the fp32 bound. A wrong scale or layout errs by O(1)."""
    return 2.0**-24 if device == "cpu" else 2.0**-14


def accumulation_bound(a: torch.Tensor, b: torch.Tensor, u: float = 2.0**-24) -> torch.Tensor:
    """|fl(A B) - fl'(A B)| for two evaluations of a GEMM over K with unit roundoff u: each is
    within (K + 2) u (|A| |B|) of the exact product (K accumulations, the operands' own
    dequantisation rounding twice); the difference within twice that."""
    k = a.shape[1]
    return 2 * (k + 2) * u * (a.abs() @ b.abs())


def dequantized(t: torch.Tensor, fmt) -> torch.Tensor:
    return quantize_fp8_tensorwise(t, fmt).dequantized


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_scaled_mm_matches_emulated_within_accumulation_order(device, fp8_format, scaled_mm_calls):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, 64, generator=g).to(device)
    w = (torch.randn(32, 64, generator=g) * 0.05).to(device)
    dy = torch.randn(2, 48, 32, generator=g).to(device)
    y, dx, dw = run_layer(x, w, dy, "scaled_mm", fp8_format=fp8_format)
    assert len(scaled_mm_calls) == 3, "fprop, dgrad and wgrad should all run on the FP8 bytes"
    y_e, dx_e, dw_e = run_layer(x, w, dy, "emulated", fp8_format=fp8_format)
    assert len(scaled_mm_calls) == 3

    grad_fmt = E5M2 if fp8_format == "hybrid" else E4M3
    xq, wq = dequantized(x.reshape(-1, 64), E4M3), dequantized(w, E4M3)
    dyq = dequantized(dy.reshape(-1, 32), grad_fmt)
    u = unit_roundoff(device)
    for actual, expected, bound in (
        (y.reshape(-1, 32), y_e.reshape(-1, 32), accumulation_bound(xq, wq.t(), u)),
        (dx.reshape(-1, 64), dx_e.reshape(-1, 64), accumulation_bound(dyq, wq, u)),
        (dw, dw_e, accumulation_bound(dyq.t(), xq, u)),
    ):
        assert torch.all((actual - expected).abs() <= bound), (actual - expected).abs().max()
        assert not torch.equal(bound, torch.zeros_like(bound))


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_through_scaled_mm(device, scaled_mm_calls):
    """Delayed scaling keeps its history on the bytes path: the second step uses the first
    step's amax in both paths, so the results stay within the accumulation bound."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g).to(device)
    w = torch.randn(16, 32, generator=g).to(device)
    dy = torch.randn(64, 16, generator=g).to(device)
    y, dx, dw = run_layer(x, w, dy, "scaled_mm", fp8_recipe="delayed", steps=2)
    y_e, dx_e, dw_e = run_layer(x, w, dy, "emulated", fp8_recipe="delayed", steps=2)
    assert len(scaled_mm_calls) == 6
    # The operands' FP8 values are within 25% of the raw ones (E5M2's 2 mantissa bits at worst),
    # so 2 |A| |B| of the raw operands bounds |A| |B| of the quantized ones.
    u = unit_roundoff(device)
    for actual, expected, (a, b) in ((y, y_e, (x, w.t())), (dx, dx_e, (dy, w)), (dw, dw_e, (dy.t(), x))):
        assert torch.all((actual - expected).abs() <= 2 * accumulation_bound(a, b, u))


def test_shapes_scaled_mm_cannot_take_fall_back_to_the_emulated_gemm(scaled_mm_calls):
    """_scaled_mm needs every dim a multiple of 16; other shapes run the emulated GEMM on the same quantized
    values. Not bit for bit: the fallback multiplies the dequantized bytes, laid out for _scaled_mm, and the
    CPU's GEMM kernels round differently by layout and instruction set (AVX2 vs AVX-512), so the two paths
    agree within the fp32 accumulation bound (a wrong scale or a skipped quantization errs by far more)."""
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(10, 24, generator=g), torch.randn(20, 24, generator=g), torch.randn(10, 20, generator=g)
    bytes_path = run_layer(x, w, dy, "scaled_mm")
    assert scaled_mm_calls == []
    xq, wq, dyq = dequantized(x, E4M3), dequantized(w, E4M3), dequantized(dy, E5M2)
    bounds = (accumulation_bound(xq, wq.t()), accumulation_bound(dyq, wq), accumulation_bound(dyq.t(), xq))
    for actual, expected, bound in zip(bytes_path, run_layer(x, w, dy, "emulated"), bounds):
        assert torch.all((actual - expected).abs() <= bound), (actual - expected).abs().max()


def test_auto_selects_scaled_mm_only_on_fp8_gpus():
    recipe = RecipeConfig()
    assert not scaled_mm_enabled(recipe, torch.zeros(1))
    assert scaled_mm_enabled(RecipeConfig(fp8_gemm="scaled_mm"), torch.zeros(1))
    assert not scaled_mm_enabled(RecipeConfig(fp8_gemm="emulated"), torch.zeros(1))
    if torch.cuda.is_available():
        expected = torch.cuda.get_device_capability() >= (8, 9)
        assert scaled_mm_enabled(recipe, torch.zeros(1, device="cuda")) == expected


def test_unknown_backend_names_are_refused():
    with pytest.raises(ValueError, match="fp8_gemm must be one of auto, scaled_mm, emulated"):
        RecipeConfig(fp8_gemm="cublas")
    with pytest.raises(ValueError, match="kernels must be one of auto, triton, torch"):
        RecipeConfig(kernels="cuda")
