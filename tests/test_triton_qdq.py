"""The fused Triton quantize-dequantize kernels are bit-identical to the torch reference.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which
conftest.py sets before triton is imported), which executes the same kernel code on CPU
tensors in numpy fp32 arithmetic; with CUDA they are compiled and run on the GPU.
Either way every output bit, NaN positions and signed zeros included, must equal
the reference quantizer's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # on CPU conftest.py has set TRITON_INTERPRET=1

from megatron_snip.numerics import triton_qdq
from megatron_snip.numerics.blocks import tensor_amax
from megatron_snip.numerics.formats import E2M1, E4M3, E5M2
from megatron_snip.numerics.fp8 import _apply_tensor_scale, fp8_scale_from_amax, quantize_fp8_block
from megatron_snip.numerics.linear import QuantState, quantized_linear
from megatron_snip.numerics.mx import quantize_mx
from megatron_snip.numerics.nvfp4 import quantize_nvfp4
from megatron_snip.numerics.recipes import Precision, RecipeConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda,  # compiled and run on the GPU when there is one
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # numpy: 1/0 in padded interpreter lanes


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float32
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), "NaN positions differ"
    a, e = actual.masked_fill(nan, 0), expected.masked_fill(nan, 0)
    mismatch = a.view(torch.int32) != e.view(torch.int32)  # distinguishes -0 from +0
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} of {a.numel()} elements differ, e.g. {a[mismatch][:4].tolist()} "
        f"vs {e[mismatch][:4].tolist()}"
    )


def operand(rows: int = 37, cols: int = 200, *, seed: int = 0, specials: bool = True) -> torch.Tensor:
    """Values over 10 decades (so many blocks underflow or saturate their scales), partial
    blocks in both dims, and optionally a NaN, an Inf, a zero block and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 4, cols)
    x[5, :48] = 0.0
    x[6, 17] = -0.0
    x[8, 3] = 1e-42  # an fp32 subnormal
    if specials:
        x[3, 5] = float("nan")
        x[7, 100] = float("-inf")
    return x.to(DEVICE)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("specials", [False, True])
def test_fp8_tensorwise(fmt, specials):
    x = operand(specials=specials)
    scale = fp8_scale_from_amax(tensor_amax(x), fmt)
    assert_same_bits(triton_qdq.qdq_fp8_tensorwise(x, scale, fmt), _apply_tensor_scale(x, scale, fmt).dequantized)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_block(block, pow2):
    x = operand(150, 300)
    expected = quantize_fp8_block(x, block=block, pow2_scale=pow2).dequantized
    assert_same_bits(triton_qdq.qdq_fp8_block(x, block=block, pow2_scale=pow2), expected)


@pytest.mark.parametrize("elem", [E4M3, E2M1], ids=lambda f: f.name)
@pytest.mark.parametrize("rule", ["ceil", "ocp"])
def test_mx(elem, rule):
    x = operand()
    assert_same_bits(triton_qdq.qdq_mx(x, elem, scale_rule=rule), quantize_mx(x, elem, scale_rule=rule).dequantized)


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("specials", [False, True])
def test_nvfp4(block, specials):
    x = operand(specials=specials)
    expected = quantize_nvfp4(x, block=block).dequantized
    assert_same_bits(triton_qdq.qdq_nvfp4(x, block=block, global_amax=tensor_amax(x)), expected)


def test_nvfp4_with_a_tensor_parallel_amax():
    x = operand(specials=False)
    amax = torch.tensor(3.0e5, device=DEVICE)  # the all-shard amax, larger than this shard's
    assert_same_bits(triton_qdq.qdq_nvfp4(x, block=(1, 16), global_amax=amax),
                     quantize_nvfp4(x, block=(1, 16), amax=amax).dequantized)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_stochastic_rounding_draws_the_reference_numbers(fmt):
    x = operand(33, 70, specials=False)  # partial blocks: the draws cover the padded layout
    if fmt == "nvfp4":
        def kernel(g):
            return triton_qdq.qdq_nvfp4(x, block=(1, 16), global_amax=tensor_amax(x), stochastic=True, generator=g)

        def reference(g):
            return quantize_nvfp4(x, block=(1, 16), stochastic=True, generator=g).dequantized
    else:
        def kernel(g):
            return triton_qdq.qdq_mx(x, E2M1, scale_rule="ocp", stochastic=True, generator=g)

        def reference(g):
            return quantize_mx(x, E2M1, scale_rule="ocp", stochastic=True, generator=g).dequantized
    g_kernel, g_ref = (torch.Generator(device=DEVICE).manual_seed(11) for _ in range(2))
    first = kernel(g_kernel)
    assert_same_bits(first, reference(g_ref))
    second = kernel(g_kernel)  # the generator advanced as the reference's did
    assert_same_bits(second, reference(g_ref))
    assert not torch.equal(first, second)


