"""The quantized linear GEMMs against references built directly from the quantizers.

Each reference spells out, for one recipe, which quantizer every operand of
every GEMM gets (docs/numerics.md, "Quantized linear layers"), using
``fake_quantize`` and the quantizer functions, and must match bit for bit
where rounding is deterministic.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_snip.numerics import fake_quantize, quantize_fp8_tensorwise, quantize_nvfp4, random_hadamard_transform
from megatron_snip.numerics.formats import E4M3, E5M2
from megatron_snip.numerics.linear import QuantState, hadamard_wgrad_operands, quantized_linear
from megatron_snip.numerics.recipes import (
    BF16,
    GEMM_OPERANDS,
    OperandQuantizer,
    Precision,
    RecipeConfig,
    operand_quantizer,
    reduction_block,
)

DETERMINISTIC = RecipeConfig(fp4_stochastic_rounding=False)
TOKENS, IN, OUT = 32, 64, 48  # tokens a multiple of 16: the Hadamard transform needs no padding


def fq(t, fmt, **kw):
    return fake_quantize(t, fmt, **kw)


def operands(seed=0, dtype=torch.float32, lead=(4, 8)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, IN, generator=g).to(dtype)
    w = (torch.randn(OUT, IN, generator=g) * 0.1).to(dtype)
    dy = torch.randn(*lead, OUT, generator=g).to(dtype)
    return x, w, dy


def run(x, w, dy, precision, recipe=DETERMINISTIC, state=None, **kw):
    """(Y, dX, dW) of the quantized linear."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = quantized_linear(x, w, Precision.parse(precision), recipe, state or QuantState(seed=3), **kw)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


# Reference GEMMs per format, on 2-D fp32 operands X (T x in), W (out x in), dY (T x out):
# each returns (fprop, dgrad, wgrad) from explicitly quantized operands.
def ref_fp8_tensorwise(x, w, dy):
    xq, wq, dyq = fq(x, "fp8_e4m3"), fq(w, "fp8_e4m3"), fq(dy, "fp8_e5m2")  # HYBRID: E5M2 grads
    return xq @ wq.t(), dyq @ wq, dyq.t() @ xq


def ref_fp8_blockwise(x, w, dy):
    wq = fq(w, "fp8_block", role="weight")  # 128x128 tiles: the same for W and W^T
    return (fq(x, "fp8_block") @ wq.t(), fq(dy, "fp8_block") @ wq,
            fq(dy.t(), "fp8_block") @ fq(x.t(), "fp8_block").t())


def ref_mx(fmt):
    def ref(x, w, dy):  # 1x32 blocks along each GEMM's reduction dim: transposed copies for dgrad W, wgrad X/dY
        return (fq(x, fmt) @ fq(w, fmt).t(), fq(dy, fmt) @ fq(w.t(), fmt).t(),
                fq(dy.t(), fmt) @ fq(x.t(), fmt).t())
    return ref


def ref_nvfp4(signs):
    def ref(x, w, dy):
        wq = fq(w, "nvfp4", role="weight")  # 16x16 tiles
        mdy, mx = (random_hadamard_transform(t, signs, dim=0) for t in (dy, x))
        return (fq(x, "nvfp4") @ wq.t(), fq(dy, "nvfp4") @ wq,
                fq(mdy.t(), "nvfp4") @ fq(mx.t(), "nvfp4").t())
    return ref


def ref_bf16(x, w, dy):
    xb, wb, dyb = (t.to(torch.bfloat16).float() for t in (x, w, dy))
    return xb @ wb.t(), dyb @ wb, dyb.t() @ xb


SIGNS = QuantState(seed=3).hadamard_signs(torch.device("cpu"))
FP8_REFERENCES = {"tensorwise": ref_fp8_tensorwise, "blockwise": ref_fp8_blockwise, "mxfp8": ref_mx("mxfp8")}
REFERENCES = {"mxfp4": ref_mx("mxfp4"), "nvfp4": ref_nvfp4(SIGNS), "bf16": ref_bf16}


def reference(x, w, dy, fwd, bwd, fp8_recipe):
    refs = {**REFERENCES, "fp8": FP8_REFERENCES[fp8_recipe]}
    x2, dy2 = x.reshape(-1, IN), dy.reshape(-1, OUT)
    y = refs[fwd](x2, w, dy2)[0]
    _, dx, dw = refs[bwd](x2, w, dy2)
    return y.reshape(*x.shape[:-1], OUT), dx.reshape(x.shape), dw