def test_strided_bf16_input_is_read_without_a_copy():
    """Columnwise copies come in as transposed views, activations as bf16."""
    x = operand(64, 96, specials=False).to(torch.bfloat16).t()
    assert not x.is_contiguous()
    expected = quantize_nvfp4(x.float(), block=(1, 16)).dequantized
    actual = triton_qdq.qdq_nvfp4(x, block=(1, 16), global_amax=tensor_amax(x).float())
    assert_same_bits(actual, expected)
    # and laid out as the reference's result, so the GEMM after it sums in the same order on a GPU
    assert actual.stride() == expected.stride() == x.stride()


@pytest.mark.parametrize("precision,fp8_recipe", [("fp8", "blockwise"), ("fp8", "mxfp8"), ("nvfp4", "tensorwise"),
                                                   ("mxfp4", "tensorwise")])
@pytest.mark.parametrize("transposed", [False, True])
def test_reference_and_kernels_lay_out_their_result_alike(precision, fp8_recipe, transposed):
    """Partial blocks (96 x 40 in 128-blocks, 16-blocks and 32-blocks) leave the reference a padded
    row stride unless the dispatch restores the input's layout; a GEMM on a GPU sums in a
    stride-dependent order, so an ulp-exact layer needs both paths to agree on the strides."""
    from megatron_snip.numerics.linear import LinearQuantization
    from megatron_snip.numerics.quantize import quantize_dequantize

    x = operand(96, 40, specials=False)
    x = x.t().contiguous().t() if transposed else x
    quant = LinearQuantization(Precision.uniform(precision), RecipeConfig(fp8_recipe=fp8_recipe), QuantState())
    for gemm, name in [("fprop", "x"), ("fprop", "w"), ("dgrad", "w"), ("wgrad", "x"), ("wgrad", "dy")]:
        q = quant.quantizer(gemm, name)
        draws = [torch.Generator(DEVICE).manual_seed(3) for _ in range(2)]  # stochastic rounding: same numbers
        reference = quantize_dequantize(x, q, generator=draws[0])
        fused = quantize_dequantize(x, q, generator=draws[1], kernels=triton_qdq)
        assert reference.stride() == fused.stride() == x.stride(), (gemm, name, q.scheme)
        assert_same_bits(fused, reference)


def test_non_2d_input_is_refused():
    with pytest.raises(ValueError, match="2-D"):
        triton_qdq.qdq_fp8_block(torch.zeros(2, 3, 4, device=DEVICE))


LAYER_CASES = [("nvfp4", "tensorwise"), ("mxfp4", "tensorwise"), ("fp8/nvfp4", "delayed")] + [
    ("fp8", recipe) for recipe in ("tensorwise", "delayed", "blockwise", "mxfp8")]


@pytest.mark.parametrize("precision,fp8_recipe", LAYER_CASES)
def test_quantized_linear_with_kernels_equals_reference(precision, fp8_recipe):
    """The whole layer, forward and both gradients, with every operand through the kernels
    (Hadamard and stochastic rounding included) gives the reference's bits."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 24, 64, generator=g).to(DEVICE)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(DEVICE)
    dy = torch.randn(4, 24, 96, generator=g).to(DEVICE)
    results = []
    for kernels in ("triton", "torch"):
        recipe = RecipeConfig(fp8_recipe=fp8_recipe, kernels=kernels, fp8_gemm="emulated")
        state = QuantState(seed=5, stream=2)
        outputs = []
        for _ in range(2):  # two steps: delayed scaling uses the first step's amax in the second
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = quantized_linear(xr, wr, Precision.parse(precision), recipe, state)
            y.backward(dy)
            outputs += [y.detach(), xr.grad, wr.grad]
        results.append(outputs)
    assert [len(r) for r in results] == [6, 6]  # two steps x (y, dx, dw) per kernel path
    for actual, expected in zip(*results):
        assert_same_bits(actual, expected)