@pytest.mark.parametrize("precision,fp8_recipe", [
    ("fp8", "tensorwise"), ("fp8", "blockwise"), ("fp8", "mxfp8"), ("mxfp4", "tensorwise"),
    ("nvfp4", "tensorwise"), ("bf16", "tensorwise"),
    ("fp8/nvfp4", "tensorwise"), ("nvfp4/fp8", "tensorwise"), ("mxfp4/bf16", "tensorwise"), ("bf16/fp8", "mxfp8"),
])
def test_matches_explicit_reference(precision, fp8_recipe):
    x, w, dy = operands()
    p = Precision.parse(precision)
    got = run(x, w, dy, precision, RecipeConfig(fp8_recipe=fp8_recipe, fp4_stochastic_rounding=False))
    want = reference(x, w, dy, p.fwd, p.bwd, fp8_recipe)
    for name, g, r in zip(("Y", "dX", "dW"), got, want):
        assert torch.equal(g, r), f"{precision} ({fp8_recipe}): {name} differs by {(g - r).abs().max()}"


def test_nvfp4_1d_weight_blocks_and_no_hadamard():
    x, w, dy = operands()
    recipe = RecipeConfig(fp4_stochastic_rounding=False, nvfp4_random_hadamard=False, nvfp4_2d_weights=False)
    y, dx, dw = run(x, w, dy, "nvfp4", recipe)
    x2, dy2 = x.reshape(-1, IN), dy.reshape(-1, OUT)
    assert torch.equal(y, (fq(x2, "nvfp4") @ fq(w, "nvfp4").t()).reshape(y.shape))
    assert torch.equal(dx, (fq(dy2, "nvfp4") @ fq(w.t(), "nvfp4").t()).reshape(dx.shape))
    assert torch.equal(dw, fq(dy2.t(), "nvfp4") @ fq(x2.t(), "nvfp4").t())


def test_stochastic_rounding_reproducible_and_seeded():
    x, w, dy = operands()
    recipe = RecipeConfig()  # SR on dY (default)
    a, b = run(x, w, dy, "nvfp4", recipe, QuantState(seed=5)), run(x, w, dy, "nvfp4", recipe, QuantState(seed=5))
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    c = run(x, w, dy, "nvfp4", recipe, QuantState(seed=6))
    assert torch.equal(a[0], c[0]), "the forward GEMM has no stochastic rounding"
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[2], c[2])
    # Exactly the reference with the state's generator, drawn for dgrad's dY first, then wgrad's.
    g = QuantState(seed=5).generator(torch.device("cpu"))
    x2, dy2 = x.reshape(-1, IN), dy.reshape(-1, OUT)
    wq = fq(w, "nvfp4", role="weight")
    dx = fq(dy2, "nvfp4", stochastic=True, generator=g) @ wq
    signs = QuantState(seed=5).hadamard_signs(torch.device("cpu"))
    mdy, mx = (random_hadamard_transform(t, signs, dim=0) for t in (dy2, x2))
    dw = fq(mdy.t(), "nvfp4", stochastic=True, generator=g) @ fq(mx.t(), "nvfp4").t()
    assert torch.equal(a[1], dx.reshape(a[1].shape)) and torch.equal(a[2], dw)


def test_mxfp4_stochastic_rounding_on_gradients_only():
    x, w, dy = operands()
    a, b = run(x, w, dy, "mxfp4", RecipeConfig(), QuantState(1)), run(x, w, dy, "mxfp4", RecipeConfig(), QuantState(2))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])


def test_bf16_path_is_f_linear_on_bf16_rounded_operands():
    x, w, dy = operands()
    y, dx, dw = run(x, w, dy, "bf16")
    xb, wb, dyb = (t.to(torch.bfloat16).float() for t in (x, w, dy))
    torch.testing.assert_close(y, F.linear(xb, wb))
    torch.testing.assert_close(dx, dyb @ wb)
    torch.testing.assert_close(dw, dyb.reshape(-1, OUT).t() @ xb.reshape(-1, IN))


def test_dtypes_bf16_activations_fp32_master_weight():
    x, w, dy = operands()
    x, dy = x.bfloat16(), dy.bfloat16()
    y, dx, dw = run(x, w, dy, "nvfp4")
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    # fp32 GEMM of the quantized operands, rounded once to bf16 on output
    want = (fq(x.reshape(-1, IN).float(), "nvfp4") @ fq(w, "nvfp4", role="weight").t()).bfloat16()
    assert torch.equal(y.reshape(-1, OUT), want)


def test_hadamard_wgrad_operands_preserve_the_product_without_quantization():
    g = torch.Generator().manual_seed(1)
    for tokens in (32, 40):  # 40: padded to 48 with zero tokens
        dy, x = torch.randn(tokens, OUT, generator=g), torch.randn(tokens, IN, generator=g)
        mdy, mx = hadamard_wgrad_operands(dy, x, SIGNS)
        assert mdy.shape[0] == mx.shape[0] == -(-tokens // 16) * 16
        assert not torch.allclose(mdy[:tokens], dy)
        torch.testing.assert_close(mdy.t() @ mx, dy.t() @ x, rtol=1e-5, atol=1e-5)


def test_hadamard_wgrad_pads_tokens():
    x, w, dy = operands(lead=(5, 8))  # 40 tokens
    _, _, dw = run(x, w, dy, "nvfp4")
    x2, dy2 = x.reshape(-1, IN), dy.reshape(-1, OUT)
    mdy, mx = (random_hadamard_transform(F.pad(t, (0, 0, 0, 8)), SIGNS, dim=0) for t in (dy2, x2))
    assert torch.equal(dw, fq(mdy.t(), "nvfp4") @ fq(mx.t(), "nvfp4").t())


def test_delayed_scaling_advances_once_per_step():
    recipe = RecipeConfig(fp8_recipe="delayed", fp8_amax_history_len=4)
    state = QuantState()
    x1, w, dy1 = operands(1)
    x2, _, dy2 = operands(2)
    x2 = x2 * 3
    y1, *_ = run(x1, w, dy1, "fp8", recipe, state)
    hist = {k: int(s.amax_history.count_nonzero()) for k, s in state.delayed.items()}
    assert hist == {"x": 1, "w": 1, "dy": 1}  # X and W quantized once for fprop and reused by the backward
    assert state.delayed["x"].amax_history[0] == x1.abs().max()
    # Step 1 used scale 1; step 2 uses 448 / amax(step 1).
    assert torch.equal(y1.reshape(-1, OUT), (x1.reshape(-1, IN).to(torch.float8_e4m3fn).float()
                                             @ w.to(torch.float8_e4m3fn).float().t()))
    y2, *_ = run(x2, w, dy2, "fp8", recipe, state)
    assert [int(s.amax_history.count_nonzero()) for s in state.delayed.values()] == [2, 2, 2]
    xq = quantize_fp8_tensorwise(x2.reshape(-1, IN), E4M3, amax=x1.abs().max()).dequantized
    wq = quantize_fp8_tensorwise(w, E4M3, amax=w.abs().max()).dequantized
    assert torch.equal(y2.reshape(-1, OUT), xq @ wq.t())
    # Forward without backward (e.g. evaluation) advances X and W only.
    with torch.no_grad():
        quantized_linear(x1, w, Precision.uniform("fp8"), recipe, state)
    assert [int(s.amax_history.count_nonzero()) for s in state.delayed.values()] == [3, 3, 2]


def test_amax_reduce_applies_to_sharded_per_tensor_amaxes_only():
    x, w, dy = operands()
    calls = []

    def doubled(amax):
        calls.append(float(amax))
        return amax * 2

    y, dx, dw = run(x, w, dy, "nvfp4", amax_reduce=doubled, sharded={"w", "dy"})
    # W for fprop, dY for dgrad, W again for dgrad (quantized anew rather than kept, see
    # test_backward_keeps_no_fp32_copy_of_the_weight), M dY for wgrad.
    assert len(calls) == 4 and calls[0] == calls[2] == w.abs().max()
    wq = quantize_nvfp4(w, block=(16, 16), amax=2 * w.abs().max()).dequantized
    assert torch.equal(y.reshape(-1, OUT), fq(x.reshape(-1, IN), "nvfp4") @ wq.t())
    calls.clear()
    run(x, w, dy, "mxfp4", amax_reduce=doubled, sharded={"w", "dy"})
    assert calls == [], "block-scaled formats have no per-tensor amax"


@pytest.mark.parametrize("precision,fp8_gemm,kept", [
    ("nvfp4", "emulated", None),            # dequantized fp32 W: quantized again in backward
    ("fp8", "emulated", None),
    ("fp8", "scaled_mm", torch.float8_e4m3fn),  # FP8 bytes: 1 byte per weight, kept
])
def test_backward_keeps_no_fp32_copy_of_the_weight(precision, fp8_gemm, kept):
    """Every micro-batch in flight holds what its backward saved: the weight itself (no copy),
    or W's FP8 bytes, never a dequantized fp32 copy of the weights (nor of the input)."""
    x, w, _ = operands()
    x, w = x.to(torch.bfloat16).requires_grad_(), w.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        quantized_linear(x, w, Precision.uniform(precision), RecipeConfig(fp8_gemm=fp8_gemm), QuantState(seed=1))
    weight_like = [t for t in saved if t.shape == w.shape]
    assert any(t.data_ptr() == w.data_ptr() for t in weight_like) == (kept is None)
    copies = [t for t in weight_like if t.data_ptr() != w.data_ptr()]
    assert [t.dtype for t in copies] == ([] if kept is None else [kept])
    fp32_copies = [t for t in saved if t.dtype == torch.float32 and t.data_ptr() != w.data_ptr()]
    assert not [t for t in fp32_copies if t.numel() >= x.numel()], "an fp32 copy of X"


def test_precision_text_round_trip_and_errors():
    for text in ("bf16", "fp8", "nvfp4", "mxfp4", "fp8/bf16", "nvfp4/fp8"):
        assert str(Precision.parse(text)) == text
    assert Precision.parse("nvfp4/nvfp4") == Precision.uniform("nvfp4")
    assert BF16.is_bf16 and not Precision("bf16", "fp8").is_bf16
    for bad in ("fp16", "nvfp4/fp5", "a/b/c", ""):
        with pytest.raises(ValueError, match="precision"):
            Precision.parse(bad)
    with pytest.raises(ValueError, match="fp8_recipe"):
        RecipeConfig(fp8_recipe="hybrid")


def test_operand_quantizers_follow_te_recipes():
    r = RecipeConfig()
    assert operand_quantizer("fp8", "fprop", "x", r) == OperandQuantizer("fp8_tensorwise", element=E4M3)
    assert operand_quantizer("fp8", "dgrad", "dy", r).element == E5M2
    assert operand_quantizer("fp8", "dgrad", "dy", RecipeConfig(fp8_format="e4m3")).element == E4M3
    blockwise = RecipeConfig(fp8_recipe="blockwise")
    assert operand_quantizer("fp8", "dgrad", "w", blockwise) == OperandQuantizer("fp8_block", block=(128, 128))
    assert operand_quantizer("fp8", "wgrad", "x", blockwise) == OperandQuantizer("fp8_block", block=(1, 128),
                                                                                  columnwise=True)
    mx = RecipeConfig(fp8_recipe="mxfp8")
    assert operand_quantizer("fp8", "dgrad", "dy", mx) == OperandQuantizer("mxfp8", block=(1, 32))
    assert operand_quantizer("fp8", "dgrad", "w", mx).columnwise
    nv = {(gemm, op): operand_quantizer("nvfp4", gemm, op, r) for gemm, ops in GEMM_OPERANDS.items() for op in ops}
    assert nv["fprop", "w"] == nv["dgrad", "w"] == OperandQuantizer("nvfp4", block=(16, 16))
    assert nv["fprop", "x"] == OperandQuantizer("nvfp4", block=(1, 16))
    assert nv["dgrad", "dy"] == OperandQuantizer("nvfp4", block=(1, 16), stochastic=True)
    assert nv["wgrad", "dy"] == OperandQuantizer("nvfp4", block=(1, 16), columnwise=True, stochastic=True,
                                                 hadamard=True)
    assert nv["wgrad", "x"] == OperandQuantizer("nvfp4", block=(1, 16), columnwise=True, hadamard=True)
    assert operand_quantizer("mxfp4", "wgrad", "dy", r) == OperandQuantizer("mxfp4", block=(1, 32),
                                                                            columnwise=True, stochastic=True)
    assert [reduction_block(n, r) for n in ("bf16", "fp8", "nvfp4", "mxfp4")] == [1, 1, 16, 32]
    assert reduction_block("fp8", blockwise) == 128 and reduction_block("fp8", mx) == 32
    with pytest.raises(ValueError, match="operands"):
        operand_quantizer("fp8", "fprop", "dy", r)
